"""Where a benchmark's processes run: pin this process, pick the cores, run a command pinned to one core.

A command from :func:`pinned` is also terminated if the process that started it dies (PR_SET_PDEATHSIG), so a
benchmark killed outright leaves no daemon behind.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap

__all__ = ["pin_pid", "pin_process", "pinned", "placement"]


def pin_process(cores: set[int]) -> None:
    """Pin every thread of this process (those to come inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)
    os.sched_setaffinity(0, cores)


def pin_pid(pid: int, cores: set[int]) -> None:
    """Pin every thread of process ``pid`` now (the threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)


def placement() -> tuple[int, int, bool]:
    """(core of the training process, core of dash-memd/dash-agent/receivers, separate?)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        return cores[0], cores[1], True
    return cores[0], cores[0], False


_PINNED_EXEC = textwrap.dedent("""
    import ctypes, os, signal, sys
    try:  # stopped with this benchmark even if it is killed outright (PR_SET_PDEATHSIG survives exec)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(sys.argv[1]):
        sys.exit(1)  # the benchmark is already gone
    os.sched_setaffinity(0, {int(sys.argv[2])})
    os.execvp(sys.argv[3], sys.argv[3:])
""")


def pinned(cmd: list[str], core: int) -> list[str]:
    """``cmd`` pinned to ``core`` (like ``taskset -c``), and terminated if this benchmark dies."""
    return [sys.executable, "-c", _PINNED_EXEC, str(os.getpid()), str(core), *cmd]
