#!/usr/bin/env python3
"""dash-memd's own ingest: shards from bare senders over 1 to 32 connections at once, against loopback TCP.

``bench_fanin.py`` measures a fleet: real dash-agents and ranks, which on one
small machine share its cores with dash-memd, so its figures mix dash-memd's
cost with the fleet's. Here each connection is a process that does nothing
but send the same 16 MiB shard again and again through dash-memd's client
(``MemdClient.put_shard``, as dash-agent sends), each connection a job of its
own, so what dash-memd spends per GiB is its own: receiving, decrypting (TLS),
checksumming, committing, and writing every checkpoint to its disk (it always
does), after a round that warms it up. The loopback limit for the same bytes
is measured in the same run. ``--memory-limit`` is a round's bytes, so that no
receive waits for the disk.

Usage::

    python3 scripts/bench_ingest.py [--connections 1,4,16,32] [--gib 4] [--modes tls,plain] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402  (scripts/ is sys.path[0] when this runs as a script)

from dashrun.testing.memd import Memd  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def sender(listen: str, token_file: str, plaintext: bool, job: str, shard: int, count: int, go) -> None:
    """One connection: ``count`` checkpoints of one shard each, once ``go`` says so."""
    from dashrun.util.tokens import read_token
    from dashrun.wire.memd_client import MemdClient
    from dashrun.wire.messages import ShardHeader
    from dashrun.wire.tls import TlsSettings

    host, port = listen.rsplit(":", 1)
    data = bytearray(os.urandom(shard))
    with MemdClient(host, int(port), read_token(token_file), tls=TlsSettings(plaintext=plaintext),
                    timeout=300) as client:
        client.ping()  # logged in before the clock starts
        go.wait()
        for step in range(1, count + 1):
            header = ShardHeader(job, step, 0, 1, shard, 0, shard, 0, 0, "ab" * 32)
            if not client.put_shard(header, [data])["committed"]:
                raise RuntimeError(f"{job} step {step} was not committed")


def measure(mode: str, connections: list[int], total: int, shard: int, workdir: Path, procs: benchlib.Processes,
            side_core: int) -> list[dict]:
    """One dash-memd (on ``side_core``; the senders where they may run), warmed up first: a long-running
    dash-memd reuses its RAM buffers, where a new one first gives them memory (on a VM, several times the
    cost of receiving into them). Each row's jobs are deleted after it, so the next finds its RAM free."""
    import psutil

    where = workdir / mode
    where.mkdir(parents=True, exist_ok=True)
    write_token(where / "token")
    server = Memd(where / "memd-data", where / "token", "--memory-limit", str(total + 64 * MiB),
                  *(["--no-tls"] if mode == "plain" else []), log_path=where / "memd.log", core=side_core, timeout=60,
                  cwd=benchlib.REPO, env=benchlib.child_env())
    procs.add("dash-memd", server.start(port=0).proc)
    memd = psutil.Process(server.pid)
    rows = []
    try:
        for index, n in enumerate([max(connections)] + connections):  # the first round warms up
            count = max(1, total // shard // n)
            go = multiprocessing.Event()
            jobs = [f"ingest-{index}-{i}" for i in range(n)]
            senders = [multiprocessing.Process(target=sender, args=(
                server.address, str(server.token_file), mode == "plain", job, shard, count, go)) for job in jobs]
            for proc in senders:
                proc.start()
            time.sleep(1.0)  # every sender connected and logged in (ping) before the clock starts
            cpu = sum(memd.cpu_times()[:2])
            started = time.perf_counter()
            go.set()
            for proc in senders:
                proc.join(timeout=900)
                if proc.exitcode != 0:
                    raise RuntimeError(f"a sender failed (exit {proc.exitcode})")
            took = time.perf_counter() - started
            used = sum(memd.cpu_times()[:2]) - cpu
            with server.client(timeout=300) as client:
                for job in jobs:
                    client.delete(job, 0)
            if index:
                nbytes = n * count * shard
                rows.append({"mode": mode, "connections": n, "bytes": nbytes, "time_s": took,
                             "memd_cpu_s_per_gib": used / (nbytes / GiB), "bandwidth": nbytes / took})
    finally:
        procs.stop(server.proc, timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", default="1,4,16,32", help="numbers of connections, comma-separated")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB sent per number of connections")
    parser.add_argument("--shard-mib", type=int, default=16)
    parser.add_argument("--modes", default="tls,plain", help="tls, plain (--no-tls) or both")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    _train_core, side_core, _separate = benchlib.placement()
    machine = benchlib.machine()
    procs = benchlib.Processes()
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    connections = [int(n) for n in args.connections.split(",")]
    total, shard = int(args.gib * GiB), args.shard_mib * MiB
    try:
        loopback = benchlib.measure_loopback(min(total, 1 * GiB), side_core, procs)
        rows = [row for mode in args.modes.split(",") for row in
                measure(mode, connections, total, shard, workdir, procs, side_core)]
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    limit = loopback["bandwidth"]
    print(f"\nmachine: {benchlib.describe_machine(machine)}")
    print(f"loopback TCP limit: {limit / MiB:,.0f} MiB/s; shards of {args.shard_mib} MiB, {args.gib:g} GiB per row")
    print(f"  {'mode':6} {'connections':>11} {'MiB/s':>8} {'x limit':>8} {'dash-memd CPU s/GiB':>20}")
    for row in rows:
        print(f"  {row['mode']:6} {row['connections']:11d} {row['bandwidth'] / MiB:8,.0f} "
              f"{row['bandwidth'] / limit:8.2f} {row['memd_cpu_s_per_gib']:20.2f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "loopback": loopback, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
