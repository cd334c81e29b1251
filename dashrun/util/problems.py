"""Log each kind of problem once: a failing loop says what is wrong once, not once per try.

A :class:`ProblemLog` remembers, per key (a job, a service), the kinds of
problem it has reported since that key last worked. A new kind is logged at
the level asked for; a kind already reported goes to DEBUG. :meth:`ok` forgets
them and, if anything had been reported, logs once that it works again.
"""

from __future__ import annotations

import logging
import threading
from typing import Hashable

__all__ = ["ProblemLog"]


class ProblemLog:
    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._lock = threading.Lock()
        self._seen: dict[Hashable, set[str]] = {}

    def problem(self, key: Hashable, kind: str, message: str, *args, level: int = logging.WARNING,
                **log_kwargs) -> bool:
        """Log ``message % args`` at ``level`` if ``kind`` is new for ``key`` (else at DEBUG); True if it was new."""
        with self._lock:
            seen = self._seen.setdefault(key, set())
            new = kind not in seen
            seen.add(kind)
        self.logger.log(level if new else logging.DEBUG, message, *args, **log_kwargs)
        return new

    def ok(self, key: Hashable, message: str | None = None, *args, level: int = logging.INFO) -> bool:
        """``key`` works again; logs ``message`` if a problem of it had been reported. True if one had."""
        with self._lock:
            had = bool(self._seen.pop(key, None))
        if had and message is not None:
            self.logger.log(level, message, *args)
        return had

    def failing(self, key: Hashable) -> bool:
        """Whether a problem of ``key`` was reported and it has not worked since."""
        with self._lock:
            return bool(self._seen.get(key))

    def forget(self, key: Hashable) -> None:
        """Drop what was reported about ``key`` without saying anything (the key is gone)."""
        with self._lock:
            self._seen.pop(key, None)
