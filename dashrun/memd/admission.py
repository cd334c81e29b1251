"""Who may hold a connection to dash-memd: a small budget for connections still logging in, another for clients.

A connection counts against the unauthenticated budget (``--max-unauthenticated``)
from accept until its login succeeds, then against the authenticated one
(``--max-connections``). Separate budgets, so that connections that never log
in (idle sockets, a port scan, someone without the token) cannot take the
slots a node's agent needs: when the unauthenticated budget is full, the
oldest connection still logging in is dropped to make room for the new one.
To keep a client out, one would then have to open connections faster than
the client completes its login (a round trip or two), and would still hold
none of the authenticated slots. A client that logs in while every
authenticated slot is taken is told BUSY.

One source address may hold at most :data:`PER_SOURCE_SHARE` of the
unauthenticated budget: beyond it, its own oldest login is dropped, not
another host's, so one host cannot push every other out. A source whose logins
fail (a wrong token: a guess) is slowed down: :data:`FAILED_LOGIN_BURST`
failures are let through, then one per :data:`FAILED_LOGIN_PERIOD` seconds;
a connection from it beyond that is closed at once, before any byte is read.
Loopback is exempt from both: it is dash-memd's own host, whose users could
stop the daemon anyway, and where one test machine plays a whole fleet.

The accept loop calls :meth:`Admission.admit` for each new connection and
hands the :class:`Slot` to the connection's thread, which calls
:meth:`Slot.logged_in` once the login succeeded and :meth:`Slot.release` when
the connection ends.
"""

from __future__ import annotations

import collections
import enum
import ipaddress
import logging
import socket
import threading
import time

from dashrun.errors import BusyError, UnavailableError
from dashrun.util.problems import ProblemLog

__all__ = ["FAILED_LOGIN_BURST", "FAILED_LOGIN_PERIOD", "PER_SOURCE_SHARE", "Admission", "Slot"]

log = logging.getLogger(__name__)

#: Share of the unauthenticated budget one source address may hold (at least one connection).
PER_SOURCE_SHARE = 0.25
#: Failed logins a source may have before it is slowed down, and the seconds it then earns one more in.
FAILED_LOGIN_BURST = 10
FAILED_LOGIN_PERIOD = 1.0
#: Sources whose failures are remembered at most (the least recently failed is forgotten first).
_MAX_TRACKED = 4096


def _exempt(source: str) -> bool:
    try:
        return ipaddress.ip_address(source.split("%", 1)[0]).is_loopback
    except ValueError:
        return not source  # a Unix socket's peer has no address


class FailedLogins:
    """A token bucket per source address: each failed login takes a token; an empty bucket refuses."""

    def __init__(self, burst: int = FAILED_LOGIN_BURST, period: float = FAILED_LOGIN_PERIOD,
                 clock=time.monotonic):
        self.burst, self.period, self._clock = burst, period, clock
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self.refused = 0

    def _level(self, source: str, now: float) -> float:
        tokens, then = self._buckets.get(source, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - then) / self.period)

    def allowed(self, source: str) -> bool:
        """Whether a new connection from ``source`` may try to log in (the caller holds the lock)."""
        if source not in self._buckets or _exempt(source):
            return True
        ok = self._level(source, self._clock()) >= 1.0
        self.refused += not ok
        return ok

    def failed(self, source: str) -> None:
        if _exempt(source):
            return
        now = self._clock()
        self._buckets[source] = (max(0.0, self._level(source, now) - 1.0), now)
        self._buckets.move_to_end(source)
        while len(self._buckets) > _MAX_TRACKED:
            self._buckets.popitem(last=False)


class _State(enum.Enum):
    LOGGING_IN = "logging in"
    AUTHENTICATED = "authenticated"
    DROPPED = "dropped"  # made room for a newer connection while logging in
    DONE = "done"


class Slot:
    """One connection's place in dash-memd's budgets."""

    def __init__(self, admission: Admission, sock: socket.socket, source: str):
        self._admission = admission
        self.source = source
        # Our own descriptor of the connection: the one the accept loop got may be handed over (wrapped in
        # TLS) by the connection's thread, and dropping the connection must still reach it.
        self._handle: socket.socket | None = sock.dup()
        self.state = _State.LOGGING_IN

    def logged_in(self) -> None:
        """The login succeeded: move to the authenticated budget; BusyError if it is full."""
        self._admission._logged_in(self)

    def release(self) -> None:
        """The connection ended (in any state); idempotent."""
        self._admission._release(self)

    def login_failed(self) -> None:
        """The peer did not hold the key it claimed: count it against its source."""
        with self._admission._lock:
            self._admission.failed_logins.failed(self.source)


def _close(handle: socket.socket | None, shutdown: bool) -> None:
    if handle is None:
        return
    if shutdown:  # ends the connection's blocked reads and writes, whatever socket object they use
        try:
            handle.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    handle.close()


class Admission:
    """The two connection budgets of one dash-memd."""

    def __init__(self, max_authenticated: int, max_unauthenticated: int):
        if max_authenticated < 1 or max_unauthenticated < 1:
            raise ValueError("connection budgets must be at least 1")
        self.max_authenticated = max_authenticated
        self.max_unauthenticated = max_unauthenticated
        self._lock = threading.Lock()
        self.per_source = max(1, int(max_unauthenticated * PER_SOURCE_SHARE))
        self._logging_in: collections.OrderedDict[Slot, None] = collections.OrderedDict()  # oldest first
        self._by_source: dict[str, collections.OrderedDict[Slot, None]] = {}
        self._authenticated = 0
        self.failed_logins = FailedLogins()
        self._problems = ProblemLog(log)

    def admit(self, sock: socket.socket, source: str = "") -> Slot:
        """A slot for a connection just accepted from ``source`` (its address); never blocks. Drops the oldest
        one logging in (of the same source, if it holds its share) if need be. BusyError: ``source`` failed
        too many logins of late (the caller closes the connection)."""
        dropped, reason = None, ""
        with self._lock:
            if not self.failed_logins.allowed(source):
                raise BusyError(f"{source}: too many failed logins of late")
            slot = Slot(self, sock, source)
            mine = self._by_source.setdefault(source, collections.OrderedDict())
            if len(mine) >= self.per_source and not _exempt(source):
                dropped, reason = next(iter(mine)), "source"
            elif len(self._logging_in) >= self.max_unauthenticated:
                dropped, reason = next(iter(self._logging_in)), "full"
            handle = None
            if dropped is not None:
                self._forget(dropped)
                dropped.state = _State.DROPPED
                handle, dropped._handle = dropped._handle, None
            self._logging_in[slot] = None
            self._by_source.setdefault(source, collections.OrderedDict())[slot] = None
        if dropped is not None:
            _close(handle, shutdown=True)
            if reason == "full":
                self._problems.problem("admission", "full",
                                       "%d connections have not logged in: dropping the oldest of them for each new "
                                       "one (--max-unauthenticated)", self.max_unauthenticated)
            else:
                self._problems.problem("admission", "source",
                                       "%s holds %d connections that have not logged in: dropping its oldest for each "
                                       "new one", source, self.per_source)
        return slot

    def _forget(self, slot: Slot) -> None:
        """Take a slot that is logging in off both lists (the caller holds the lock)."""
        del self._logging_in[slot]
        mine = self._by_source[slot.source]
        del mine[slot]
        if not mine:
            del self._by_source[slot.source]

    def _logged_in(self, slot: Slot) -> None:
        with self._lock:
            if slot.state is not _State.LOGGING_IN:
                raise UnavailableError("dropped while logging in: newer connections needed the room")
            self._forget(slot)
            busy = self._authenticated >= self.max_authenticated
            slot.state = _State.DONE if busy else _State.AUTHENTICATED
            self._authenticated += not busy
            handle, slot._handle = slot._handle, None
            calm = not self._logging_in
        _close(handle, shutdown=False)
        if calm:
            self._problems.ok("admission")
        if busy:
            raise BusyError(f"dash-memd is serving its maximum of {self.max_authenticated} clients",
                            hint="retry later, or raise --max-connections")

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot.state is _State.LOGGING_IN:
                self._forget(slot)
            elif slot.state is _State.AUTHENTICATED:
                self._authenticated -= 1
            slot.state = _State.DONE
            handle, slot._handle = slot._handle, None
        _close(handle, shutdown=False)
