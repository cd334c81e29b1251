"""Stop signals taken by a loop, never by a handler: SIGTERM and SIGINT held pending until asked for."""

from __future__ import annotations

import signal

__all__ = ["STOP_SIGNALS", "block_stop_signals", "next_stop_signal"]

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


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
