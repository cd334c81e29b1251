"""Helpers for tests that run real training jobs: progress in the rank logs, bit-for-bit comparison."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch


class Cursor:
    """A data position: any object with state_dict/load_state_dict is checkpointed."""


    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


COMPARED = ("model", "optimizer", "scheduler", "cursor", "rng", "py_rng")


def assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def final_states(out: Path, ranks=(0, 1)) -> dict[int, dict]:
    return {rank: torch.load(out / f"final-rank{rank}.pt", weights_only=False) for rank in ranks}


def assert_identical(reference: dict[int, dict], out: Path) -> None:
    """Every rank's final state equals the uninterrupted run's, bit for bit."""
    for rank, final in final_states(out, tuple(reference)).items():
        for key in COMPARED:
            assert_same(reference[rank][key], final[key], f"rank {rank} {key}")


def starts(out: Path, rank: int = 0) -> list[int]:
    """The step each run of the job started at, from the rank's log."""
    return [int(m) for m in re.findall(r"^start (\d+)$", (out / f"rank{rank}.log").read_text(), re.M)]


def preempted_at(out: Path, rank: int = 0) -> list[int]:
    return [int(m) for m in re.findall(r"^preempted (\d+)$", (out / f"rank{rank}.log").read_text(), re.M)]


def last_step(out: Path, rank: int = 0) -> int:
    try:
        lines = (out / f"rank{rank}.log").read_text().split("\n")
    except FileNotFoundError:
        return -1
    return max((int(line.split()[0]) for line in lines if line and line[0].isdigit()), default=-1)


def reference_run(cmd: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """A reference run under plain torchrun (checkpointing off: none of dashrun's code runs), tried once more if a
    rank aborted in torch's own teardown ("terminate called without an active exception", SIGABRT at exit: seen
    once in the suite's many such runs, never reproduced in a loop)."""
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0 and "terminate called without an active exception" in result.stderr:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return result
