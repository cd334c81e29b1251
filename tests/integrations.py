"""Helpers for the framework integrations' tests: the rank logs of tests/bin/lightning_train.py and hf_train.py.

Each rank's log has ``start <step>`` at each run's start, ``<step> <loss>`` after each optimizer step, and
``preempted <step>`` when a notice stopped the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from runs import preempted_at, starts

from dashrun.testing.memd import Memd, dashrun_cmd
from dashrun.testing.processes import kill_tree, wait_for

PREEMPTED = 75
# One thread a rank, as torchrun sets for more than one rank: the reference and dashrun's runs compute alike.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def runs(out: Path, rank: int = 0) -> list[dict[int, str]]:
    """Each run of the job in the rank's log: {step: loss, as logged}, in the order the runs started."""
    found: list[dict[int, str]] = []
    for line in (out / f"rank{rank}.log").read_text().splitlines():
        if line.startswith("start "):
            found.append({})
        elif re.match(r"\d+ ", line) and found:
            step, loss = line.split()
            found[-1][int(step)] = loss
    return found


def last_step(out: Path, rank: int = 0) -> int:
    try:
        done = runs(out, rank)
    except FileNotFoundError:
        return -1
    return max((step for run in done for step in run), default=-1)


def assert_resumed_as_uninterrupted(reference: Path, out: Path, ranks=(0, 1)) -> None:
    """Every run of every rank logged the uninterrupted run's loss at each of its steps, each relaunch began at a
    restored step (not afresh), and the last one trained to the uninterrupted run's end."""
    for rank in ranks:
        expected = runs(reference, rank)[0]
        done, begun = runs(out, rank), starts(out, rank)
        assert len(done) >= 2 and all(begun[1:]), f"rank {rank}: runs started at {begun}"
        for start, run in zip(begun, done):
            assert run and min(run) == start, f"rank {rank}: a run started at {start} logged steps {sorted(run)}"
            differ = [step for step in run if run[step] != expected.get(step)]
            assert not differ, f"rank {rank}: the run from step {start}: losses differ at steps {differ}"
        assert max(done[-1]) == max(expected), f"rank {rank}: the last run ended at step {max(done[-1])}"


def reference_run(program: Path, out: Path, *extra: str) -> Path:
    """An uninterrupted run under plain torchrun (the callback is off: no dashrun in the launch), tried once more
    after torch's rare abort in its own teardown (runs.reference_run)."""
    import runs as job_runs

    result = job_runs.reference_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     str(program), "--out", str(out), *extra], env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _launch(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    return proc.returncode, stderr


def notice_kill_and_resume(memd: Memd, program: Path, out: Path, job: str, fake, steps_per_epoch: int,
                           every: int = 5, extra: tuple[str, ...] = ()) -> tuple[int, int]:
    """Three runs of one job, checkpointing every ``every`` steps: a cloud notice mid-epoch stops the first
    (exit 75, the step committed on every rank); the relaunch is SIGKILLed whole (launcher, ranks, dash-agent)
    a few steps after a periodic checkpoint; the next relaunch finishes. Returns (the notice's step, the step the
    third run resumed after). ``extra``: the program's own further arguments."""
    job_args = [str(program), "--out", str(out), "--every", str(every), *extra]
    proc = _launch(dashrun_cmd(memd, "--cloud", "aws", "--metadata-endpoint", fake.url, "--poll-interval", "0.2",
                               *job_args, "--delay", "0.1", job=job))
    wait_for(lambda: last_step(out) >= steps_per_epoch + 1 or proc.poll() is not None, 240,
             "training into the second epoch")
    fake.notice()
    code, stderr = _finish(proc)
    assert code == PREEMPTED, stderr[-3000:]
    noticed = preempted_at(out)[0]
    assert preempted_at(out, 1) == [noticed] and noticed % steps_per_epoch not in (0, steps_per_epoch - 1)
    with memd.client() as client:
        assert client.latest(job).step == noticed

    relaunch = dashrun_cmd(memd, "--cloud", "none", *job_args, "--delay", "0.1", job=job)
    proc = _launch(relaunch)
    try:
        wait_for(lambda: last_step(out) >= noticed + every + 2 or proc.poll() is not None, 240,
                 "the relaunch to pass a periodic checkpoint")
    finally:
        kill_tree(proc)  # SIGKILL: no time to save anything
    with memd.client() as client:
        newest = client.latest(job).step
    assert newest >= noticed + every

    code, stderr = _finish(_launch(dashrun_cmd(memd, "--cloud", "none", *job_args, job=job)))
    assert code == 0, stderr[-3000:]
    assert starts(out) == [0, noticed + 1, newest + 1] == starts(out, 1)  # no step lost to the notice
    return noticed, newest
