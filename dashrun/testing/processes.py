"""Processes a test or a script starts: poll with a deadline, free ports, kill a tree, stop everything started.

:func:`wait_for` raises :class:`WaitTimeout`, an AssertionError, so that a
test shows a deadline passed as its failure, with what it waited for.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import psutil

from dashrun.util import daemon

__all__ = ["NotServing", "Processes", "WaitTimeout", "free_port", "kill_tree", "wait_for"]

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition polled by :func:`wait_for` was not met by its deadline."""


class NotServing(AssertionError):
    """A daemon exited, or missed its deadline, before it served: ``reason`` says which in one line (and where
    its log is), the message adds the end of its log."""

    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(f"{reason}: {log_tail}" if log_tail else reason)
        self.reason = reason


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition",
             interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; WaitTimeout at the deadline."""
    try:
        return daemon.wait_until(predicate, timeout, what, interval=interval)
    except TimeoutError as e:
        raise WaitTimeout(str(e)) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the caller binds it soon; another process may take it meanwhile)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kill_tree(proc: subprocess.Popen | psutil.Process, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
    """Signal a process and every descendant (the agent runs in its own session, so not by group), and reap them."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for p in (proc, *descendants):
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            p.send_signal(sig)
    if isinstance(proc, subprocess.Popen):
        proc.wait(timeout=timeout)  # reaped by Popen itself, so its returncode is the real one
    else:
        psutil.wait_procs([proc], timeout=timeout)
    psutil.wait_procs(descendants, timeout=timeout)


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # dead; reaping is its new parent's business
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: Sequence[psutil.Process], timeout: float) -> None:
    """Poll until each has died: a SIGKILL takes effect a moment after it is sent."""
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)


class Processes:
    """Every process started through it, stopped (newest first) by :meth:`stop_all` or on leaving ``with``."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, cmd: Sequence[str], log: Path | None = None, **kwargs) -> subprocess.Popen:
        """Start ``cmd``; ``log`` takes its stdout and stderr (appended), else its stdout is discarded."""
        with open(log, "ab") if log else contextlib.nullcontext(subprocess.DEVNULL) as out:
            proc = subprocess.Popen(list(cmd), stdout=kwargs.pop("stdout", out),
                                    stderr=subprocess.STDOUT if log else None, **kwargs)
        self.procs.append((name, proc))
        return proc

    def start_daemon(self, name: str, cmd: Sequence[str], *, ready: Callable[[], bool], log: Path,
                     timeout: float = 60, **kwargs) -> subprocess.Popen:
        """A process that must be serving before the caller goes on: started and waited for by dashrun's helper."""
        proc = daemon.start(cmd, ready=ready, what=name, log=log, timeout=timeout, **kwargs)
        self.procs.append((name, proc))
        return proc

    def add(self, name: str, proc: subprocess.Popen) -> subprocess.Popen:
        """A process started elsewhere, stopped with the others."""
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 30.0) -> int:
        """SIGTERM, ``timeout`` s, then SIGKILL of the process and whatever it leaves of its tree."""
        descendants: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants = psutil.Process(proc.pid).children(recursive=True)
        code = daemon.stop(proc, timeout=timeout)
        for p in descendants:  # what the process left behind (a daemon's workers), gone with it
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _wait_gone(descendants, timeout)
        return code

    def stop_all(self) -> None:
        for _name, proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                self.stop(proc)
        self.procs.clear()
