#!/usr/bin/env python3
"""Elastic benchmark: from a membership change to the first step at the new world size, dashrun against torchrun.

Three nodes on loopback (addresses 127.0.0.1-3, one rank each), the same
job (``scripts/elastic_job.py``: a DDP MLP, AdamW; FSDP2 with ``--fsdp``) and the same rendezvous
settings for both — ``--nnodes 2:3``, ``last_call_timeout``,
``keep_alive_interval``, ``keep_alive_max_attempt``, ``join_timeout``,
``--max-restarts`` — in one run, rounds interleaved:

* **torchrun** — ``torchrun --nnodes 2:3`` with its c10d rendezvous on the
  first node, ``torch.distributed.checkpoint.save`` every ``--interval`` steps
  to local disk and ``load`` of the newest at start;
* **dashrun** — the identical ``dashrun --nnodes 2:3`` on every node, the
  rendezvous and the checkpoints in one dash-memd (TLS);
* with ``--torch-defaults`` also **torchrun, its defaults** — as a user who
  sets no rendezvous options runs it (keep-alive 5 s x 3, last call 30 s).

**kill**: the third node is SIGKILLed with all its processes (for torchrun,
not the first node: that one holds its rendezvous, and losing it ends the
job); the time runs from the kill to the first step the survivors run at
world 2, and the steps lost are those the survivors run again. **notice**
(dashrun only): an AWS interruption notice on the third node, served by
``scripts/fake_metadata.py``; from the notice to the first step at world 2,
and the steps lost (zero, when the emergency checkpoint works).

Usage::

    python3 scripts/bench_elastic.py [--rounds 3] [--interval 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402  (scripts/ is sys.path[0] when this runs as a script)
import fake_metadata  # noqa: E402

from dashrun.testing.memd import Memd  # noqa: E402
from dashrun.testing.processes import WaitTimeout, free_port, kill_tree, wait_for  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402

JOB = HERE / "elastic_job.py"
NODES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=600"
MAX_RESTARTS = "100"
#: Seconds a round may take at most before it is given up (reported as such).
ROUND_TIMEOUT = 300.0


def log_lines(out: Path) -> list[tuple[float, int, int, str]]:
    """(time, step, world, node) of every step any rank ran."""
    lines = []
    for path in out.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] != "phase":
                lines.append((float(parts[0]), int(parts[1]), int(parts[2]), path.stem))
    return lines


def restart_phases(out: Path, since: float) -> dict[str, float]:
    """Seconds from ``since`` to each phase of the earliest rank start after it (started, imported, process
    group, restored): where the survivors' restart went."""
    starts: list[dict[str, float]] = []
    for path in out.glob("*.log"):
        current: dict[str, float] = {}
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "phase":
                if parts[1] == "started":
                    current = {}
                    starts.append(current)
                current[parts[1]] = round(float(parts[2]) - since, 2)
    after = [phases for phases in starts if phases.get("started", -1) >= 0]
    return min(after, key=lambda phases: phases["started"]) if after else {}


def wait_until(predicate, timeout: float, what: str):
    return wait_for(predicate, timeout, what, interval=0.05)


class Round:
    """One round of one system: three nodes started, the third one killed (or noticed), the survivors timed."""

    def __init__(self, system: str, workdir: Path, procs: benchlib.Processes, args: argparse.Namespace,
                 memd: tuple[str, Path] | None = None, fake=None):
        self.system, self.procs, self.args = system, procs, args
        self.out = workdir / "out"
        self.nodes = []
        job_args = ["--out", str(self.out), "--interval", str(args.interval), "--width", str(args.width),
                    *(["--fsdp"] if args.fsdp else [])]
        rdzv_port = free_port()
        for index, address in enumerate(NODES):
            env = {**benchlib.child_env(), "BENCH_NODE": address, "OMP_NUM_THREADS": "1"}
            if system.startswith("torchrun"):
                conf = f"{RDZV_CONF}," if system == "torchrun" else ""  # "torchrun, its defaults": torch's own
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "bench",
                       "--rdzv-conf", f"{conf}is_host={int(index == 0)}", "--local-addr", address,
                       "--max-restarts", MAX_RESTARTS, "--monitor-interval", "0.1",
                       str(JOB), "--mode", "dcp", "--ckpt-dir", str(workdir / "dcp"), *job_args]
            else:
                address_port, token_file = memd
                watch = (["--cloud", "aws", "--metadata-endpoint", fake.url, "--poll-interval", "0.2"]
                         if fake is not None and index == 2 else ["--cloud", "none"])
                cmd = [sys.executable, "-m", "dashrun", "--memd", address_port, "--token-file", str(token_file),
                       "--job-id", workdir.name, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-conf", RDZV_CONF,
                       "--local-addr", address, "--max-restarts", MAX_RESTARTS, "--monitor-interval", "0.1",
                       "--agent-cpus", "none", *watch, str(JOB), "--mode", "dashrun", *job_args]
            self.nodes.append(procs.start(f"{system} {address}", cmd, log=workdir / f"node-{index}.log", env=env,
                                          start_new_session=True))

    def newest(self) -> int:
        return max((step for _, step, _, _ in log_lines(self.out)), default=-1)

    def run(self, how: str, fake=None) -> dict:
        warm = 3 * self.args.interval
        wait_until(lambda: self.newest() >= warm, ROUND_TIMEOUT, f"{self.system} to train {warm} steps at world 3")
        before = self.newest()
        started = time.time()
        if how == "kill":
            kill_tree(self.nodes[2])
        else:
            fake.notice(kind="terminate", lead=120)
        try:
            wait_until(lambda: any(world == 2 for _, _, world, _ in log_lines(self.out)), ROUND_TIMEOUT,
                       f"{self.system} to train at world 2")
        except WaitTimeout:
            return {"system": self.system, "how": how, "seconds": None, "steps_lost": None}
        lines = log_lines(self.out)
        first_at_2 = min((t, step) for t, step, world, _ in lines if world == 2)
        last_at_3 = max(step for t, step, world, _ in lines if world == 3 and t < started + 0.5)
        return {"system": self.system, "how": how, "seconds": round(first_at_2[0] - started, 2),
                "steps_lost": max(0, last_at_3 + 1 - first_at_2[1]), "steps_before": before,
                "restart": restart_phases(self.out, started)}

    def stop(self) -> None:
        for proc in self.nodes:
            kill_tree(proc)


def start_memd(workdir: Path, procs: benchlib.Processes) -> tuple[str, Path]:
    token = workdir / "token"
    write_token(token)
    memd = Memd(workdir / "memd", token, "--memory-limit", "2GiB", log_path=workdir / "memd.log", timeout=60)
    procs.add("dash-memd", memd.start(port=0).proc)
    return memd.address, token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval (steps), both systems")
    parser.add_argument("--width", type=int, default=1024, help="MLP width: 3 layers of width^2 fp32 weights")
    parser.add_argument("--torch-defaults", action="store_true",
                        help="also torchrun with torch's own rendezvous settings (keep-alive 5 s x 3, last call 30 s)")
    parser.add_argument("--fsdp", action="store_true",
                        help="the job's model sharded with FSDP2: a new world size restores resharded (both systems)")
    parser.add_argument("--dashrun-only", action="store_true",
                        help="no torchrun rounds: a look at dashrun's own timeline (with --keep)")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep it: every node's log")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    machine = benchlib.machine()
    results = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=False)
    with (contextlib.nullcontext(str(args.keep)) if args.keep
          else tempfile.TemporaryDirectory(prefix="bench-elastic-", ignore_cleanup_errors=True)) as tmp:
        procs = benchlib.Processes()
        try:
            memd = start_memd(Path(tmp), procs)
            for index in range(args.rounds):
                systems = ("dashrun",) if args.dashrun_only else (
                    ("torchrun", "dashrun") + (("torchrun, its defaults",) if args.torch_defaults else ()))
                for system in systems:
                    workdir = Path(tmp) / f"{system.split(',')[0]}-{'defaults-' if ',' in system else ''}{index}"
                    workdir.mkdir()
                    one = Round(system, workdir, procs, args, memd=memd)
                    try:
                        results.append(one.run("kill"))
                    finally:
                        one.stop()
                    print(json.dumps(results[-1]), flush=True)
                workdir = Path(tmp) / f"notice-{index}"
                workdir.mkdir()
                fake = fake_metadata.FakeMetadata("aws").start()
                one = Round("dashrun", workdir, procs, args, memd=memd, fake=fake)
                try:
                    results.append(one.run("notice", fake))
                finally:
                    one.stop()
                    fake.stop()
                print(json.dumps(results[-1]), flush=True)
        finally:
            procs.stop_all()
    report(results, machine)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=2))


def report(results: list[dict], machine: dict) -> None:
    print(f"\nmachine: {benchlib.describe_machine(machine)}")
    print("| change | system | seconds to the first step at world 2 (median, runs) | steps lost |")
    print("|---|---|---|---|")
    medians = {}
    for how, system in (("kill", "torchrun"), ("kill", "dashrun"), ("kill", "torchrun, its defaults"),
                        ("notice", "dashrun")):
        rows = [r for r in results if r["system"] == system and r["how"] == how]
        if not rows:
            continue
        times = [r["seconds"] for r in rows if r["seconds"] is not None]
        failed = len(rows) - len(times)
        median = statistics.median(times) if times else None
        medians[(how, system)] = median
        runs = ", ".join(f"{t:.1f}" for t in times) + (f", {failed} not resumed" if failed else "")
        lost = ", ".join(str(r["steps_lost"]) for r in rows if r["steps_lost"] is not None)
        print(f"| {how} | {system} | {median:.1f} s ({runs}) | {lost} |" if median is not None
              else f"| {how} | {system} | not resumed ({runs}) | |")
    if medians.get(("kill", "torchrun")) and medians.get(("kill", "dashrun")):
        print(f"\ndashrun / torchrun after a kill: {medians[('kill', 'dashrun')] / medians[('kill', 'torchrun')]:.2f}x")


if __name__ == "__main__":
    main()
