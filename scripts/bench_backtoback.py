#!/usr/bin/env python3
"""Added training time of checkpoints taken back to back, as a user who saves often sees it.

``bench_placement.py`` waits, untimed, for each checkpoint's stream and disk write between its blocks, so the
work that overlaps the next steps is not counted. Here nothing is awaited between checkpoints. The trial: one
rank with ``--size-mib`` of state (an MLP + AdamW, the model of ``bench_placement.py``), launched with the real
``dashrun`` command (TLS, ``--agent-cpus auto``) into a dash-memd that this script starts pinned to the last
allowed core; torch's thread count left to torch. Inside each launch, the rank measures, in this order:

1. C, the commit time of one checkpoint: ``save(force=True)`` -> ``wait()`` says dash-memd committed it in its
   RAM, the rank idle meanwhile; ``--warmup`` checkpoints first (fresh memory is slow to touch), then the median
   of ``--commit-samples``. torch.save + fsync of the same state is timed alike (S).
2. T, the step time without checkpoints (a probe of at least a second of steps).
3. For each multiple m of ``--multiples``: K = max(1, round(m * C / T)) steps, and a sandwich of five
   segments of N * K steps each (N = ``--checkpoints``): baseline, dashrun, baseline, torch.save, baseline
   (dashrun and torch.save swap places from one multiple, and run, to the next). In the dashrun segment the
   rank calls ``save(step)`` after every step with the Checkpointer's interval at K: a snapshot every K steps,
   the first at the segment's first step, nothing awaited; snapshots the Checkpointer's back-pressure skipped
   (both staging buffers still on their way) are counted. In the torch.save segment, torch.save + fsync every
   K steps. Added time per checkpoint = (segment time - mean of the two baseline segments beside it) / N, so
   the machine's drift hits both. Between segments (not between checkpoints), untimed, the last snapshot's
   commit and disk write are awaited — their times are reported ("drain"): at most one of the N checkpoints'
   overlap falls outside its segment — and torch.save's files are removed.
4. After the last segment: one more checkpoint of the final state, awaited until committed, read back from
   dash-memd and compared with the live model and optimizer bit for bit; every snapshot started must have
   been stored (the Checkpointer's counts), so nothing was lost.

The figure is, per multiple, dashrun's added time / torch.save's; the target is <= 0.10 at multiples >= 2.
Reported over ``--runs`` launches: its median (min..max), K, C, T, S, skipped snapshots, and the smallest
multiple that meets the target (the interval a user should set).

Usage::

    python3 scripts/bench_backtoback.py [--runs 3] [--size-mib 384] [--multiples 1,2,5] [--checkpoints 6]
        [--warmup 3] [--commit-samples 3] [--json OUT]
    python3 scripts/bench_placement.py --back-to-back [the same options]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchlib  # noqa: E402  (scripts/ is sys.path[0] when this runs as a script)
from bench_placement import agent_of_launcher, launch_rank, spread, start_memd  # noqa: E402
from variants import TorchSave  # noqa: E402

from dashrun.util.cpus import format_cpus  # noqa: E402

TARGET_RATIO = 0.10
#: Multiples at and above which the target holds (shorter intervals are reported, not judged).
TARGET_FROM = 2.0
MiB = float(1 << 20)
NEVER = 1 << 40  # the Checkpointer's interval outside dashrun segments: save() is not called there anyway


# --- the rank, under dashrun ---------------------------------------------------------------------


def aligned(step: int, k: int, after: int) -> int:
    """The first step label >= ``step``, at least ``k`` after ``after``, with (label + 1) % k == 0: a save of
    the Checkpointer (due ``k`` after its last) and of TorchSave ((step + 1) % k == 0) both fall on it."""
    s = max(step, after + k)
    return s + (-(s + 1)) % k


def segment(trainer, steps: int, first: int, after_step=None) -> float:
    """``steps`` training steps labelled from ``first``, ``after_step(step)`` after each; their wall time."""
    started = time.perf_counter()
    for step in range(first, first + steps):
        trainer.step()
        if after_step is not None:
            after_step(step)
    return time.perf_counter() - started


def same_state(state: dict, model, optimizer) -> str | None:
    """None if the checkpoint's model and optimizer state equal the live ones bit for bit, else what differs."""
    import torch

    def compare(saved, live, where: str) -> str | None:
        if isinstance(live, torch.Tensor):
            ok = isinstance(saved, torch.Tensor) and saved.dtype == live.dtype and torch.equal(saved.cpu(), live)
            return None if ok else f"{where} differs"
        if isinstance(live, dict):
            if not isinstance(saved, dict):
                return f"{where} is not a dict"
            by_str = {str(k): v for k, v in saved.items()}
            for k, v in live.items():
                if str(k) not in by_str:
                    return f"{where}.{k} is missing"
                problem = compare(by_str[str(k)], v, f"{where}.{k}")
                if problem:
                    return problem
            return None
        if isinstance(live, (list, tuple)):
            if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
                return f"{where} has another length"
            return next((p for i, (s, v) in enumerate(zip(saved, live)) if (p := compare(s, v, f"{where}[{i}]"))),
                        None)
        return None if saved == live else f"{where}: {saved!r} != {live!r}"

    return compare(state.get("model"), model.state_dict(), "model") or compare(
        state.get("optimizer"), optimizer.state_dict(), "optimizer")


class Rank:
    """The rank's measurement: one Checkpointer and one TorchSave over the same model, one step counter."""

    def __init__(self, args):
        import dashrun
        from dashrun.util.tokens import read_token
        from dashrun.util.units import parse_address
        from dashrun.wire.memd_client import MemdClient

        self.args = args
        self.model, self.optimizer, batch, self.mdesc = benchlib.build_model(int(args.size_mib * MiB),
                                                                             batch=args.batch)
        self.trainer = benchlib.Trainer(self.model, self.optimizer, batch)
        self.trainer.step()  # creates the AdamW state
        self.job = os.environ["DASH_JOB_ID"]
        self.client = MemdClient(*parse_address(args.memd, what="--memd"), read_token(Path(args.token_file)),
                                 timeout=120)
        self.ckpt = dashrun.Checkpointer(model=self.model, optimizer=self.optimizer, interval=NEVER)
        self.torch_save = TorchSave(self.model, self.optimizer, 1, Path(args.out).parent / f"ts-{os.getpid()}")
        self.torch_save.setup()
        self.step = 1000
        self.last_due = -NEVER  # the Checkpointer's last due step (saved or skipped)

    def log(self, msg: str) -> None:
        print(f"[rank] {msg}", flush=True)

    def drain(self, step: int) -> tuple[bool, float, float]:
        """Untimed: the newest snapshot committed, then the snapshot of ``step`` on disk; the two waits."""
        started = time.perf_counter()
        committed = self.ckpt.wait(timeout=600)
        mid = time.perf_counter()
        on_disk = self.client.wait(self.job, step, 600, on_disk=True)
        if not (committed and on_disk):
            raise RuntimeError(f"checkpoint of step {step} not committed ({committed}) or not on disk ({on_disk})")
        return committed, mid - started, time.perf_counter() - mid

    def commit_time(self) -> list[float]:
        """Each ``save(force=True)`` -> committed, the rank waiting; the first ``--warmup`` of them warm up."""
        times = []
        for _ in range(self.args.warmup + self.args.commit_samples):
            self.trainer.step()
            step, self.step = self.step, self.step + 1
            started = time.perf_counter()
            if not self.ckpt.save(step, force=True) or not self.ckpt.wait(timeout=600):
                raise RuntimeError(f"the timed checkpoint of step {step} was not committed")
            times.append(time.perf_counter() - started)
            self.last_due = step
            self.drain(step)  # the disk write, untimed, before the next one
        return times[self.args.warmup:]

    def torch_save_time(self) -> list[float]:
        self.torch_save.interval = 1
        for _ in range(self.args.warmup + self.args.commit_samples):
            self.trainer.step()
            self.torch_save.measuring = True
            self.torch_save.after_step(self.step)
            self.torch_save.measuring = False
            self.step += 1
        times = [s["stall_s"] for s in self.torch_save.saves[self.args.warmup:]]
        self.torch_save.saves.clear()
        self.clean_torch_save()
        return times

    def clean_torch_save(self) -> None:
        shutil.rmtree(self.torch_save.dir, ignore_errors=True)
        self.torch_save.setup()

    def baseline(self, steps: int) -> float:
        took = segment(self.trainer, steps, self.step)
        self.step += steps
        return took

    def dashrun_segment(self, k: int, n: int) -> dict:
        self.step = first = aligned(self.step, k, self.last_due)
        self.ckpt.interval = k
        stats, started = self.ckpt.stats, []
        before = dataclasses.replace(stats)

        def after_step(step: int) -> None:
            if self.ckpt.save(step):
                started.append(step)

        took = segment(self.trainer, n * k, first, after_step)
        self.ckpt.interval = NEVER
        self.step, self.last_due = first + n * k, first + (n - 1) * k
        out = {"segment_s": took, "first_step": first, "started": len(started), "started_steps": started,
               "skipped": stats.skipped - before.skipped, "stall_s": stats.stall_s - before.stall_s}
        if started:
            _, out["commit_drain_s"], out["disk_drain_s"] = self.drain(started[-1])
        return out

    def torch_save_segment(self, k: int, n: int) -> dict:
        self.step = first = aligned(self.step, k, self.last_due)
        self.torch_save.interval, self.torch_save.measuring = k, True
        try:
            took = segment(self.trainer, n * k, first, self.torch_save.after_step)
        finally:
            self.torch_save.measuring = False
        self.step = first + n * k
        saves, self.torch_save.saves = self.torch_save.saves, []
        self.clean_torch_save()  # untimed
        return {"segment_s": took, "first_step": first, "saves": len(saves),
                "save_median_s": benchlib.med(s["stall_s"] for s in saves)}

    def multiple(self, m: float, c: float, t: float, dashrun_first: bool) -> dict:
        n = self.args.checkpoints
        k = max(1, round(m * c / t))
        order = ("dashrun", "torch.save") if dashrun_first else ("torch.save", "dashrun")
        runs = {"dashrun": self.dashrun_segment, "torch.save": self.torch_save_segment}
        baselines = [self.baseline(n * k)]
        out: dict = {"multiple": m, "interval_steps": k, "checkpoints": n, "segment_steps": n * k,
                     "order": list(order)}
        for key in order:
            out[key] = runs[key](k, n)
            baselines.append(self.baseline(n * k))
            around = statistics.fmean(baselines[-2:])
            out[key]["baseline_s"] = around
            out[key]["added_per_checkpoint_s"] = (out[key]["segment_s"] - around) / n
        out["baselines_s"] = baselines
        out["step_s"] = statistics.fmean(baselines) / (n * k)
        dash, ts = out["dashrun"]["added_per_checkpoint_s"], out["torch.save"]["added_per_checkpoint_s"]
        out["ratio"] = dash / ts if ts > 0 else None  # a ratio to nothing says nothing
        self.log(f"  x{m:g}: K {k} steps; added per checkpoint: dashrun {benchlib.fmt_ms(dash)}, torch.save "
                 f"{benchlib.fmt_ms(ts)}; {out['dashrun']['skipped']} skipped")
        return out

    def final_check(self) -> dict:
        """One last checkpoint of the final state: committed, read back and compared bit for bit."""
        from dashrun.launch.export import fetch_state

        step = self.step = aligned(self.step, 1, self.last_due)
        saved = self.ckpt.save(step, force=True)
        committed = saved and self.ckpt.wait(timeout=600)
        latest = self.client.latest(self.job)
        problem = None if committed else f"the final checkpoint of step {step} was not committed"
        if problem is None and (latest is None or latest.step != step):
            problem = f"dash-memd's newest checkpoint is {latest and latest.step}, not step {step}"
        if problem is None:
            _, state = fetch_state(self.client, self.job, step)
            problem = same_state(state, self.model, self.optimizer)
        stats = self.ckpt.stats
        if problem is None and (stats.failed or stats.stored != stats.snapshots):
            problem = f"{stats.snapshots} snapshots started, {stats.stored} stored, {stats.failed} failed"
        return {"step": step, "committed": bool(committed), "verified": problem is None, "problem": problem,
                "nbytes": latest.nbytes if latest else None}

    def close(self) -> None:
        for thing in (self.ckpt, self.client):
            with contextlib.suppress(Exception):
                thing.close()
        shutil.rmtree(self.torch_save.dir, ignore_errors=True)


def rank_main(args) -> int:
    import torch

    multiples = parse_multiples(args.multiples)
    agent = agent_of_launcher()
    mine = sorted(os.sched_getaffinity(0))
    rank = Rank(args)
    try:
        commit = rank.commit_time()
        c = statistics.median(commit)
        saves = rank.torch_save_time()
        rank.log(f"commit time {benchlib.fmt_ms(c)} (median of {len(commit)}), torch.save + fsync "
                 f"{benchlib.fmt_ms(statistics.median(saves))}")
        rank.baseline(3)  # warms the caches
        n = max(10, math.ceil(1.0 / (rank.baseline(3) / 3)))  # T: a probe of at least a second of steps
        t = rank.baseline(n) / n
        monitor = benchlib.CpuMonitor({"dash-agent": agent} if agent else {})
        monitor.start()
        segments = [rank.multiple(m, c, t, (i + args.run_index) % 2 == 0) for i, m in enumerate(multiples)]
        cpu = monitor.stop()
        final = rank.final_check()
        stats = dataclasses.asdict(rank.ckpt.stats)
    finally:
        rank.close()
    report = {"rank_cpus": mine, "agent_cpus": sorted(os.sched_getaffinity(agent)) if agent else None,
              "torch_threads": torch.get_num_threads(), "model": rank.mdesc, "commit_s": commit,
              "commit_median_s": c, "torch_save_s": saves, "torch_save_median_s": statistics.median(saves),
              "step_probe_s": t, "multiples": segments, "final": final, "stats": stats, "cpu": cpu}
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, args.out)
    return 0


# --- the trial, launched --------------------------------------------------------------------------


def parse_multiples(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--multiples {text!r}: positive numbers, comma-separated")
    return values


def launch(args, run: int, memd: str, token_file: Path, scratch: Path, procs) -> dict:
    """One ``dashrun --agent-cpus auto`` launch of this script's rank part; its report."""
    return launch_rank(Path(__file__), "auto", f"bench-backtoback-{run}", scratch / f"run-{run}", memd, token_file,
                       procs, args.timeout,
                       ["--size-mib", str(args.size_mib), "--multiples", args.multiples, "--checkpoints",
                        str(args.checkpoints), "--warmup", str(args.warmup), "--commit-samples",
                        str(args.commit_samples), "--batch", str(args.batch), "--run-index", str(run)])


def print_run(r: int, runs: int, rep: dict) -> None:
    fin = rep["final"]
    print(f"  run {r + 1}/{runs}: rank on CPU {format_cpus(rep['rank_cpus'])} ({rep['torch_threads']} torch "
          f"threads), dash-agent on CPU {format_cpus(rep['agent_cpus']) if rep['agent_cpus'] else '?'}; commit C "
          f"{benchlib.fmt_ms(rep['commit_median_s'])}, torch.save S {benchlib.fmt_ms(rep['torch_save_median_s'])}, "
          f"step T {benchlib.fmt_ms(rep['step_probe_s'])}; final checkpoint (step {fin['step']}) "
          f"{'committed and verified' if fin['verified'] else 'NOT verified: ' + str(fin['problem'])}", flush=True)
    for s in rep["multiples"]:
        d, t = s["dashrun"], s["torch.save"]
        ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "?"
        print(f"    x{s['multiple']:g}: K {s['interval_steps']} steps (T {benchlib.fmt_ms(s['step_s'])}); added per "
              f"checkpoint: dashrun {benchlib.fmt_ms(d['added_per_checkpoint_s'])} (stalled "
              f"{benchlib.fmt_ms(d['stall_s'] / max(1, d['started']))}), torch.save "
              f"{benchlib.fmt_ms(t['added_per_checkpoint_s'])} -> ratio {ratio}; {d['started']} started, "
              f"{d['skipped']} skipped of {s['checkpoints']}; drain after it: commit "
              f"{benchlib.fmt_ms(d.get('commit_drain_s'))}, disk {benchlib.fmt_ms(d.get('disk_drain_s'))}",
              flush=True)


def report(args, runs: list[dict], took: float) -> dict:
    """The table over the runs; the figures it shows, per multiple."""
    ms = benchlib.fmt_ms
    print(f"\nback-to-back checkpoints, over {len(runs)} runs ({took / 60:.1f} min): C (commit) "
          f"{spread([r['commit_median_s'] for r in runs], ms)}, S (torch.save + fsync) "
          f"{spread([r['torch_save_median_s'] for r in runs], ms)}, T (step) "
          f"{spread([r['step_probe_s'] for r in runs], ms)}")
    print("| multiple of C | K steps | dashrun / torch.save: median (min..max) | dashrun added | torch.save added "
          "| skipped / due | baseline step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for i, m in enumerate(parse_multiples(args.multiples)):
        rows = [r["multiples"][i] for r in runs]
        ratios = [s["ratio"] for s in rows if s["ratio"] is not None]
        skipped = sum(s["dashrun"]["skipped"] for s in rows)
        summary[m] = {"ratio_median": statistics.median(ratios) if ratios else None, "ratios": ratios,
                      "interval_steps": [s["interval_steps"] for s in rows], "skipped": skipped}
        print(f"| {m:g} | {spread([s['interval_steps'] for s in rows], lambda v: f'{v:g}')} "
              f"| {spread(ratios, lambda v: f'{v:.3f}')} "
              f"| {spread([s['dashrun']['added_per_checkpoint_s'] for s in rows], ms)} "
              f"| {spread([s['torch.save']['added_per_checkpoint_s'] for s in rows], ms)} "
              f"| {skipped} / {sum(s['checkpoints'] for s in rows)} | {spread([s['step_s'] for s in rows], ms)} |")
    judged = {m: s["ratio_median"] for m, s in summary.items() if m >= TARGET_FROM}
    if judged:
        met = all(v is not None and v <= TARGET_RATIO for v in judged.values())
        print(f"target: dashrun's added time <= {TARGET_RATIO:g} x torch.save's at multiples >= {TARGET_FROM:g}: "
              f"{'met' if met else 'NOT met'} (" + ", ".join(
                  f"x{m:g} {v:.3f}" if v is not None else f"x{m:g} ?" for m, v in judged.items()) + ")")
    meeting = [m for m, s in summary.items() if s["ratio_median"] is not None and s["ratio_median"] <= TARGET_RATIO]
    if meeting:
        best = min(meeting)
        k = statistics.median(summary[best]["interval_steps"])
        print(f"what to set: the smallest multiple meeting it is x{best:g}: save every >= {k:g} steps here "
              f"(interval >= {best:g} x the commit time, "
              f"{ms(best * statistics.median(r['commit_median_s'] for r in runs))} at this size)")
    else:
        print("what to set: none of the multiples measured meets the target; measure larger ones (--multiples)")
    lost = [r["final"] for r in runs if not r["final"]["verified"]]
    print(f"final checkpoints: {len(runs) - len(lost)} of {len(runs)} committed and verified"
          + "".join(f"; {f['problem']}" for f in lost))
    return summary


def main_trial(args) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        print("bench_backtoback: needs at least two CPUs (dash-memd is pinned to one)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    procs = benchlib.Processes()
    scratch = Path(tempfile.mkdtemp(prefix="dashb2b-", dir="/tmp"))
    began = time.perf_counter()
    try:
        memd, token_file = start_memd(procs, scratch, allowed[-1], args.memory_limit)
        print(f"machine: {benchlib.describe_machine(benchlib.machine())}; CPUs allowed {format_cpus(allowed)}")
        print(f"dash-memd (TLS) pinned to CPU {allowed[-1]}; one rank of {args.size_mib:g} MiB of state (MLP + "
              f"AdamW), launched with dashrun --agent-cpus auto; {args.checkpoints} checkpoints back to back per "
              f"segment at multiples {args.multiples} of the commit time; {args.runs} runs", flush=True)
        runs = []
        for r in range(args.runs):
            runs.append(launch(args, r, memd, token_file, scratch, procs))
            print_run(r, args.runs, runs[-1])
        summary = report(args, runs, time.perf_counter() - began)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))
    finally:
        procs.stop_all()
        if args.keep_tmp:
            print(f"scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r["final"]["verified"] for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="launches (default 3)")
    parser.add_argument("--size-mib", type=float, default=384, help="model + AdamW state size (default 384)")
    parser.add_argument("--multiples", default="1,2,5",
                        help="intervals, as multiples of the commit time (default 1,2,5)")
    parser.add_argument("--checkpoints", type=int, default=6,
                        help="checkpoints back to back per segment (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up checkpoints before C is timed (default 3)")
    parser.add_argument("--commit-samples", type=int, default=3, help="checkpoints C is the median of (default 3)")
    parser.add_argument("--batch", type=int, default=32, help="batch size of the MLP (default 32)")
    parser.add_argument("--memory-limit", default="4GiB", help="dash-memd's --memory-limit (default 4GiB)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take (default 1800)")
    parser.add_argument("--json", metavar="OUT", help="write every run's figures here")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the scratch directory (logs)")
    # The rank's side: this script, started by dashrun.
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--memd", help=argparse.SUPPRESS)
    parser.add_argument("--token-file", help=argparse.SUPPRESS)
    parser.add_argument("--run-index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        parse_multiples(args.multiples)
    except ValueError as e:
        parser.error(str(e))
    if args.rank:
        return rank_main(args)
    if args.runs < 1 or args.checkpoints < 1 or args.commit_samples < 1:
        parser.error("--runs, --checkpoints and --commit-samples must be at least 1")
    args.warmup = max(2, args.warmup)
    return main_trial(args)


if __name__ == "__main__":
    sys.exit(main())
