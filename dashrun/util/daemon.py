"""Start a daemon and wait until it is ready; stop it; poll for a condition with a deadline.

The one way dashrun's launcher (its dash-agent, the private dash-memd), the
tests, the benchmarks and the demo start a process that must be serving
before anything goes on: start it, poll a readiness check, and if the
process exits first or the deadline passes, kill it and say so in one line.
A Unix socket that a daemon serves can also be made before the daemon, by
its starter, which hands it on (:func:`private_listener`): whoever connects
meanwhile waits in its queue instead of being refused.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from dashrun.errors import UnavailableError

__all__ = ["accepting", "file_written", "private_listener", "start", "stop", "wait_until"]

T = TypeVar("T")

#: Seconds between readiness checks.
POLL = 0.02


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = POLL) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def file_written(path: str | Path) -> Callable[[], bool]:
    """Ready once ``path`` exists and is not empty (a daemon's ready file, written atomically)."""
    path = Path(path)

    def check() -> bool:
        try:
            return path.stat().st_size > 0
        except FileNotFoundError:
            return False
    return check


def accepting(path: str | Path) -> Callable[[], bool]:
    """Ready once a Unix socket at ``path`` accepts a connection."""
    def check() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
                return True
            except OSError:
                return False
    return check


def private_listener(path: str | Path, backlog: int = 256) -> socket.socket:
    """A Unix socket listening at ``path`` (replacing a stale one) that only this user may connect to."""
    path = Path(path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old_umask)
    return listener


def start(argv: Sequence[str], *, ready: Callable[[], bool], what: str, timeout: float = 60.0,
          log: str | Path | None = None, **popen_kwargs) -> subprocess.Popen:
    """Run ``argv`` and return once ``ready()`` is true.

    ``log``: a file that takes the process's stdout and stderr (appended).
    Other keywords go to :class:`subprocess.Popen`. If the process exits
    before it is ready, or ``timeout`` passes, it is killed and
    UnavailableError names ``what``, the exit code and the log.
    """
    log_file = open(log, "ab") if log is not None else None
    if log_file is not None:
        popen_kwargs.update(stdout=log_file, stderr=subprocess.STDOUT)
    try:
        proc = subprocess.Popen(list(argv), **popen_kwargs)
    finally:
        if log_file is not None:
            log_file.close()  # the child holds its own descriptor
    where = f"; see {log}" if log is not None else ""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise UnavailableError(f"{what} exited with code {proc.returncode} before it was ready{where}")
        if time.monotonic() > deadline:
            stop(proc, timeout=0)
            raise UnavailableError(f"{what} was not ready within {timeout:g}s{where}")
        time.sleep(POLL)
    return proc


def stop(proc: subprocess.Popen, *, timeout: float, sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` (a daemon finishes its work on SIGTERM), wait up to ``timeout`` s, then SIGKILL; the exit code."""
    if proc.poll() is None:
        if timeout > 0:
            proc.send_signal(sig)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
    return proc.wait()
