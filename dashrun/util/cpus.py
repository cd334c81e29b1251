"""CPU sets: the ``0-3,7`` list syntax, the CPUs this process may use, physical cores, and thread affinity.

Linux only: where the OS has no ``sched_setaffinity`` (macOS, Windows),
:func:`allowed_cpus` returns None and :func:`thread_affinity` does nothing.
A process started (fork + exec) by a thread inherits that thread's CPU
affinity, and every thread it creates inherits it in turn: pinning the
starting thread for the length of the start is how a child, with all its
threads to come, is placed (``taskset`` without the extra process).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["MAX_CPU", "allowed_cpus", "format_cpus", "parse_cpus", "physical_cores", "thread_affinity"]

#: The highest CPU number a list may name (Linux's own limit, CONFIG_NR_CPUS, is 8192).
MAX_CPU = 8191
#: Longest CPU list accepted, in characters.
MAX_LIST_CHARS = 4096

SYSFS_CPU = Path("/sys/devices/system/cpu")


def parse_cpus(text: str) -> frozenset[int]:
    """``"0-3,7"`` as {0, 1, 2, 3, 7}; ValueError, naming the part, for anything else or an empty set."""
    text = text.strip()
    if len(text) > MAX_LIST_CHARS:
        raise ValueError(f"a CPU list of more than {MAX_LIST_CHARS} characters")
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range (like 3 or 0-3)")
        first, last = int(low), int(high) if dash else int(low)
        if first > last or last > MAX_CPU:
            raise ValueError(f"{part!r} is not a range of CPUs 0-{MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 7} as ``"0-3,7"`` (what :func:`parse_cpus` reads, ``taskset -c`` and ``numactl`` too)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs the calling thread may run on (narrowed by taskset, numactl or a cpuset); None off Linux."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def physical_cores(cpus: Iterable[int]) -> list[frozenset[int]]:
    """``cpus`` grouped by physical core (SMT siblings together), each group within ``cpus``, by lowest CPU.

    A CPU whose topology the kernel does not show is a core of its own.
    """
    wanted = frozenset(cpus)
    cores: set[frozenset[int]] = set()
    for cpu in wanted:
        try:
            siblings = parse_cpus((SYSFS_CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = frozenset({cpu})
        cores.add((siblings & wanted) | {cpu})
    return sorted(cores, key=min)


@contextlib.contextmanager
def thread_affinity(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block with the calling thread on ``cpus``; the processes it starts keep them. None: as it is."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # pid 0: this thread only, not the process's other threads
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
