"""Stop signals taken by a loop, never by a handler: SIGTERM and SIGINT held pending until asked for; and the
watch a daemon keeps on the process that started it."""

from __future__ import annotations

import os
import signal

__all__ = ["PARENT_GONE", "PARENT_POLL", "STOP_SIGNALS", "block_stop_signals", "next_stop_signal", "wait_for_stop"]

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
#: Seconds between looks at whether a daemon's parent is still there.
PARENT_POLL = 0.5
#: What :func:`wait_for_stop` returns when the parent it watches is gone.
PARENT_GONE = 0


def block_stop_signals() -> None:
    """Hold SIGTERM/SIGINT pending instead of interrupting; call before starting any thread.

    The daemons then take them with :func:`next_stop_signal` in their main
    loop: no handler runs at an arbitrary point (a handler that takes a lock
    the interrupted code holds deadlocks), and every thread inherits the mask.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def next_stop_signal(timeout: float | None = None) -> int | None:
    """Wait for SIGTERM or SIGINT (blocked by :func:`block_stop_signals`); None on timeout."""
    if timeout is None:
        return signal.sigwait(STOP_SIGNALS)
    info = signal.sigtimedwait(STOP_SIGNALS, timeout)
    return info.si_signo if info else None


def wait_for_stop(parent_pid: int | None = None) -> int:
    """Wait until a daemon must stop: SIGTERM or SIGINT (its number), or — with ``parent_pid`` — until that process
    is no longer this one's parent (:data:`PARENT_GONE`): the launcher that started it died, SIGKILL included.

    A daemon the launcher starts (dash-agent, the private dash-memd) runs in a session of its own, so that
    terminal signals reach the launcher only; nothing else would tell it that the launcher is gone. A parent
    already gone when this is called (it died while the daemon started) is seen at once.
    """
    while True:
        if parent_pid is not None and os.getppid() != parent_pid:
            return PARENT_GONE
        signum = next_stop_signal(timeout=PARENT_POLL if parent_pid is not None else None)
        if signum is not None:
            return signum
