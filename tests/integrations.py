"""Helpers for the framework integrations' tests: the rank logs of tests/bin/lightning_train.py and hf_train.py.

Each rank's log has ``start <step>`` at each run's start, ``<step> <loss>`` after each optimizer step, and
``preempted <step>`` when a notice stopped the run.
"""

from __future__ import annotations

import re
from pathlib import Path


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


def starts(out: Path, rank: int = 0) -> list[int]:
    return [int(m) for m in re.findall(r"^start (\d+)$", (out / f"rank{rank}.log").read_text(), re.M)]


def preempted_at(out: Path, rank: int = 0) -> list[int]:
    return [int(m) for m in re.findall(r"^preempted (\d+)$", (out / f"rank{rank}.log").read_text(), re.M)]


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
