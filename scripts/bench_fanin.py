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
  dash-memd, idle, every node connected, after one scrape of its metrics; and
  1 MiB its interpreter allocates once checkpoints flow)
  and the receive buffer each connection that sends shards keeps
  (``dashrun.wire.channel.CHUNK``; one per rank). The default limit holds eight
  checkpoints per node, more than each job keeps and has on its way: nothing
  needs evicting.
* RAM pressure — dash-memd's own counts (its metrics) while the nodes send:
  RAM copies evicted to make room, receives that waited for room and for how
  long. ``--modes pressed``: TLS with a limit of 1.25 checkpoints per node
  (``--pressed-limit``) and dash-memd's data dir in memory (/dev/shm), so that
  nearly every receive must evict and what paces ingest is RAM's rule (a copy
  goes once it is safe on disk or superseded), not the disk's speed; its
  ingest against the unpressed TLS run's, and its RSS against the limit.

``--shaped`` (root): dash-memd and every node in a network namespace of their
own on one bridge (``dashrun.testing.netns``), each veth shaped both ways with
``tc tbf`` — the nodes to ``--node-rate``, dash-memd below their sum to
``--memd-rate`` — at ``--mtu``. On one 2-core machine the fleet's processes
share the cores, so unshaped fan-in is CPU-bound; shaped, the link is what
is measured. Each link's limit is measured in the same run by a bare TCP pair
over its veth (``netns.Fleet.measure``), and the figures become: aggregate
ingest against dash-memd's link (target >= 0.9x); each node's share of the
bytes committed in the window (its commits, the one on its way counted by the
share of its interval gone) within 20 % of the fair share; the slowest node's
median commit <= 1.25x the fair-share time (one checkpoint at 1/nodes of
dash-memd's link). Thirty checkpoints per node by default: TCP flows sharing
one first-in first-out queue get even shares over a minute, not over ten
seconds. ``--data-in-memory`` puts dash-memd's data dir in /dev/shm in every
mode, for links faster than its disk.

Why this state size: a checkpoint of 16 MiB (two shards of 8 MiB) takes
several milliseconds on the wire, against well under one for the requests
around it (PUT, commit, WAIT), so the figures are bandwidth-bound, not
request-bound; sixteen nodes' ranks still fit on a two-core machine.

Usage::

    python3 scripts/bench_fanin.py [--nodes 16] [--state-mib 16] [--checkpoints 10] [--modes tls,plain] [--json OUT]
    sudo python3 scripts/bench_fanin.py --shaped --modes tls,pressed [--memd-rate 160MiB] [--node-rate 20MiB]
        [--mtu 9001] [--checkpoints 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from benchlib import Processes, measure_loopback  # noqa: E402
from fleet import NodeSpec, SimNode, fleet_memd  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dashrun.testing import netns  # noqa: E402
from dashrun.testing.processes import free_port as _free_port  # noqa: E402
from dashrun.testing.processes import wait_for  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402
from dashrun.util.units import format_size, parse_size  # noqa: E402
from dashrun.wire.channel import CHUNK  # noqa: E402

__all__ = ["FanIn", "main", "percentile"]

TARGET_INGEST_OVER_LOOPBACK = 0.8
TARGET_P99_OVER_MEDIAN = 3.0
#: --shaped: aggregate ingest against dash-memd's link, each node's share against the fair one, the slowest
#: node's median commit against the time a checkpoint takes at the fair share of the link.
TARGET_INGEST_OVER_LINK = 0.9
TARGET_SHARE_SPREAD = 0.2
TARGET_SLOWEST_OVER_FAIR = 1.25
#: dash-memd's --memory-limit in checkpoints per node: room for the two each job keeps in RAM (--keep-ram) and
#: the two each rank may have on their way (its staging buffers), and more (nothing needs evicting: the link is
#: measured); pressed: fewer than each node's
#: newest and the one arriving, so that nearly every receive evicts (``--modes pressed``).
AMPLE_CHECKPOINTS_PER_NODE = 8
PRESSED_CHECKPOINTS_PER_NODE = 1.25
#: What dash-memd's interpreter allocates once checkpoints flow, beyond its RSS idle (the receive path's and the
#: disk writer's objects): half a MiB to a MiB, measured with checkpoints of 1 MiB, where nothing else hides it.
HEAP_AT_WORK = 1 << 20
#: Where dash-memd serves its metrics in its own namespace (--shaped): nothing else listens there.
METRICS_PORT = 9464
MODES = ("tls", "plain", "pressed")
#: The key of dash-memd's user CPU time among the CPU figures (a part of its total, not beside it).
MEMD_USER = "dash-memd (user time)"
#: How long any one phase may take before the benchmark gives up (16 nodes start on two cores in about a minute).
PHASE_TIMEOUT = 600.0


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the closest ranks."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def progress(commits: list[tuple[int, float, float]], at: float) -> float:
    """How many of a node's checkpoints had committed at ``at``, counting the one on its way by the share of its
    interval gone: the node's bytes between two moments are its checkpoint's size times the difference."""
    times = [committed for _, _, committed in commits]
    done = sum(t <= at for t in times)
    if done == 0 or done == len(times):
        return float(done)
    before, after = times[done - 1], times[done]
    return done + (at - before) / (after - before)


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

    def __init__(self, args: argparse.Namespace, workdir: Path, mode: str, fleet: netns.Fleet | None = None):
        self.args = args
        self.mode = mode
        self.plain = mode == "plain"
        self.state_bytes = args.state_mib << 20
        per_node = PRESSED_CHECKPOINTS_PER_NODE if mode == "pressed" else AMPLE_CHECKPOINTS_PER_NODE
        limit = args.pressed_limit if mode == "pressed" else args.memory_limit
        self.limit = parse_size(limit) if limit else int(per_node * args.nodes * self.state_bytes)
        token = workdir / "token"
        write_token(token)
        host = fleet[0].address if fleet is not None else "127.0.0.1"
        self.metrics = f"{host}:{METRICS_PORT if fleet is not None else _free_port()}"
        extra = ["--memory-limit", str(self.limit), "--metrics-listen", self.metrics,
                 *(["--no-tls"] if self.plain else [])]
        # RAM pressed, the disk out of the way: a data dir in memory, so that what paces ingest is RAM's rule (a
        # copy goes once it is safe on disk or superseded), not the disk's speed.
        in_memory = mode == "pressed" or args.data_in_memory
        self.shm = Path(tempfile.mkdtemp(prefix="dash-fanin-", dir="/dev/shm")) if in_memory else None
        self.memd = fleet_memd(workdir, token, *extra, data_dir=self.shm and self.shm / "memd-data",
                               netns=fleet[0] if fleet is not None else None)
        spec = NodeSpec(ranks=args.ranks, state_kib=args.state_mib << 10, step_time=0.0, interval=1, confirm_every=1,
                        gate=True)
        self.nodes = [SimNode(i, self.memd, workdir, spec, netns=fleet[i + 1] if fleet is not None else None)
                      for i in range(args.nodes)]

    def run(self) -> dict:
        self.memd.start()
        try:
            with RssSampler(self.memd.pid) as rss:
                rss.phase = "start"
                started = time.monotonic()
                for node in self.nodes:
                    node.start()
                self._until(lambda: all(len(n.times("up")) >= self.args.ranks for n in self.nodes), "nodes up")
                print(f"  {len(self.nodes)} nodes of {self.args.ranks} ranks up in {time.monotonic() - started:.0f}s",
                      flush=True)
                idle_rss = self._idle_rss()
                rss.phase = "ingest"
                pressure_before = self._pressure()
                ingest = self._ingest()
                pressure = {k: v - pressure_before[k] for k, v in self._pressure().items()}
                rss.phase = "restore"
                restore = self._restore()
            return {"mode": self.mode, "memory_limit": self.limit, "idle_rss": idle_rss, "pressure": pressure,
                    "per_connection": CHUNK, "connections": len(self.nodes) * self.args.ranks,
                    "rss_max": rss.max(), "rss_max_ingest": rss.max("ingest"), "rss_max_restore": rss.max("restore"),
                    "rss_samples": len(rss.samples), **ingest, **restore}
        finally:
            for node in self.nodes:
                node.stop()
            self.memd.stop(timeout=60)
            if self.shm is not None:
                shutil.rmtree(self.shm, ignore_errors=True)

    def _pressure(self) -> dict[str, float]:
        """dash-memd's counts of RAM pressure so far (its metrics): evictions, receives that waited, seconds."""
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30) as response:
            text = response.read().decode()
        found = {sample.name: sample.value for family in text_string_to_metric_families(text)
                 for sample in family.samples}
        return {"evictions": found["dash_memd_ram_evictions_total"],
                "room_waits": found["dash_memd_ram_room_waits_total"],
                "room_wait_s": found["dash_memd_ram_room_wait_seconds_total"]}

    def _idle_rss(self) -> int:
        """dash-memd's RSS with every node's ranks connected and logged in (their threads and TLS state), nothing
        sent yet, one more client logged in and out and its metrics scraped once (their thread is running)."""
        with self.memd.client(timeout=30) as client:
            client.list()
        self._pressure()
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
        shares = {job: sizes[job] * (progress(c, end) - progress(c, start)) for job, c in commits.items()}
        latencies = {job: [at - saved for _, saved, at in c[args.warmup:]] for job, c in commits.items()}
        per_node = {job: {"p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99)}
                    for job, v in latencies.items()}
        p99s = [p["p99"] for p in per_node.values()]
        median_p99 = statistics.median(p99s)
        median_all = statistics.median([x for v in latencies.values() for x in v])
        return {
            "checkpoint_bytes": sizes, "window_s": end - start, "window_bytes": window_bytes, "node_bytes": shares,
            "ingest": window_bytes / (end - start) if end > start else None,
            "commits": sum(len(c) for c in commits.values()), "latency": per_node,
            "latency_all": {q: percentile([x for v in latencies.values() for x in v], q) for q in (50, 90, 99)},
            "median_p99": median_p99, "worst_p99_over_median_p99": max(p99s) / median_p99,
            "worst_p99_over_median_latency": max(p99s) / median_all,
            "newest_in_ram": sum("ram" in j["newest"]["tiers"] for j in listed.values()),
            "cpu_s_per_gib": {who: used / (sum(sizes[job] * len(c) for job, c in commits.items()) / 2**30)
                              for who, used in cpu.items()},
            "cpu_busy": sum(v for k, v in cpu.items() if k != MEMD_USER) / elapsed / len(os.sched_getaffinity(0)),
        }

    def _cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of dash-memd, the agents and the ranks (alive now), and dash-memd's
        user time alone (its own work; the kernel's work for its packets, on shaped veths most of it, is system
        time)."""
        def used(pids, user_only: bool = False) -> float:
            total = 0.0
            for pid in pids:
                try:
                    times = psutil.Process(pid).cpu_times()
                except psutil.NoSuchProcess:
                    continue
                total += times.user + (0.0 if user_only else times.system)
            return total

        return {"dash-memd": used([self.memd.pid]), "dash-agents": used(n.agent.pid for n in self.nodes),
                "ranks": used(pid for n in self.nodes for pid in n.rank_pids()),
                MEMD_USER: used([self.memd.pid], user_only=True)}

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


def report(args: argparse.Namespace, limits: dict, results: list[dict]) -> bool:
    ok = True
    loopback, link = limits.get("loopback"), limits.get("memd_link")
    if loopback:
        print(f"\nloopback limit (plaintext TCP, {format_size(loopback['bytes'])} into a reused buffer): "
              f"{loopback['bandwidth'] / 2**20:,.0f} MiB/s")
    else:
        print(f"\ndash-memd's link, shaped to {args.memd_rate}/s: {link / 2**20:,.0f} MiB/s; one node's, shaped to "
              f"{args.node_rate}/s: {limits['node_link'] / 2**20:,.0f} MiB/s (bare TCP pairs over the same veths)")
    unpressed = {r["mode"]: r["ingest"] for r in results if r["mode"] != "pressed"}
    for r in results:
        label = {"tls": "TLS", "plain": "--no-tls", "pressed": "TLS, RAM pressed"}[r["mode"]]
        ingest = r["ingest"] or 0.0
        lat = r["latency_all"]
        print(f"\n[{label}] {args.nodes} nodes x {args.ranks} ranks, {args.state_mib} MiB each, "
              f"{args.checkpoints} checkpoints per node after {args.warmup} of warm-up")
        if loopback:
            ratio = ingest / loopback["bandwidth"]
            met = ratio >= TARGET_INGEST_OVER_LOOPBACK
            print(f"  aggregate ingest: {ingest / 2**20:,.0f} MiB/s over {r['window_s']:.2f}s = {ratio:.2f}x loopback "
                  f"(target >= {TARGET_INGEST_OVER_LOOPBACK}x): {'met' if met else 'NOT met'}")
        else:
            met = report_shaped(args, link, r)
        starved = r["worst_p99_over_median_p99"] > TARGET_P99_OVER_MEDIAN
        cpu = ", ".join(f"{who} {v:.2f}" for who, v in r["cpu_s_per_gib"].items())
        print(f"  CPU seconds per GiB committed: {cpu}; the machine's cores {r['cpu_busy']:.0%} busy")
        print(f"  commit latency, all commits: p50 {lat[50] * 1e3:.0f} ms, p90 {lat[90] * 1e3:.0f} ms, "
              f"p99 {lat[99] * 1e3:.0f} ms")
        if args.nodes <= 32:
            print(f"  {'node':<8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}")
            for job, p in sorted(r["latency"].items()):
                print(f"  {job:<8} {p['p50'] * 1e3:>7.0f} {p['p90'] * 1e3:>7.0f} {p['p99'] * 1e3:>7.0f}")
        print(f"  no node starved: worst p99 = {r['worst_p99_over_median_p99']:.2f}x the median of the nodes' p99s "
              f"({r['median_p99'] * 1e3:.0f} ms; target <= {TARGET_P99_OVER_MEDIAN:g}x): "
              f"{'met' if not starved else 'NOT met'}; {r['worst_p99_over_median_latency']:.2f}x the median latency")
        pressure = r["pressure"]
        commits = r["commits"]
        print(f"  RAM pressure while sending: {pressure['evictions']:.0f} evictions for {commits} commits, "
              f"{pressure['room_waits']:.0f} receives waited for room ({pressure['room_wait_s']:.2f}s in all)"
              + (f"; ingest {ingest / unpressed['tls']:.2f}x the unpressed TLS run's" if r["mode"] == "pressed"
                 and unpressed.get("tls") else ""))
        rs = r["restore_s"]
        restore_ok = not r["restore_problems"]
        print(f"  restore, all nodes at once ({r['newest_in_ram']} of {args.nodes} newest checkpoints in RAM): "
              f"p50 {rs[50]:.2f}s, p90 {rs[90]:.2f}s, p99 {rs[99]:.2f}s, last node {r['restore_max_s']:.2f}s"
              + ("" if restore_ok else f"; PROBLEMS: {r['restore_problems']}"))
        overhead = r["idle_rss"] + HEAP_AT_WORK + r["connections"] * r["per_connection"]
        within = r["rss_max"] <= r["memory_limit"] + overhead
        print(f"  dash-memd RSS: at most {format_size(r['rss_max'])} (ingest {format_size(r['rss_max_ingest'])}, "
              f"restore {format_size(r['rss_max_restore'])}); --memory-limit {format_size(r['memory_limit'])} + "
              f"overhead {format_size(overhead)} (idle, its clients connected: {format_size(r['idle_rss'])}; its heap at work "
              f"{format_size(HEAP_AT_WORK)}; "
              f"{r['connections']} connections x {format_size(r['per_connection'])}) = "
              f"{format_size(r['memory_limit'] + overhead)}: {'within' if within else 'NOT within'}")
        ok &= within and restore_ok and (args.no_speed_targets or r["mode"] == "pressed" or (met and not starved))
    return ok


def report_shaped(args: argparse.Namespace, link: float, r: dict) -> bool:
    """The --shaped figures of one mode against dash-memd's link; True if the speed targets are met."""
    ingest = r["ingest"] or 0.0
    ratio = ingest / link
    shares = r["node_bytes"]
    fair = sum(shares.values()) / len(shares)
    spread = [b / fair for b in shares.values()]
    size = statistics.median(r["checkpoint_bytes"].values())
    fair_time = size * args.nodes / link
    slowest = max(p["p50"] for p in r["latency"].values())
    targets = [ratio >= TARGET_INGEST_OVER_LINK, max(abs(x - 1) for x in spread) <= TARGET_SHARE_SPREAD,
               slowest / fair_time <= TARGET_SLOWEST_OVER_FAIR]
    words = ["met" if t else "NOT met" for t in targets]
    print(f"  aggregate ingest: {ingest / 2**20:,.0f} MiB/s over {r['window_s']:.2f}s = {ratio:.2f}x dash-memd's link "
          f"(target >= {TARGET_INGEST_OVER_LINK}x): {words[0]}")
    print(f"  each node's share of the bytes in that window: {min(spread):.2f}x..{max(spread):.2f}x the fair share "
          f"(target within {TARGET_SHARE_SPREAD:.0%}): {words[1]}")
    print(f"  the slowest node's median commit: {slowest * 1e3:,.0f} ms = {slowest / fair_time:.2f}x the fair-share "
          f"time ({format_size(int(size))} at 1/{args.nodes} of the link: {fair_time * 1e3:,.0f} ms; target <= "
          f"{TARGET_SLOWEST_OVER_FAIR}x): {words[2]}")
    r.update(ingest_over_link=ratio, share_min=min(spread), share_max=max(spread), fair_time_s=fair_time,
             slowest_p50_over_fair=slowest / fair_time)
    return all(targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=16, help="simulated nodes, one job each (default 16)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--state-mib", type=int, default=16, help="replicated state per node in MiB (default 16)")
    parser.add_argument("--checkpoints", type=int, default=None,
                        help="measured checkpoints per node (default 10; 30 with --shaped: TCP flows sharing one "
                             "queue even out over a minute, not over ten seconds)")
    parser.add_argument("--warmup", type=int, default=2, help="checkpoints per node before measuring (default 2)")
    parser.add_argument("--memory-limit", default=None,
                        help=f"dash-memd's --memory-limit (default: {AMPLE_CHECKPOINTS_PER_NODE} checkpoints per "
                             "node: nothing evicted)")
    parser.add_argument("--modes", default="tls,plain",
                        help="tls; plain (--no-tls); pressed (TLS, --memory-limit of --pressed-limit and a data dir "
                             "in memory: RAM's back-pressure, not the disk's speed) (default tls,plain)")
    parser.add_argument("--pressed-limit", default=None,
                        help="dash-memd's --memory-limit in the pressed mode (default: "
                             f"{PRESSED_CHECKPOINTS_PER_NODE:g} checkpoints per node)")
    parser.add_argument("--data-in-memory", action="store_true",
                        help="dash-memd's data dir in /dev/shm in every mode (the pressed mode's always is): its "
                             "disk writes at memory speed, so that a slow disk does not pace ingest")
    parser.add_argument("--shaped", action="store_true",
                        help="every node and dash-memd in a network namespace of its own (root), its veth shaped "
                             "with tc tbf both ways: the nodes to --node-rate, dash-memd to --memd-rate")
    parser.add_argument("--mtu", type=int, default=9001,
                        help="--shaped: every link's MTU (default 9001, AWS's within a VPC: at 1500 the kernel's "
                             "per-packet work on the veths takes this machine's cores before the links fill)")
    parser.add_argument("--node-rate", default="20MiB", help="--shaped: each node's link per second (default 20MiB)")
    parser.add_argument("--memd-rate", default="160MiB",
                        help="--shaped: dash-memd's link per second (default 160MiB: half of 16 nodes' sum)")
    parser.add_argument("--json", metavar="OUT", help="also write the figures here")
    parser.add_argument("--workdir", help="where logs and dash-memd's data go (default: a temporary directory, "
                                          "removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--no-speed-targets", action="store_true",
                        help="report the ingest and starvation targets without exiting 1 for them (a busy machine "
                             "misses them); dash-memd's memory bound and the restores still count")
    args = parser.parse_args(argv)
    if args.checkpoints is None:
        args.checkpoints = 30 if args.shaped else 10
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES) or min(args.nodes, args.ranks, args.state_mib, args.checkpoints) < 1:
        parser.error(f"--modes takes {', '.join(MODES)}; --nodes, --ranks, --state-mib and --checkpoints at least 1")
    if args.shaped and (reason := netns.unavailable()):
        parser.error(f"--shaped puts every node in a network namespace: {reason}")
    temporary = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dash-fanin-"))
    args.workdir = str(workdir)
    procs = Processes()
    results = []
    nbytes = args.nodes * (args.state_mib << 20)
    try:
        with netns.Fleet(args.nodes + 1, mtu=args.mtu) if args.shaped else contextlib.nullcontext() as fleet:
            if fleet is not None:
                limits = shape_fleet(args, fleet, nbytes)
            else:
                print(f"loopback limit for {args.nodes} x {args.state_mib} MiB ...", flush=True)
                limits = {"loopback": measure_loopback(nbytes, max(os.sched_getaffinity(0)), procs)}
            for mode in modes:
                print(f"{mode}: starting dash-memd and {args.nodes} nodes in {workdir / mode}", flush=True)
                (workdir / mode).mkdir(parents=True, exist_ok=True)
                results.append(FanIn(args, workdir / mode, mode, fleet).run())
    finally:
        procs.stop_all()
        if temporary and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    ok = report(args, limits, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), **limits, "results": results},
                                              indent=1, default=str))
    return 0 if ok else 1


def shape_fleet(args: argparse.Namespace, fleet: netns.Fleet, nbytes: int) -> dict:
    """dash-memd's node behind ``--memd-rate`` both ways, every other node behind ``--node-rate``; each link's
    limit measured with a bare TCP pair over its veth (from the root namespace, which no rate holds back)."""
    memd_rate, node_rate = parse_size(args.memd_rate), parse_size(args.node_rate)
    fleet[0].shape(_tc_rate(memd_rate), netns.burst(memd_rate, args.mtu))
    fleet[0].shape_inbound(_tc_rate(memd_rate), netns.burst(memd_rate, args.mtu))
    for node in fleet.nodes[1:]:
        node.shape(_tc_rate(node_rate), netns.burst(node_rate, args.mtu))
        node.shape_inbound(_tc_rate(node_rate), netns.burst(node_rate, args.mtu))
    print(f"dash-memd's link ({args.memd_rate}/s) and one node's ({args.node_rate}/s) ...", flush=True)
    return {"memd_link": fleet.measure(None, fleet[0], nbytes),
            "node_link": fleet.measure(fleet[1], None, args.state_mib << 20)}


def _tc_rate(bytes_per_s: int) -> str:
    return f"{bytes_per_s * 8}bit"


if __name__ == "__main__":
    sys.exit(main())
