"""The run the CPU checkpoint benchmarks share: a variant's hooks (none, torch.save + fsync as the others' yardstick),
blocks of training interleaved with baseline blocks, and each variant's figures from them.

A benchmark brings its own variants (subclasses of :class:`Variant`) and keeps its own measurement; this is what
``bench_checkpoint.py`` and ``bench_placement.py`` both run them with. Imported by the scripts beside it (scripts/
is ``sys.path[0]`` when one runs).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from pathlib import Path

from benchlib import CpuMonitor, Trainer, core_busy, med, runqueue_wait

__all__ = ["PLAIN_KEY", "NoCheckpoint", "TorchSave", "Variant", "first_step", "interleave", "sandwich", "summarise"]

#: The variant of dashrun with --no-tls on both daemons.
PLAIN_KEY = "dashrun-plain"


class Variant:
    key = "?"

    def __init__(self):
        self.measuring = False
        self.saves: list[dict] = []

    def setup(self) -> None: ...

    def begin_block(self) -> None: ...

    def after_step(self, step: int) -> None: ...

    def end_block(self) -> None: ...

    def quiesce(self) -> None: ...

    def close(self) -> None: ...

    def result(self) -> dict:
        return {"saves": self.saves}


class NoCheckpoint(Variant):
    key = "none"


class TorchSave(Variant):
    key = "torch.save"

    def __init__(self, model, optimizer, interval: int, directory: Path):
        super().__init__()
        self.model, self.optimizer, self.interval, self.dir = model, optimizer, interval, directory

    def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def after_step(self, step: int) -> None:
        import torch

        from dashrun.util.files import fsync_dir

        if (step + 1) % self.interval:
            return
        started = time.perf_counter()
        final = self.dir / f"step-{step:08d}.pt"
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.dir)
        stall = time.perf_counter() - started
        if self.measuring:
            self.saves.append({"step": step, "stall_s": stall, "on_disk_s": stall, "bytes": final.stat().st_size})

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def first_step(interval: int) -> int:
    """The first step >= 1000 after which a checkpoint is due ((step + 1) % interval == 0)."""
    return math.ceil(1001 / interval) * interval - 1


def interleave(trainer: Trainer, variants: list[Variant], *, interval: int, warmup_rounds: int, rounds: int,
               monitor: CpuMonitor, train_core: int, log) -> dict:
    step = first_step(interval)
    blocks: dict[str, list[float]] = {v.key: [] for v in variants}
    step_times: dict[str, list[float]] = {v.key: [] for v in variants}
    # Where a block's time went: CPU time of the whole training process (all its threads), CPU time
    # of the training thread, and the training thread's wait for a CPU (kernel schedstat).
    usage: dict[str, dict[str, list[float]]] = {v.key: {"process_cpu_s": [], "train_thread_cpu_s": [],
                                                        "train_thread_runqueue_s": [], "others_on_core_s": []}
                                                for v in variants}
    spans: dict[str, list[tuple[float, float]]] = {v.key: [] for v in variants}  # CLOCK_MONOTONIC, for tracing
    sequence: list[tuple[str, int]] = []  # measured blocks in the order they ran: (variant, index in blocks)

    def block(v: Variant) -> float:
        nonlocal step
        times = []
        v.begin_block()
        cpu0, thread0, wait0, core0 = time.process_time(), time.thread_time(), runqueue_wait(), core_busy(train_core)
        mono0 = time.monotonic()
        started = time.perf_counter()
        for _ in range(interval):
            t = time.perf_counter()
            trainer.step()
            v.after_step(step)
            times.append(time.perf_counter() - t)
            step += 1
        elapsed = time.perf_counter() - started
        cpu1, thread1, wait1, core1 = time.process_time(), time.thread_time(), runqueue_wait(), core_busy(train_core)
        mono1 = time.monotonic()
        v.end_block()
        v.quiesce()  # untimed: background work of this block must not land in the next one
        if v.measuring:
            step_times[v.key].extend(times)
            usage[v.key]["process_cpu_s"].append(cpu1 - cpu0)
            usage[v.key]["train_thread_cpu_s"].append(thread1 - thread0)
            usage[v.key]["train_thread_runqueue_s"].append(wait1 - wait0)
            # This process is pinned to the training core: what else that core ran (10 ms ticks).
            usage[v.key]["others_on_core_s"].append((core1 - core0) - (cpu1 - cpu0))
            spans[v.key].append((mono0, mono1))
        return elapsed

    def measured(v: Variant) -> None:
        v.measuring = True
        try:
            blocks[v.key].append(block(v))
        finally:
            v.measuring = False
        sequence.append((v.key, len(blocks[v.key]) - 1))

    for r in range(warmup_rounds):
        for v in variants:
            block(v)
    log(f"  warm-up: {warmup_rounds} blocks ({warmup_rounds} checkpoints) per variant done")
    baseline, others = variants[0], variants[1:]
    monitor.start()
    measured(baseline)
    for r in range(rounds):
        # Every checkpointing block sits between two baseline blocks; the order rotates per round.
        shift = r % max(1, len(others))
        for v in others[shift:] + others[:shift]:
            measured(v)
            measured(baseline)
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{v.key} {blocks[v.key][-1]:.2f}s" for v in variants))
    cpu = monitor.stop()
    return {"blocks_s": blocks, "step_times_s": step_times, "usage": usage, "spans_monotonic": spans,
            "sequence": sequence, "cpu": cpu, "last_step": step - 1}


def sandwich(run: dict, key: str, series: str | None = None) -> list[float]:
    """Per block of ``key``: its value minus the mean of the baseline blocks just before and after it."""
    def value(k: str, i: int) -> float:
        return run["blocks_s"][k][i] if series is None else run["usage"][k][series][i]

    seq = run["sequence"]
    out = []
    for j, (k, i) in enumerate(seq):
        if k != key:
            continue
        neighbours = [value(*seq[n]) for n in (j - 1, j + 1) if 0 <= n < len(seq) and seq[n][0] == "none"]
        if neighbours:
            out.append(value(k, i) - statistics.fmean(neighbours))
    return out


def summarise(key: str, variant: Variant, run: dict) -> dict:
    base = run["blocks_s"]["none"]
    mine = run["blocks_s"][key]
    saves = variant.saves
    s = {"blocks": len(mine), "total_s": sum(mine), "step_median_s": med(run["step_times_s"][key])}
    if key == "none":
        s["block_mean_s"] = statistics.fmean(base)
        return s
    n = len(saves)
    # (time of the blocks with checkpoints - time of as many baseline steps) / checkpoints, the baseline
    # being the blocks right before and after each one ("sandwich"), so slow drift cancels.
    diffs = sandwich(run, key)
    s.update({
        "checkpoints": n,
        "added_per_checkpoint_s": statistics.fmean(diffs) if diffs and n == len(diffs) else None,
        "added_vs_all_baseline_blocks_s": (sum(mine) - len(mine) * statistics.fmean(base)) / n if n else None,
        "added_paired_median_s": med(diffs),
        "added_stderr_s": (statistics.stdev(diffs) / math.sqrt(len(diffs))) if len(diffs) > 1 else None,
        "stall_median_s": med(r.get("stall_s") for r in saves),
        "stall_mean_s": statistics.fmean(r.get("stall_s") or 0.0 for r in saves) if saves else None,
        "stall_max_s": max((r.get("stall_s") or 0.0 for r in saves), default=None),
        "on_disk_median_s": med(r.get("on_disk_s") for r in saves),
    })
    for name, values in run["usage"][key].items():
        if values and n:
            s[f"added_{name}_per_checkpoint"] = statistics.fmean(sandwich(run, key, name))
    if key == "dcp":
        s["async_save_median_s"] = med(r.get("async_save_s") for r in saves)
        s["waited_previous_max_s"] = max((r.get("waited_previous_s") or 0.0 for r in saves), default=None)
        s["still_writing_at_block_end_median_s"] = med(r.get("still_writing_at_block_end_s") for r in saves)
    if key in ("dashrun", PLAIN_KEY):
        s["save_call_median_s"] = med(r.get("save_call_s") for r in saves)
        s["hook_wait_median_s"] = med((r["stall_s"] - r["save_call_s"]) for r in saves if "stall_s" in r)
        s["copied_median_s"] = med(r.get("copied_s") for r in saves)
        s["ram_median_s"] = med(r.get("ram_s") for r in saves)
        s["agent_ack_median_s"] = med(r.get("agent_ack_s") for r in saves)
    return s
