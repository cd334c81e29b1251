"""Retry with backoff: the one way dashrun tries again.

:class:`Backoff` is the schedule (a first pause that doubles after each
failure up to a longest one, with jitter so that many nodes do not retry in
step); :func:`retry` calls a function until it succeeds, the attempts run
out, or a deadline passes. Loops that must keep doing other work between
tries (a poller, an upload queue) hold a :class:`Backoff` and ask it for the
next pause themselves.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable, TypeVar

__all__ = ["Backoff", "retry"]

T = TypeVar("T")


@dataclasses.dataclass
class Backoff:
    """Pauses of ``first`` seconds, doubling after each failure up to ``longest``.

    Each pause is drawn from ``[(1 - jitter) * p, p]``; ``failures`` counts
    the pauses handed out since the last :meth:`reset` (a success).
    """

    first: float = 1.0
    longest: float = 60.0
    jitter: float = 0.5
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.longest or not 0 <= self.jitter < 1:
            raise ValueError("need 0 < first <= longest and 0 <= jitter < 1")

    def next_delay(self) -> float:
        """The pause before the next try; each call counts one more failure."""
        pause = min(self.longest, self.first * 2 ** min(self.failures, 62))
        self.failures += 1
        return pause * (1 - self.jitter * random.random())

    def reset(self) -> None:
        self.failures = 0


def retry(fn: Callable[[], T], *, on: type[BaseException] | tuple[type[BaseException], ...], backoff: Backoff,
          attempts: int | None = None, deadline: float | None = None,
          giving_up: Callable[[BaseException], bool] = lambda e: False,
          on_retry: Callable[[BaseException, float], None] | None = None,
          sleep: Callable[[float], object] = time.sleep) -> T:
    """``fn()``, tried again after an exception of type ``on`` while tries and time are left.

    ``attempts`` bounds the calls (None: unbounded), ``deadline`` (a
    ``time.monotonic()`` value) the time: a pause that would end past it is
    not taken. ``giving_up(e)`` True re-raises ``e`` at once (an error that
    another try cannot mend). ``on_retry(e, pause)`` is told before each
    pause. The last exception is re-raised as it is.
    """
    calls = 0
    while True:
        calls += 1
        try:
            return fn()
        except on as e:
            if giving_up(e) or (attempts is not None and calls >= attempts):
                raise
            pause = backoff.next_delay()
            if deadline is not None and time.monotonic() + pause > deadline:
                raise
            if on_retry is not None:
                on_retry(e, pause)
            sleep(pause)
