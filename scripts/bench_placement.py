#!/usr/bin/env python3
"""Added training time as a new user sees it, with dash-agent placed off the rank's core (auto) or not (none).

The trial: one rank with ``--size-mib`` of state (an MLP + AdamW, the model of
``scripts/bench_checkpoint.py``), launched with the real ``dashrun`` command
(TLS, as by default) into a dash-memd that this script starts pinned to the
last allowed core, as a user with a two-core machine would pin it; torch's
thread count left to torch. The launch is repeated ``--runs`` times for each
``--agent-cpus`` value (``auto``: the launcher keeps a core for dash-agent and
starts the rank on the others; ``none``: nothing placed, as before),
interleaved (auto, none, none, auto, ...) so that the machine's drift hits
both alike.

Inside each launch, the rank measures in blocks of ``--interval`` steps, as
``bench_checkpoint.py`` does (the run of ``variants.py``): blocks without
checkpoints (the baseline), blocks that end in a ``torch.save`` + fsync of the
same state, and blocks that end in a ``dashrun`` checkpoint, every
checkpointing block between two baseline blocks, in rotating order; the
background work of a block (dash-memd's disk write) is awaited untimed. Added
training time per checkpoint = time of the block − mean of the baseline blocks
around it. So torch.save runs in the same process, at the same placement, as
the dashrun checkpoint it is compared with.

Reported per placement, over the runs: dashrun's added time as a percentage of
torch.save's (median and min..max), both added times, and the baseline step
time (pinning the rank changes it: with ``auto`` torch sizes its thread pool to
the cores the rank is left).

With ``--back-to-back``, it measures instead as a user who saves often sees it: checkpoints every K steps with
nothing awaited between them, at intervals of 1x, 2x and 5x the commit time, against torch.save at the same K
(``scripts/bench_backtoback.py``, whose options it then takes; its docstring says what is measured).

Usage::

    python3 scripts/bench_placement.py [--runs 5] [--size-mib 384] [--interval 10] [--rounds 8] [--json OUT]
    python3 scripts/bench_placement.py --back-to-back [--runs 3] [--size-mib 384] [--multiples 1,2,5] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchlib  # noqa: E402  (scripts/ is sys.path[0] when this runs as a script)
from variants import NoCheckpoint, TorchSave, Variant, interleave, summarise  # noqa: E402

from dashrun.testing.memd import Memd  # noqa: E402
from dashrun.util.cpus import format_cpus  # noqa: E402

PLACEMENTS = ("auto", "none")
TARGET_PCT = 10.0
MiB = float(1 << 20)


# --- the rank, under dashrun ---------------------------------------------------------------------


class LaunchedDashrun(Variant):
    """``dashrun.Checkpointer`` of a rank started by ``dashrun``: its agent and dash-memd are the launch's."""

    key = "dashrun"

    def __init__(self, model, optimizer, interval: int, memd: str, token_file: str):
        super().__init__()
        self.model, self.optimizer, self.interval = model, optimizer, interval
        self.memd, self.token_file = memd, token_file
        self.ckpt = self.client = None
        self._saved: list[int] = []

    def setup(self) -> None:
        import dashrun
        from dashrun.util.tokens import read_token
        from dashrun.util.units import parse_address
        from dashrun.wire.memd_client import MemdClient

        self.job = os.environ["DASH_JOB_ID"]
        self.client = MemdClient(*parse_address(self.memd, what="--memd"), read_token(Path(self.token_file)),
                                 timeout=120)
        self.ckpt = dashrun.Checkpointer(model=self.model, optimizer=self.optimizer, interval=self.interval)

    def after_step(self, step: int) -> None:
        if self.ckpt.save(step):
            self._saved.append(step)
            if self.measuring:
                self.saves.append({"step": step})

    def quiesce(self) -> None:
        # Untimed: the checkpoint's stream and dash-memd's disk write finish before the next block.
        for step in self._saved:
            if not self.client.wait(self.job, step, 300, on_disk=True):
                raise RuntimeError(f"checkpoint of step {step} not on disk after 300 s")
        self._saved.clear()

    def close(self) -> None:
        for thing in (self.ckpt, self.client):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()

    def result(self) -> dict:
        stats = self.ckpt.stats if self.ckpt is not None else None
        return {"saves": self.saves, "snapshots": getattr(stats, "snapshots", None),
                "skipped": getattr(stats, "skipped", None)}


def agent_of_launcher() -> int | None:
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(os.getppid()).children():
            with contextlib.suppress(psutil.Error):
                if "dashrun.agent" in child.cmdline():
                    return child.pid
    return None


def rank_main(args) -> int:
    import torch

    scratch = Path(args.out).parent / f"torchsave-{os.getpid()}"
    model, optimizer, batch, mdesc = benchlib.build_model(int(args.size_mib * MiB), batch=args.batch)
    trainer = benchlib.Trainer(model, optimizer, batch)
    trainer.step()  # creates the AdamW state
    variants = [NoCheckpoint(), TorchSave(model, optimizer, args.interval, scratch),
                LaunchedDashrun(model, optimizer, args.interval, args.memd, args.token_file)]
    agent = agent_of_launcher()
    named = {"dash-agent": agent} if agent else {}
    mine = sorted(os.sched_getaffinity(0))
    try:
        for v in variants:
            v.setup()
        run = interleave(trainer, variants, interval=args.interval, warmup_rounds=args.warmup,
                         rounds=args.rounds, monitor=benchlib.CpuMonitor(named), train_core=mine[0],
                         log=lambda msg: print(f"[rank] {msg}", flush=True))
        summary = {v.key: summarise(v.key, v, run) for v in variants}
        results = {v.key: v.result() for v in variants}
    finally:
        for v in reversed(variants):
            with contextlib.suppress(Exception):
                v.close()
    report = {"rank_cpus": mine, "agent_cpus": sorted(os.sched_getaffinity(agent)) if agent else None,
              "torch_threads": torch.get_num_threads(), "model": mdesc, "summary": summary, "results": results,
              "cpu": run["cpu"]}
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, args.out)
    return 0


# --- the trial, launched --------------------------------------------------------------------------


def start_memd(procs: benchlib.Processes, scratch: Path, core: int, memory_limit: str) -> tuple[str, Path]:
    """dash-memd pinned to ``core``, TLS; its address and token file."""
    from dashrun.util.tokens import write_token

    token_file = scratch / "token"
    write_token(token_file)
    memd = Memd(scratch / "memd-data", token_file, "--memory-limit", memory_limit, log_path=scratch / "memd.log",
                core=core, timeout=60, cwd=benchlib.REPO, env=benchlib.child_env())
    procs.add("dash-memd", memd.start(port=0).proc)
    return memd.address, token_file


def launch(args, placement: str, run: int, memd: str, token_file: Path, scratch: Path, procs) -> dict:
    """One ``dashrun`` launch of this script's rank part; its report."""
    return launch_rank(Path(__file__), placement, f"bench-placement-{placement}-{run}",
                       scratch / f"{placement}-{run}", memd, token_file, procs, args.timeout,
                       ["--size-mib", str(args.size_mib), "--interval", str(args.interval), "--rounds",
                        str(args.rounds), "--warmup", str(args.warmup), "--batch", str(args.batch)])


def launch_rank(script: Path, agent_cpus: str, job: str, base: Path, memd: str, token_file: Path, procs,
                timeout: float, rank_args: list[str]) -> dict:
    """``dashrun --agent-cpus AGENT_CPUS`` of one rank running ``script --rank`` with ``rank_args``; the report
    it wrote to ``base``.json (its output in ``base``.log). The job's checkpoints are dropped after it."""
    out, log = base.with_suffix(".json"), base.with_suffix(".log")
    cmd = [sys.executable, "-m", "dashrun", "--memd", memd, "--token-file", str(token_file), "--job-id", job,
           "--fresh", "--cloud", "none", "--agent-cpus", agent_cpus, "--nproc-per-node", "1",
           str(script.resolve()), "--rank", "--out", str(out), "--memd", memd, "--token-file", str(token_file),
           *rank_args]
    proc = procs.start(f"dashrun {job}", cmd, log=log, cwd=benchlib.REPO, env=benchlib.child_env())
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        procs.stop(proc, timeout=30)
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"dashrun --agent-cpus {agent_cpus} ({job}) exited with {code}:\n{tail}")
    forget(memd, token_file, job)
    return json.loads(out.read_text())


def forget(memd: str, token_file: Path, job: str) -> None:
    """Drop a finished launch's checkpoints, so dash-memd's RAM and disk hold one trial at a time."""
    from dashrun.util.tokens import read_token
    from dashrun.util.units import parse_address
    from dashrun.wire.memd_client import MemdClient

    with MemdClient(*parse_address(memd, what="--memd"), read_token(token_file), timeout=120) as client:
        client.delete(job)


def figures(report: dict) -> dict:
    s = report["summary"]
    dash, ts = s["dashrun"]["added_per_checkpoint_s"], s["torch.save"]["added_per_checkpoint_s"]
    # A percentage of nothing says nothing: torch.save's added time must be there to compare with.
    return {"pct": 100.0 * dash / ts if dash is not None and ts and ts > 0 else None, "dashrun_added_s": dash,
            "torch_save_added_s": ts, "dashrun_stderr_s": s["dashrun"]["added_stderr_s"],
            "torch_save_stderr_s": s["torch.save"]["added_stderr_s"], "step_s": s["none"]["step_median_s"],
            "rank_cpus": report["rank_cpus"], "agent_cpus": report["agent_cpus"],
            "torch_threads": report["torch_threads"]}


def spread(values: list[float], fmt) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}..{fmt(max(values))})"


def main_trial(args) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        print("bench_placement: needs at least two CPUs (there is nothing to place on one)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    memd_core = allowed[-1]
    procs = benchlib.Processes()
    scratch = Path(tempfile.mkdtemp(prefix="dashplace-", dir="/tmp"))
    began = time.perf_counter()
    try:
        memd, token_file = start_memd(procs, scratch, memd_core, args.memory_limit)
        print(f"machine: {benchlib.describe_machine(benchlib.machine())}; CPUs allowed {format_cpus(allowed)}")
        print(f"dash-memd (TLS) pinned to CPU {memd_core}; one rank of {args.size_mib:g} MiB of state (MLP + AdamW), "
              f"launched with dashrun; a checkpoint every {args.interval} steps, {args.warmup} warm-up and "
              f"{args.rounds} measured per variant and run; {args.runs} runs per placement, interleaved", flush=True)
        runs: dict[str, list[dict]] = {p: [] for p in PLACEMENTS}
        for r in range(args.runs):
            order = PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]
            for placement in order:
                f = figures(launch(args, placement, r, memd, token_file, scratch, procs))
                runs[placement].append(f)
                pct = f"{f['pct']:.1f} %" if f["pct"] is not None else "?"
                print(f"  run {r + 1}/{args.runs} {placement:>4}: rank on CPU {format_cpus(f['rank_cpus'])} "
                      f"({f['torch_threads']} torch threads), dash-agent on CPU "
                      f"{format_cpus(f['agent_cpus']) if f['agent_cpus'] else '?'}; step "
                      f"{benchlib.fmt_ms(f['step_s'])}; added per checkpoint: dashrun "
                      f"{benchlib.fmt_ms(f['dashrun_added_s'])} ± {benchlib.fmt_ms(f['dashrun_stderr_s'])}, torch.save "
                      f"{benchlib.fmt_ms(f['torch_save_added_s'])} ± {benchlib.fmt_ms(f['torch_save_stderr_s'])} -> {pct}",
                      flush=True)
        report(args, runs, time.perf_counter() - began)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    finally:
        procs.stop_all()
        if args.keep_tmp:
            print(f"scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


def report(args, runs: dict[str, list[dict]], took: float) -> None:
    def pct(v):
        return f"{v:.1f} %"

    print(f"\nadded training time per checkpoint, over {args.runs} runs per placement ({took / 60:.1f} min):")
    print("| --agent-cpus | dashrun, % of torch.save: median (min..max) | dashrun added | torch.save added "
          "| baseline step |")
    print("|---|---:|---:|---:|---:|")
    for placement, rows in runs.items():
        print(f"| {placement} | {spread([r['pct'] for r in rows], pct)} "
              f"| {spread([r['dashrun_added_s'] for r in rows], benchlib.fmt_ms)} "
              f"| {spread([r['torch_save_added_s'] for r in rows], benchlib.fmt_ms)} "
              f"| {spread([r['step_s'] for r in rows], benchlib.fmt_ms)} |")
    auto = [r["pct"] for r in runs["auto"] if r["pct"] is not None]
    if auto:
        met = statistics.median(auto) <= TARGET_PCT
        print(f"target: median added time <= {TARGET_PCT:g} % of torch.save's with auto placement: "
              f"{'met' if met else 'NOT met'} ({statistics.median(auto):.1f} %)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--back-to-back" in argv:
        import bench_backtoback  # here: it imports this module's helpers

        return bench_backtoback.main([a for a in argv if a != "--back-to-back"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="launches per placement (default 5)")
    parser.add_argument("--size-mib", type=float, default=384, help="model + AdamW state size (default 384)")
    parser.add_argument("--interval", type=int, default=10, help="steps between checkpoints (default 10)")
    parser.add_argument("--rounds", type=int, default=8,
                        help="measured checkpoints per variant and launch (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up checkpoints per variant (default 3)")
    parser.add_argument("--batch", type=int, default=32, help="batch size of the MLP (default 32)")
    parser.add_argument("--memory-limit", default="4GiB", help="dash-memd's --memory-limit (default 4GiB)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take (default 1800)")
    parser.add_argument("--json", metavar="OUT", help="write every run's figures here")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the scratch directory (logs)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="checkpoints back to back, nothing awaited between them (bench_backtoback.py's options)")
    # The rank's side: this script, started by dashrun.
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--memd", help=argparse.SUPPRESS)
    parser.add_argument("--token-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args)
    if args.runs < 1 or args.rounds < 1:
        parser.error("--runs and --rounds must be at least 1")
    if args.runs < 5:
        print(f"note: {args.runs} runs per placement is a short form; the spread wants at least 5", flush=True)
    args.warmup = max(2, args.warmup)
    return main_trial(args)


if __name__ == "__main__":
    sys.exit(main())
