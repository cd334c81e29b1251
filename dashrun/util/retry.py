"""Retry with backoff: the one way dashrun tries again.

:class:`Backoff` is the schedule (a first pause that doubles after each
failure up to a longest one, with jitter so that many nodes do not retry in
step); :func:`retry` calls a function until it succeeds, the attempts run
out, or a deadline passes. Loops that must keep doing other work between
tries (a poller, an upload queue) hold a :class:`Backoff` and ask it for the
next pause themselves. :func:`countdown` is what a retry with a deadline tells
a person: that it retries and for how long more, once, then at most every
:data:`SAY_EVERY` seconds, rather than a line at every pause.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable, TypeVar

__all__ = ["SAY_EVERY", "Backoff", "countdown", "retry"]

T = TypeVar("T")

#: Seconds between two lines of :func:`countdown` about the same wait.
SAY_EVERY = 10.0


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


def countdown(say: Callable[[str], object], deadline: float, *, every: float = SAY_EVERY,
              clock: Callable[[], float] = time.monotonic) -> Callable[[BaseException, float], None]:
    """An ``on_retry`` for :func:`retry` with ``deadline`` (a ``clock()`` value) that calls ``say(line)``, the line
    being ``"<error>; retrying for N s more"``, at the first retry and then at most every ``every`` seconds: a
    wait of 30 s is two or three lines that say how long it may last, not fifteen that say it goes on."""
    said_at: float | None = None

    def on_retry(error: BaseException, pause: float) -> None:
        nonlocal said_at
        now = clock()
        if said_at is not None and now - said_at < every:
            return
        said_at = now
        say(f"{error}; retrying for {max(0, round(deadline - now))} s more")

    return on_retry
