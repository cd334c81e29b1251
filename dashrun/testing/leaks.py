"""Every process a test started is gone after it: found by a marker in the environment, and by the process tree.

While a test runs, :func:`tagged` puts ``DASH_TEST_LEAK_TAG=<unique id>`` in
``os.environ``, so every process the test starts inherits it, and keeps it
when it leaves the tree (a daemon that double-forks, dash-agent in its own
session, an sshd session's ranks once the sshd is gone). :func:`leftovers`
finds the processes still alive that carry the tag, and the descendants of
this process that were not there when the test began (those started with an
environment of their own). :func:`check` polls until none is left, kills
what remains at the deadline and raises :class:`Leaked`, naming each
leaked process by its command line.

Processes that outlive a test by design (a module- or session-scoped
server) are started outside any tag, or registered with :func:`exempt`;
the harness's own classes (S3Server) keep the tag of the scope that made
them, so a restart inside a test stays the fixture's. Each pytest-xdist
worker tags its own tests and checks only its own.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Iterable, Iterator

import psutil

__all__ = ["TAG", "Leaked", "Watch", "check", "describe", "exempt", "leftovers", "tagged", "untagged_env"]

#: The environment variable that marks a test's processes.
TAG = "DASH_TEST_LEAK_TAG"
#: Seconds a test's processes get to finish going after its teardown.
DEADLINE = 5.0
#: Seconds between looks.
POLL = 0.05
#: Helpers a library starts once and keeps for the whole session (not a test's doing).
SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")

_exempt: set[int] = set()


class Leaked(AssertionError):
    """Processes a test started were still alive after it (they have been killed)."""


def exempt(pid: int) -> None:
    """``pid`` outlives the test that started it by design (a server of a wider fixture scope)."""
    _exempt.add(pid)


def untagged_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) without the marker: for a process that is not the current test's."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != TAG}


class Watch:
    """One test's watch: its tag and the descendants that were there before it began."""

    def __init__(self, tag: str):
        self.tag = tag
        self.before = {p.pid for p in _descendants()}


def _descendants() -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


@contextlib.contextmanager
def tagged(tag: str | None = None) -> Iterator[Watch]:
    """``os.environ`` carries a fresh tag inside the block; the previous value is put back after it."""
    watch = Watch(tag or uuid.uuid4().hex)
    previous = os.environ.get(TAG)
    os.environ[TAG] = watch.tag
    try:
        yield watch
    finally:
        if previous is None:
            os.environ.pop(TAG, None)
        else:
            os.environ[TAG] = previous


def _alive(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return p.status() != psutil.STATUS_ZOMBIE  # exited, only not yet reaped: nothing runs
    return False


def _session_helper(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(h in " ".join(p.cmdline()) for h in SESSION_HELPERS)
    return False


def leftovers(watch: Watch, keep: Iterable[int] = ()) -> list[psutil.Process]:
    """The processes of ``watch``'s test that are still alive, but for the pids in ``keep``."""
    me = os.getpid()
    keep = set(keep)
    skip = keep | _exempt | {me}
    found: dict[int, psutil.Process] = {}
    for p in _descendants():
        if p.pid not in watch.before and p.pid not in skip:
            found[p.pid] = p
    for p in psutil.process_iter():
        if p.pid in skip or p.pid in found:
            continue
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or another user's
            if p.environ().get(TAG) == watch.tag:
                found[p.pid] = p
    alive = []
    for p in found.values():
        if not _alive(p):
            continue
        if _session_helper(p):
            exempt(p.pid)
            continue
        alive.append(p)
    return alive


def describe(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {p.pid}: {' '.join(p.cmdline()) or p.name()}"
    return f"pid {p.pid}"


def check(watch: Watch, deadline: float = DEADLINE, keep: Iterable[int] = ()) -> None:
    """Wait up to ``deadline`` s for the test's processes to be gone; kill what is left and raise Leaked.

    ``keep``: pids the test still runs on purpose (a mid-test check while its dash-memd serves).
    """
    keep = set(keep)
    # Polled, not waited for with waitpid: reaping the test's own children would steal their exit codes from
    # the Popen objects that hold them (an exited child left unreaped is a zombie, which counts as gone).
    end = time.monotonic() + deadline
    left = leftovers(watch, keep)
    while left and time.monotonic() < end:
        time.sleep(POLL)
        left = leftovers(watch, keep)
    if not left:
        return
    names = [describe(p) for p in left]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    end = time.monotonic() + 10
    while any(_alive(p) for p in left) and time.monotonic() < end:
        time.sleep(POLL)
    raise Leaked(f"{len(names)} process(es) of the test still running {deadline:g}s after it "
                 f"(killed now):\n" + "\n".join(names))
