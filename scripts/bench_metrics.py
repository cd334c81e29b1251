#!/usr/bin/env python3
"""What dash-memd's Prometheus metrics cost: commits per second with and without ``--metrics-listen``, side by
side, and one scrape's time and size as the jobs grow.

Two dash-memd processes on this machine, one serving /metrics (scraped once a second meanwhile, as a
Prometheus would at its fastest), one not, take the same small checkpoints (2 ranks of ``--shard`` bytes) in
many short alternating rounds, so that both see the same machine; the best round of each is what it can do
(a shared machine only slows rounds down), the median says how steady the machine was; the ratio of the
bests is what counting costs a commit. Then the
serving one takes ``--jobs`` jobs' checkpoints and is scraped: the time and bytes of one /metrics reply.

    python scripts/bench_metrics.py [--rounds 20 --commits 50 --shard 65536 --jobs 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchlib import describe_machine, machine

from dashrun.testing.memd import Memd
from dashrun.testing.processes import free_port
from dashrun.util.tokens import write_token
from dashrun.wire.messages import ShardHeader

LAYOUT = "ab" * 32


def commit(client, job: str, step: int, payload: bytes) -> None:
    shard = len(payload)
    for rank in range(2):
        client.put_shard(ShardHeader(job, step, rank, 2, 2 * shard, shard * rank, shard * (rank + 1), 0, 0, LAYOUT),
                         [payload])


def commits_per_second(memd: Memd, job: str, first: int, count: int, payload: bytes) -> float:
    with memd.client(timeout=60) as client:
        began = time.perf_counter()
        for step in range(first, first + count):
            commit(client, job, step, payload)
        return count / (time.perf_counter() - began)


def scrape(address: str) -> tuple[float, int]:
    began = time.perf_counter()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as reply:
        size = len(reply.read())
    return time.perf_counter() - began, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--commits", type=int, default=50, help="checkpoints per round")
    parser.add_argument("--shard", type=int, default=64 << 10, help="bytes per rank's shard")
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    payload = os.urandom(args.shard)
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        root = Path(tmp)
        token = root / "token"
        write_token(token)
        port = free_port()
        metered = Memd(root / "metered", token, "--memory-limit", "1GiB", "--metrics-listen", str(port),
                       "--log-level", "WARNING", log_path=root / "metered.log").start()
        plain = Memd(root / "plain", token, "--memory-limit", "1GiB", "--log-level", "WARNING",
                     log_path=root / "plain.log").start()
        address = f"127.0.0.1:{port}"
        stop = threading.Event()

        def scraper() -> None:  # a Prometheus at a 1 s interval, while the commits run
            while not stop.wait(1.0):
                scrape(address)

        thread = threading.Thread(target=scraper, daemon=True)
        thread.start()
        try:
            rates = {"with --metrics-listen": [], "without": []}
            for round_ in range(args.rounds):
                first = 1 + round_ * args.commits
                order = [("with --metrics-listen", metered), ("without", plain)]
                for name, memd in order if round_ % 2 == 0 else reversed(order):
                    rates[name].append(commits_per_second(memd, "bench", first, args.commits, payload))
            stop.set()
            thread.join()
            with metered.client(timeout=60) as client:
                for job in range(args.jobs):
                    commit(client, f"job-{job:05d}", 1, payload[:1024])
            scrapes = [scrape(address) for _ in range(5)]
        finally:
            stop.set()
            metered.stop()
            plain.stop()
    best = {name: max(values) for name, values in rates.items()}
    print(f"machine: {describe_machine(machine())}, load average {os.getloadavg()[0]:.1f}")
    print(f"commits of 2 x {args.shard >> 10} KiB, {args.rounds} rounds of {args.commits}, alternating:")
    print("| dash-memd | commits/s, best round | median round | ratio of the bests |")
    print("|---|---|---|---|")
    for name, label in (("with --metrics-listen", "with --metrics-listen (scraped every 1 s)"),
                        ("without", "without")):
        print(f"| {label} | {best[name]:,.0f} | {statistics.median(rates[name]):,.0f} | "
              f"{best[name] / best['without']:.2f} |")
    seconds = statistics.median(s for s, _ in scrapes)
    print(f"one scrape with {args.jobs + 1} jobs: {seconds * 1e3:.1f} ms (median of 5), "
          f"{scrapes[0][1] / 1024:.0f} KiB")


if __name__ == "__main__":
    sys.exit(main())
