"""Restore from the fleet's own RAM against dash-memd behind a thin link (``bench_restore.py --peers``; root).

A fleet of network namespaces on one bridge (``dashrun.testing.netns``, every link at ``--mtu``): dash-memd in
one of its own, its link shaped both ways with ``tc tbf`` (``--memd-rate``), every node's link shaped both ways
to a node's NIC (``--node-rate``, a multiple of dash-memd's); three holder nodes, each a dash-agent with one
rank (this process), save the state as one job with ``--replicas 1`` (each node keeps its own shard and one
other's), and the same state again as a second job through agents with ``--replicas 0`` (only dash-memd holds
it). Then, in the same run, side by side, N = 1, 2, 3 new nodes restore it at once (a rank process each,
released together), from the peers and from dash-memd: per node and the wall time of the N, with their ratio.

The peer link's limit: a bare TCP pair (no TLS, no framing, ``Fleet.measure``) moving the same bytes from a
holder's namespace to a new node's, over the same veths and bridge; restore-from-peer / that limit. For N new
nodes at once, N bare pairs at once (holder i to new node i, ``Fleet.measure_pairs``) on the same links and
cores: restore / the slowest pair's time.

What replicas cost the training nodes: two nodes (two agents, a rank each, trained and checkpointed in this
process) train for ``--steps`` steps without checkpoints, with ``--replicas 0`` and with ``--replicas 1``, every
link unshaped; a checkpoint every ``--interval`` steps, by default twice the slower way's commit time (measured
first, as docs/usage.md says to set it); the added training time per checkpoint of each, the training
process's own CPU time of it, and the agents' CPU and memory (RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import benchlib

from dashrun.testing import netns, pinning
from dashrun.testing.agent import Agent
from dashrun.testing.memd import Memd
from dashrun.testing.processes import wait_for

MiB = 1 << 20
HOLDERS = 3

#: A new node's rank: builds the model, then waits for the go-file and restores (one line: its seconds).
RESTORER = """
import os, sys, time
sys.path.insert(0, {scripts!r})
import torch
torch.set_num_threads(1)
from benchlib import build_model
model, optimizer, _batch, _ = build_model({size})
import dashrun
ckpt = dashrun.Checkpointer(model=model, optimizer=optimizer, interval=10**9)
print("READY", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.002)
started, cpu = time.perf_counter(), os.times()
step = ckpt.restore()
spent = os.times()
print("RESTORED", step, time.perf_counter() - started, time.time(), spent.user - cpu.user,
      spent.system - cpu.system, flush=True)
ckpt.close()
"""


class Bench:
    def __init__(self, fleet: netns.Fleet, workdir: Path, size: int, rate: str, node_rate: str | None):
        from dashrun.util.tokens import write_token

        self.fleet, self.dir, self.size, self.rate, self.node_rate = fleet, workdir, size, rate, node_rate
        self.token_file = workdir / "token"
        write_token(self.token_file)
        self.thin = fleet[0]  # dash-memd's
        self.holders = fleet.nodes[1:1 + HOLDERS]
        self.newcomers = fleet.nodes[1 + HOLDERS:]
        self.shape(True)
        self.memd = Memd(workdir / "memd-data", self.token_file, "--memory-limit", "2GiB",
                         log_path=workdir / "memd.log", netns=self.thin).start()
        # Nodes are machines of their own: the holders (and dash-memd) on one core, the nodes restoring on the
        # other, as the bare pair's sender and receiver.
        self.near, self.far, self.separate = pinning.placement()
        pinning.pin_pid(self.memd.pid, {self.far})
        self.agents: list[Agent] = []

    def agent(self, node: netns.Node, name: str, job: str, replicas: int, prefetch: bool = False) -> Agent:
        env = {"DASH_JOB_ID": job, "DASH_REPLICAS": str(replicas), "DASH_PEER_PORT": "0", "DASH_NODE": name,
               "DASH_FAILURE_DOMAIN": f"z-{name}/p", "DASH_CLOUD": "none", **benchlib.child_env(),
               **({"DASH_PEER_MEMORY_LIMIT": str(4 * self.size)} if replicas else {}),
               **({} if prefetch else {"DASH_NO_PREFETCH": "1"})}
        agent = Agent(self.memd, self.dir / f"{name}.sock", self.dir / f"{name}.log", env, netns=node)
        pinning.pin_pid(agent.pid, {self.near if node in self.newcomers else self.far})
        self.agents.append(agent)
        return agent

    def rank_env(self, agent: Agent, job: str, rank: int, world: int) -> dict:
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1", "DASH_JOB_ID": job,
                "DASH_AGENT_SOCKET": str(agent.socket_path), "DASH_MEMD": self.memd.address,
                "DASH_TOKEN_FILE": str(self.token_file)}

    def checkpointers(self, agents: list[Agent], job: str, model, optimizer, interval: int) -> list:
        import dashrun

        made = []
        for rank, agent in enumerate(agents):
            with mock.patch.dict(os.environ, self.rank_env(agent, job, rank, len(agents))):
                made.append(dashrun.Checkpointer(model=model, optimizer=optimizer, interval=interval))
        return made

    def save(self, job: str, replicas: int, model, optimizer) -> int:
        agents = [self.agent(node, f"{job}-h{i}", job, replicas) for i, node in enumerate(self.holders)]
        if replicas:
            for agent in agents:
                wait_for(lambda: "this node's replicas go to" in agent.log() and "no other" not in
                         agent.log().rsplit("replicas go to", 1)[-1], 60, "replicas placed")
        ranks = self.checkpointers(agents, job, model, optimizer, 10**9)
        for ckpt in ranks:
            ckpt.save(7, force=True)
        if not all(ckpt.wait(timeout=600) for ckpt in ranks):
            raise RuntimeError(f"{job}: step 7 was not committed")
        for ckpt in ranks:
            ckpt.close()
        with self.memd.client() as client:
            if replicas:  # each holder announced its own shard and one other's
                wait_for(lambda: sum(len(n.steps.get(7, [])) for n in client.fleet_view(job)[2]) >= 2 * HOLDERS,
                         120, "the replicas to be held")
            # committed by the fleet's copies first, dash-memd catches up behind its thin link
            wait_for(lambda: client.latest(job) is not None, 600, "dash-memd to hold the step")
            return client.latest(job).nbytes

    def restore(self, job: str, count: int, replicas: int) -> dict:
        """``count`` new nodes restore ``job`` at once; per node seconds and the wall time of them all."""
        go = self.dir / f"go-{job}-{count}"
        script = self.dir / "restorer.py"
        script.write_text(RESTORER.format(scripts=str(Path(__file__).parent), size=self.size))
        procs = []
        for i in range(count):
            agent = self.agent(self.newcomers[i], f"{job}-new{count}-{i}", job, replicas)
            env = {**benchlib.child_env(), **self.rank_env(agent, job, i % HOLDERS, HOLDERS)}
            # in the new node's namespace, as its agent: every byte it reads comes over that node's link
            procs.append(self.newcomers[i].popen(["taskset", "-c", str(self.near), sys.executable, str(script),
                                                  str(go)], env=env, stdout=subprocess.PIPE, text=True))
        try:
            for proc in procs:
                if proc.stdout.readline().strip() != "READY":
                    raise RuntimeError("a restoring rank did not start")
            received = [node.rx_bytes() for node in self.newcomers[:count]]
            go.touch()
            released = time.time()
            lines = [proc.communicate(timeout=600)[0].split() for proc in procs]
            received = [node.rx_bytes() - before for node, before in zip(self.newcomers[:count], received)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        fetched = []  # the node's dash-agent's own account of its fetch (the rank then loads from its image)
        for agent in self.agents[-count:]:
            agent.stop()
            fetched += [float(m.group(1)) for m in re.finditer(rf"fetched {job} step \d+ \(.*?\) in ([\d.]+)s",
                                                                agent.log())]
        seconds = [float(line[2]) for line in lines]
        rank_cpu = [float(line[4]) + float(line[5]) for line in lines]
        rank_system = [float(line[5]) for line in lines]
        return {"per_node_s": seconds, "median_s": statistics.median(seconds), "received_bytes": received,
                "rank_cpu_s": rank_cpu, "rank_system_cpu_s": rank_system,
                "wall_s": max(float(line[3]) for line in lines) - released,
                "agent_fetch_s": statistics.median(fetched) if fetched else None}

    def shape(self, on: bool) -> None:
        """dash-memd's link at ``rate`` both ways and every node's at ``node_rate`` (a node's NIC), or none."""
        for node in self.fleet.nodes:
            rate = self.rate if node is self.thin else self.node_rate
            if rate is None or not on:
                node.shape(None)
                node.shape_inbound(None)
                continue
            bucket = netns.burst(int(fleet_rate(rate)), self.fleet.mtu)
            node.shape(rate, bucket)
            node.shape_inbound(rate, bucket)

    def stop(self) -> None:
        for agent in reversed(self.agents):
            if agent.proc.poll() is None:
                agent.stop()
        self.agents.clear()


def training_cost(bench: Bench, steps: int, interval: int, rounds: int) -> dict:
    """Two nodes train one model; the loop's seconds without checkpoints, with replicas 0 and with replicas 1,
    and the CPU seconds the nodes' dash-agents spend per checkpoint. The training ranks (this process) run on a
    core of their own, the agents and dash-memd on the other: a node's agent uses cores that training leaves.
    ``interval`` 0: a checkpoint every K steps, K twice the slower way's commit time (docs/usage.md's rule),
    the same K for both ways; ``steps`` 0: twelve intervals."""
    import psutil

    pinning.pin_process({bench.near})
    bench.shape(False)
    model, optimizer, batch, _ = benchlib.build_model(bench.size)
    trainer = benchlib.Trainer(model, optimizer, batch)
    for _ in range(3):
        trainer.step()
    started = time.perf_counter()
    for _ in range(10):
        trainer.step()
    step_s = (time.perf_counter() - started) / 10
    commit_s = {replicas: commit_time(bench, replicas, model, optimizer) for replicas in (0, 1)}
    if interval <= 0:
        interval = max(1, round(2 * max(commit_s.values()) / step_s))
    steps = steps if steps > 0 else 12 * interval
    times: dict[str, list[float]] = {"no checkpoints": [], "--replicas 0": [], "--replicas 1": []}
    cpu: dict[str, list[float]] = {label: [] for label in times}
    rss: dict[str, float] = {}
    agent_cpu: dict[str, list[float]] = {}  # per node, per checkpoint
    memd_cpu: dict[str, list[float]] = {}  # per checkpoint of the job
    taken: dict[str, list[int]] = {}  # checkpoints a rank took (a due one is skipped while two are in flight)
    for round_ in range(rounds):
        for replicas in (0, 1):
            job = f"train-r{replicas}-{round_}"
            agents, ranks = training_job(bench, job, replicas, model, optimizer, interval)
            procs = [psutil.Process(a.pid) for a in agents]
            memd = psutil.Process(bench.memd.pid)
            started_cpu = sum(p.cpu_times().user + p.cpu_times().system for p in procs)  # after the agents started
            memd_started = memd.cpu_times().user + memd.cpu_times().system
            for label, saving in (("no checkpoints", False), (f"--replicas {replicas}", True)):
                if label == "no checkpoints" and replicas:
                    continue
                started, cpu_started = time.perf_counter(), time.process_time()
                for step in range(steps):
                    trainer.step()
                    if saving:
                        for ckpt in ranks:
                            ckpt.save(step)
                times[label].append(time.perf_counter() - started)
                cpu[label].append(time.process_time() - cpu_started)  # the training process's, every thread
                if saving:
                    taken.setdefault(label, []).append(ranks[0].stats.snapshots)
            for ckpt in ranks:
                # Drained, boundedly: these ranks share no process group, so one may skip (two in flight) a
                # step the other saved, which then never commits.
                ckpt.wait(timeout=30)
                ckpt.close()
            label = f"--replicas {replicas}"
            rss[label] = max(p.memory_info().rss for p in procs)
            spent = (sum(p.cpu_times().user + p.cpu_times().system for p in procs) - started_cpu) / len(procs)
            agent_cpu.setdefault(label, []).append(spent / max(1, taken[label][-1]))
            memd_spent = memd.cpu_times().user + memd.cpu_times().system - memd_started
            memd_cpu.setdefault(label, []).append(memd_spent / max(1, taken[label][-1]))
            bench.stop()
    base = statistics.median(times["no checkpoints"])
    return {"steps": steps, "interval": interval, "step_s": step_s,
            "commit_s": {f"--replicas {r}": c for r, c in commit_s.items()}, "times_s": times, "cpu_s": cpu,
            "checkpoints": taken,
            "added_per_checkpoint_s": {label: statistics.median((t - base) / n
                                                                for t, n in zip(times[label], taken[label]))
                                       for label in taken},
            "agent_rss_bytes": rss,
            "agent_cpu_per_checkpoint_s": {label: statistics.median(v) for label, v in agent_cpu.items()},
            "memd_cpu_per_checkpoint_s": {label: statistics.median(v) for label, v in memd_cpu.items()}}


def training_job(bench: Bench, job: str, replicas: int, model, optimizer, interval: int) -> tuple[list, list]:
    """The two training nodes' agents (their replicas placed) and a Checkpointer for each node's rank."""
    agents = [bench.agent(node, f"{job}-n{i}", job, replicas) for i, node in enumerate(bench.holders[:2])]
    if replicas:
        for agent in agents:
            wait_for(lambda: "this node's replicas go to" in agent.log() and "no other" not in
                     agent.log().rsplit("replicas go to", 1)[-1], 60, "replicas placed")
    return agents, bench.checkpointers(agents, job, model, optimizer, interval)


def commit_time(bench: Bench, replicas: int, model, optimizer, warmup: int = 2, samples: int = 3) -> float:
    """The median of ``samples`` checkpoints' save -> committed, both ranks waiting, after ``warmup``."""
    _agents, ranks = training_job(bench, f"commit-r{replicas}", replicas, model, optimizer, 10**9)
    seconds = []
    try:
        for step in range(warmup + samples):
            started = time.perf_counter()
            for ckpt in ranks:
                ckpt.save(step, force=True)
            if not all(ckpt.wait(timeout=120) for ckpt in ranks):
                raise RuntimeError(f"--replicas {replicas}: step {step} was not committed")
            seconds.append(time.perf_counter() - started)
    finally:
        for ckpt in ranks:
            ckpt.close()
        bench.stop()
    return statistics.median(seconds[warmup:])


def run(size: int, rate: str, node_rate: str | None, mtu: int | None, steps: int, interval: int, rounds: int,
        counts: list[int], training: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    with netns.Fleet(1 + HOLDERS + 3, mtu=mtu) as fleet:
        bench = Bench(fleet, workdir, size, rate, node_rate)
        try:
            model, optimizer, batch, described = benchlib.build_model(size)
            benchlib.Trainer(model, optimizer, batch).step()
            nbytes = bench.save("peers", 1, model, optimizer)
            bench.save("memd", 0, model, optimizer)
            restores = {}
            for count in counts:
                restores[count] = {"peers": bench.restore("peers", count, 1),
                                   "memd": bench.restore("memd", count, 0)}
            bare = [fleet.measure(bench.holders[0], bench.newcomers[0], nbytes, cores=(bench.far, bench.near))
                    for _ in range(3)]
            # N nodes restoring at once against N bare pairs at once (holder i to new node i), on the same links
            # and cores: the slowest pair's rate, the best of three
            at_once = {count: max(min(fleet.measure_pairs(list(zip(bench.holders, bench.newcomers[:count])),
                                                          nbytes, cores=(bench.far, bench.near)))
                                  for _ in range(3))
                       for count in counts}
            bench.stop()
            cost = training_cost(bench, steps, interval, rounds) if training else None
        finally:
            bench.stop()
            bench.memd.stop()
    return {"checkpoint_bytes": nbytes, "model": described, "memd_rate": rate, "node_rate": node_rate, "mtu": mtu,
            "memd_rate_bytes_s": fleet_rate(rate), "bare_peer_bytes_s": max(bare), "bare_at_once_bytes_s": at_once,
            "restores": restores,
            "training": cost}


def fleet_rate(rate: str) -> float:
    """tc's ``16mbit`` as bytes a second (tc's mbit are 10^6 bits)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale / 8
    raise ValueError(f"rate {rate!r}: give kbit, mbit or gbit")


def report(r: dict, machine: dict) -> None:
    nbytes, bare = r["checkpoint_bytes"], r["bare_peer_bytes_s"]
    print(f"\nmachine: {benchlib.describe_machine(machine)}")
    nodes = f"each node's {r['node_rate']} each way" if r.get("node_rate") else "the nodes' unshaped"
    print(f"state {nbytes / MiB:.1f} MiB; dash-memd's link {r['memd_rate']} each way "
          f"({nbytes / r['memd_rate_bytes_s']:.2f} s for the state), {nodes}, MTU {r.get('mtu') or 1500}; the peer "
          f"link's limit (bare TCP pair, same veths) {bare / MiB:.0f} MiB/s ({nbytes / bare:.3f} s)")
    print(f"  {'nodes':>5} {'from':6} {'per node, median s':>19} {'agent fetch s':>14} {'wall s':>8} "
          f"{'memd / peers (wall)':>20} {'x peer limit':>13} {'x N pairs at once':>18} {'fetch x limit':>14} "
          f"{'MiB in':>7} {'rank CPU s (kernel)':>20}")
    for count, ways in r["restores"].items():
        at_once = r.get("bare_at_once_bytes_s", {}).get(count)
        for way in ("peers", "memd"):
            w = ways[way]
            ratio = ways["memd"]["wall_s"] / ways["peers"]["wall_s"] if way == "peers" else None
            limit = w["median_s"] / (nbytes / bare) if way == "peers" else None
            together = w["median_s"] / (nbytes / at_once) if way == "peers" and at_once else None
            fetch = w.get("agent_fetch_s")
            fetch_limit = fetch / (nbytes / bare) if way == "peers" and fetch else None
            print(f"  {count:>5} {way:6} {w['median_s']:19.3f} {'-' if fetch is None else f'{fetch:.3f}':>14} "
                  f"{w['wall_s']:8.3f} {'' if ratio is None else f'{ratio:.1f}x':>20} "
                  f"{'' if limit is None else f'{limit:.2f}':>13} {'' if together is None else f'{together:.2f}':>18} "
                  f"{'' if fetch_limit is None else f'{fetch_limit:.2f}':>14} "
                  f"{statistics.median(w.get('received_bytes') or [0]) / MiB:7.1f} "
                  f"{statistics.median(w.get('rank_cpu_s') or [0]):12.3f} "
                  f"({statistics.median(w.get('rank_system_cpu_s') or [0]):.3f})")
    t = r["training"]
    if t is None:
        return
    commits = ", ".join(f"{label} {c:.3f} s" for label, c in t.get("commit_s", {}).items())
    print(f"training, two nodes, a checkpoint every {t['interval']} of {t['steps']} steps (a step "
          f"{t.get('step_s', 0) * 1e3:.1f} ms; commit {commits}), links unshaped:")
    base = statistics.median(t["times_s"]["no checkpoints"])
    cpu_base = statistics.median(t["cpu_s"]["no checkpoints"]) if "cpu_s" in t else None
    print(f"  no checkpoints: {base:.3f} s")
    for label, added in t["added_per_checkpoint_s"].items():
        own = ""
        if cpu_base is not None:
            spent = statistics.median((c - cpu_base) / n for c, n in zip(t["cpu_s"][label], t["checkpoints"][label]))
            own = f" (the training process's CPU {spent * 1e3:.1f} ms of it)"
        print(f"  {label}: {statistics.median(t['times_s'][label]):.3f} s, {t['checkpoints'][label]} checkpoints "
              f"taken, {added * 1e3:.1f} ms added per checkpoint{own}; a dash-agent's CPU per checkpoint "
              f"{t['agent_cpu_per_checkpoint_s'][label] * 1e3:.0f} ms, dash-memd's "
              f"{t['memd_cpu_per_checkpoint_s'][label] * 1e3:.0f} ms; a dash-agent's RSS "
              f"{t['agent_rss_bytes'][label] / MiB:.0f} MiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench_restore.py --peers", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", action="store_true", help="this mode (as bench_restore.py's option)")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--memd-rate", default="200mbit", help="dash-memd's link, each way (tc's units)")
    parser.add_argument("--node-rate", default="1gbit",
                        help="every node's link, each way (tc's units; 'none': unshaped, the CPUs' limit)")
    parser.add_argument("--mtu", type=int, default=9001, help="every link's MTU (0: the kernel's 1500)")
    parser.add_argument("--steps", type=int, default=0, help="training steps per way (0: twelve intervals)")
    parser.add_argument("--interval", type=int, default=0,
                        help="steps between checkpoints (0: twice the slower way's commit time, in steps)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nodes", default="1,2,3", help="how many new nodes restore at once, one run each")
    parser.add_argument("--no-training", action="store_true", help="the restores alone, not what replicas cost")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"bench_restore.py --peers: {reason}")
    machine = benchlib.machine()
    counts = [int(n) for n in args.nodes.split(",")]
    if not counts or not all(1 <= n <= 3 for n in counts):
        raise SystemExit("bench_restore.py --peers: --nodes lists counts of 1 to 3 new nodes, as 1,2,3")
    node_rate = None if args.node_rate == "none" else args.node_rate
    for rate in (args.memd_rate, node_rate):
        if rate is not None:
            fleet_rate(rate)  # a usage error before the fleet is built
    result = run(args.size_mib * MiB, args.memd_rate, node_rate, args.mtu or None, args.steps, args.interval,
                 args.rounds, counts, not args.no_training)
    report(result, machine)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "result": result}, indent=1))
