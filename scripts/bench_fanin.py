#!/usr/bin/env python3
"""Fan-in benchmark: a fleet of simulated nodes checkpointing into one dash-memd at once, then restoring at once.

Starts one real dash-memd (TLS, as by default; then, with ``--modes
tls,plain``, the same again with ``--no-tls``) and ``--nodes`` simulated nodes
(``fleet.py``: a real dash-agent and a group of real rank processes
checkpointing through ``dashrun.Checkpointer``, each node a job of its own,
``--state-mib`` of replicated state split between its ranks). Every node's
checkpointing starts at once (the nodes' gates open together); each node
saves every step and its rank 0 waits until that checkpoint is committed, so
every node always has one checkpoint on its way, back to back, until each has
``--checkpoints`` (after ``--warmup`` more, which allocate and touch buffers).

Figures:

* aggregate ingest — checkpoint bytes committed per second across the nodes
  while all of them send: the commits between the moment the last node is
  past its warm-up and the moment the first node made its last commit; against
  the loopback limit measured in the same run for the bytes of one checkpoint
  of every node (``benchlib.measure_loopback``: plaintext TCP into a
  reused buffer, receiver on the last core). Target: >= 0.8x.
* commit latency per node — ``save()`` until rank 0's ``Checkpointer.wait()``
  returned committed; p50/p90/p99 per node. "No node starved": each node's
  p99 within 3x the median of the nodes' p99s (the ratio to the median of all
  commits' latencies is shown beside it).
* restore — every node's ranks SIGKILLed at once (their groups fork them
  again, as torchrun's elastic agent restarts a worker group), the time until
  each node's ranks have all restored and checked their state byte for byte;
  percentiles across nodes.
* dash-memd's RSS, sampled every 0.1 s through the run: its maximum against
  ``--memory-limit`` plus the overhead: the fixed part (the RSS of the same
  dash-memd, idle, after one client logged in) and the receive buffer each
  connection that sends shards keeps (``dashrun.wire.channel.CHUNK``; one per
  rank). The default limit holds two checkpoints per node: each node's next
  checkpoint arrives while its previous two are held, so every receive has to
  evict one (RAM pressed against the limit).

Why this state size: a checkpoint of 16 MiB (two shards of 8 MiB) takes
several milliseconds on the wire, against well under one for the requests
around it (PUT, commit, WAIT), so the figures are bandwidth-bound, not
request-bound; sixteen nodes' ranks still fit on a two-core machine.

Usage::

    python3 scripts/bench_fanin.py [--nodes 16] [--state-mib 16] [--checkpoints 10] [--modes tls,plain] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from benchlib import Processes, measure_loopback  # noqa: E402
from fleet import NodeSpec, SimNode, fleet_memd  # noqa: E402

from dashrun.testing.processes import wait_for  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402
from dashrun.util.units import format_size, parse_size  # noqa: E402
from dashrun.wire.channel import CHUNK  # noqa: E402

__all__ = ["FanIn", "main", "percentile"]

TARGET_INGEST_OVER_LOOPBACK = 0.8
TARGET_P99_OVER_MEDIAN = 3.0
#: How long any one phase may take before the benchmark gives up (16 nodes start on two cores in about a minute).
PHASE_TIMEOUT = 600.0


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the closest ranks."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


class RssSampler:
    """dash-memd's RSS every ``every`` seconds on a thread of its own, tagged with the phase it was taken in."""

    def __init__(self, pid: int, every: float = 0.1):
        self.proc = psutil.Process(pid)
        self.every = every
        self.phase = "idle"
        self.samples: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.samples.append((self.phase, self.proc.memory_info().rss))
            except psutil.NoSuchProcess:
                return

    def max(self, phase: str | None = None) -> int:
        return max((rss for p, rss in self.samples if phase is None or p == phase), default=0)


class FanIn:
    """One mode (TLS or plaintext) of the benchmark: a dash-memd, the nodes, the two phases and their figures."""

    def __init__(self, args: argparse.Namespace, workdir: Path, plain: bool):
        self.args = args
        self.plain = plain
        self.state_bytes = args.state_mib << 20
        self.limit = parse_size(args.memory_limit) if args.memory_limit else 2 * args.nodes * self.state_bytes
        token = workdir / "token"
        write_token(token)
        extra = ["--memory-limit", str(self.limit), *(["--no-tls"] if plain else [])]
        self.memd = fleet_memd(workdir, token, *extra)
        spec = NodeSpec(ranks=args.ranks, state_kib=args.state_mib << 10, step_time=0.0, interval=1, confirm_every=1,
                        gate=True)
        self.nodes = [SimNode(i, self.memd, workdir, spec) for i in range(args.nodes)]

    def run(self) -> dict:
        self.memd.start()
        try:
            idle_rss = self._idle_rss()
            with RssSampler(self.memd.pid) as rss:
                rss.phase = "start"
                started = time.monotonic()
                for node in self.nodes:
                    node.start()
                self._until(lambda: all(len(n.times("up")) >= self.args.ranks for n in self.nodes), "nodes up")
                print(f"  {len(self.nodes)} nodes of {self.args.ranks} ranks up in {time.monotonic() - started:.0f}s",
                      flush=True)
                rss.phase = "ingest"
                ingest = self._ingest()
                rss.phase = "restore"
                restore = self._restore()
            return {"mode": "plain" if self.plain else "tls", "memory_limit": self.limit, "idle_rss": idle_rss,
                    "per_connection": CHUNK, "connections": len(self.nodes) * self.args.ranks,
                    "rss_max": rss.max(), "rss_max_ingest": rss.max("ingest"), "rss_max_restore": rss.max("restore"),
                    "rss_samples": len(rss.samples), **ingest, **restore}
        finally:
            for node in self.nodes:
                node.stop()
            self.memd.stop(timeout=60)

    def _idle_rss(self) -> int:
        """dash-memd's RSS once it serves and one client has logged in and out (its TLS context is in use)."""
        with self.memd.client(timeout=30) as client:
            client.list()
        return psutil.Process(self.memd.pid).memory_info().rss

    def _until(self, predicate, what: str) -> None:
        for node in self.nodes:
            node.supervise()  # a node that died would otherwise be waited for in vain: say so
        if any(n.agent_restarts or n.group_restarts for n in self.nodes):
            raise RuntimeError(f"a node's agent or group died before {what}; see the logs in {self.args.workdir}")
        wait_for(predicate, PHASE_TIMEOUT, what, interval=0.05)

    def _ingest(self) -> dict:
        args = self.args
        wanted = args.warmup + args.checkpoints
        cpu_before = self._cpu()
        for node in self.nodes:
            node.open_gate()
        opened = time.monotonic()
        self._until(lambda: all(len(n.commits()) >= wanted for n in self.nodes), "every node's checkpoints")
        for node in self.nodes:
            node.close_gate()
        cpu = {who: used - cpu_before.get(who, 0.0) for who, used in self._cpu().items()}
        elapsed = time.monotonic() - opened
        self._until(lambda: all(len(n.times("idle")) >= args.ranks for n in self.nodes), "every node at its gate")
        commits = {node.job: node.commits() for node in self.nodes}
        with self.memd.client(timeout=30) as client:
            listed = {j["job"]: j for j in client.list()["jobs"]}
        sizes = {job: listed[job]["newest"]["nbytes"] for job in commits}
        # The window in which every node is past its warm-up and still sending.
        start = max(c[args.warmup - 1][2] if args.warmup else opened for c in commits.values())
        end = min(c[-1][2] for c in commits.values())
        window_bytes = sum(sizes[job] for job, c in commits.items() for _, _, at in c if start < at <= end)
        latencies = {job: [at - saved for _, saved, at in c[args.warmup:]] for job, c in commits.items()}
        per_node = {job: {"p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99)}
                    for job, v in latencies.items()}
        p99s = [p["p99"] for p in per_node.values()]
        median_p99 = statistics.median(p99s)
        median_all = statistics.median([x for v in latencies.values() for x in v])
        return {
            "checkpoint_bytes": sizes, "window_s": end - start, "window_bytes": window_bytes,
            "ingest": window_bytes / (end - start) if end > start else None,
            "commits": sum(len(c) for c in commits.values()), "latency": per_node,
            "latency_all": {q: percentile([x for v in latencies.values() for x in v], q) for q in (50, 90, 99)},
            "median_p99": median_p99, "worst_p99_over_median_p99": max(p99s) / median_p99,
            "worst_p99_over_median_latency": max(p99s) / median_all,
            "newest_in_ram": sum("ram" in j["newest"]["tiers"] for j in listed.values()),
            "cpu_s_per_gib": {who: used / (sum(sizes[job] * len(c) for job, c in commits.items()) / 2**30)
                              for who, used in cpu.items()},
            "cpu_busy": sum(cpu.values()) / elapsed / len(os.sched_getaffinity(0)),
        }

    def _cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of dash-memd, the agents and the ranks (alive now)."""
        def used(pids) -> float:
            total = 0.0
            for pid in pids:
                try:
                    times = psutil.Process(pid).cpu_times()
                except psutil.NoSuchProcess:
                    continue
                total += times.user + times.system
            return total

        return {"dash-memd": used([self.memd.pid]), "dash-agents": used(n.agent.pid for n in self.nodes),
                "ranks": used(pid for n in self.nodes for pid in n.rank_pids())}

    def _restore(self) -> dict:
        before = {node.job: len(node.restored_at()) for node in self.nodes}
        newest = {node.job: node.commits()[-1][0] for node in self.nodes}
        killed = time.monotonic()
        for node in self.nodes:
            node.kill_ranks()
        ranks = self.args.ranks
        self._until(lambda: all(len(n.restored_at()) >= before[n.job] + ranks for n in self.nodes),
                    "every node's ranks restored")
        times, wrong = [], []
        for node in self.nodes:
            mine = node.restored_at()[before[node.job]:]
            times.append(max(at for _, _, at in mine) - killed)
            wrong += [f"{node.job}: restored step {step} ({'right' if ok else 'WRONG bytes'}), newest "
                      f"{newest[node.job]}" for step, ok, _ in mine if not ok or step < newest[node.job]]
        return {"restore_s": {q: percentile(times, q) for q in (50, 90, 99)}, "restore_max_s": max(times),
                "restore_problems": wrong}


def report(args: argparse.Namespace, loopback: dict, results: list[dict]) -> bool:
    ok = True
    limit = loopback["bandwidth"]
    print(f"\nloopback limit (plaintext TCP, {format_size(loopback['bytes'])} into a reused buffer): "
          f"{limit / 2**20:,.0f} MiB/s")
    for r in results:
        label = "TLS" if r["mode"] == "tls" else "--no-tls"
        ingest = r["ingest"] or 0.0
        ratio = ingest / limit
        starved = r["worst_p99_over_median_p99"] > TARGET_P99_OVER_MEDIAN
        overhead = r["idle_rss"] + r["connections"] * r["per_connection"]
        within = r["rss_max"] <= r["memory_limit"] + overhead
        restore_ok = not r["restore_problems"]
        ok &= within and restore_ok and (args.no_speed_targets or (ratio >= TARGET_INGEST_OVER_LOOPBACK
                                                                    and not starved))
        lat = r["latency_all"]
        print(f"\n[{label}] {args.nodes} nodes x {args.ranks} ranks, {args.state_mib} MiB each, "
              f"{args.checkpoints} checkpoints per node after {args.warmup} of warm-up")
        met = ratio >= TARGET_INGEST_OVER_LOOPBACK
        print(f"  aggregate ingest: {ingest / 2**20:,.0f} MiB/s over {r['window_s']:.2f}s = {ratio:.2f}x loopback "
              f"(target >= {TARGET_INGEST_OVER_LOOPBACK}x): {'met' if met else 'NOT met'}")
        cpu = ", ".join(f"{who} {v:.1f}" for who, v in r["cpu_s_per_gib"].items())
        print(f"  CPU seconds per GiB committed: {cpu}; the machine's cores {r['cpu_busy']:.0%} busy")
        print(f"  commit latency, all commits: p50 {lat[50] * 1e3:.0f} ms, p90 {lat[90] * 1e3:.0f} ms, "
              f"p99 {lat[99] * 1e3:.0f} ms")
        print(f"  {'node':<8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}")
        for job, p in sorted(r["latency"].items()):
            print(f"  {job:<8} {p['p50'] * 1e3:>7.0f} {p['p90'] * 1e3:>7.0f} {p['p99'] * 1e3:>7.0f}")
        print(f"  no node starved: worst p99 = {r['worst_p99_over_median_p99']:.2f}x the median of the nodes' p99s "
              f"({r['median_p99'] * 1e3:.0f} ms; target <= {TARGET_P99_OVER_MEDIAN:g}x): "
              f"{'met' if not starved else 'NOT met'}; {r['worst_p99_over_median_latency']:.2f}x the median latency")
        rs = r["restore_s"]
        print(f"  restore, all nodes at once ({r['newest_in_ram']} of {args.nodes} newest checkpoints in RAM): "
              f"p50 {rs[50]:.2f}s, p90 {rs[90]:.2f}s, p99 {rs[99]:.2f}s, last node {r['restore_max_s']:.2f}s"
              + ("" if restore_ok else f"; PROBLEMS: {r['restore_problems']}"))
        print(f"  dash-memd RSS: at most {format_size(r['rss_max'])} (ingest {format_size(r['rss_max_ingest'])}, "
              f"restore {format_size(r['rss_max_restore'])}); --memory-limit {format_size(r['memory_limit'])} + "
              f"overhead {format_size(overhead)} (idle, one login: {format_size(r['idle_rss'])}; "
              f"{r['connections']} connections x {format_size(r['per_connection'])}) = "
              f"{format_size(r['memory_limit'] + overhead)}: {'within' if within else 'NOT within'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=16, help="simulated nodes, one job each (default 16)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--state-mib", type=int, default=16, help="replicated state per node in MiB (default 16)")
    parser.add_argument("--checkpoints", type=int, default=10, help="measured checkpoints per node (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="checkpoints per node before measuring (default 2)")
    parser.add_argument("--memory-limit", default=None,
                        help="dash-memd's --memory-limit (default: two checkpoints per node)")
    parser.add_argument("--modes", default="tls,plain", help="tls, plain (--no-tls) or both (default tls,plain)")
    parser.add_argument("--json", metavar="OUT", help="also write the figures here")
    parser.add_argument("--workdir", help="where logs and dash-memd's data go (default: a temporary directory, "
                                          "removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--no-speed-targets", action="store_true",
                        help="report the ingest and starvation targets without exiting 1 for them (a busy machine "
                             "misses them); dash-memd's memory bound and the restores still count")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"tls", "plain"} or min(args.nodes, args.ranks, args.state_mib, args.checkpoints) < 1:
        parser.error("--modes takes tls and/or plain; --nodes, --ranks, --state-mib and --checkpoints at least 1")
    temporary = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dash-fanin-"))
    args.workdir = str(workdir)
    procs = Processes()
    results = []
    try:
        print(f"loopback limit for {args.nodes} x {args.state_mib} MiB ...", flush=True)
        loopback = measure_loopback(args.nodes * (args.state_mib << 20), max(os.sched_getaffinity(0)), procs)
        for mode in modes:
            print(f"{mode}: starting dash-memd and {args.nodes} nodes in {workdir / mode}", flush=True)
            (workdir / mode).mkdir(parents=True, exist_ok=True)
            results.append(FanIn(args, workdir / mode, plain=mode == "plain").run())
    finally:
        procs.stop_all()
        if temporary and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    ok = report(args, loopback, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "loopback": loopback, "results": results},
                                              indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
