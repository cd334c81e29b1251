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

The accept loop calls :meth:`Admission.admit` for each new connection and
hands the :class:`Slot` to the connection's thread, which calls
:meth:`Slot.logged_in` once the login succeeded and :meth:`Slot.release` when
the connection ends.
"""

from __future__ import annotations

import collections
import enum
import logging
import socket
import threading

from dashrun.errors import BusyError, UnavailableError
from dashrun.util.problems import ProblemLog

__all__ = ["Admission", "Slot"]

log = logging.getLogger(__name__)


class _State(enum.Enum):
    LOGGING_IN = "logging in"
    AUTHENTICATED = "authenticated"
    DROPPED = "dropped"  # made room for a newer connection while logging in
    DONE = "done"


class Slot:
    """One connection's place in dash-memd's budgets."""

    def __init__(self, admission: Admission, sock: socket.socket):
        self._admission = admission
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
        self._logging_in: collections.OrderedDict[Slot, None] = collections.OrderedDict()  # oldest first
        self._authenticated = 0
        self._problems = ProblemLog(log)

    def admit(self, sock: socket.socket) -> Slot:
        """A slot for a connection just accepted; never blocks. Drops the oldest one logging in if need be."""
        slot = Slot(self, sock)
        dropped = None
        with self._lock:
            if len(self._logging_in) >= self.max_unauthenticated:
                oldest, _ = self._logging_in.popitem(last=False)
                oldest.state = _State.DROPPED
                dropped, oldest._handle = oldest._handle, None
            self._logging_in[slot] = None
        if dropped is not None:
            _close(dropped, shutdown=True)
            self._problems.problem("admission", "full",
                                   "%d connections have not logged in: dropping the oldest of them for each new one "
                                   "(--max-unauthenticated)", self.max_unauthenticated)
        return slot

    def _logged_in(self, slot: Slot) -> None:
        with self._lock:
            if slot.state is not _State.LOGGING_IN:
                raise UnavailableError("dropped while logging in: newer connections needed the room")
            del self._logging_in[slot]
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
                del self._logging_in[slot]
            elif slot.state is _State.AUTHENTICATED:
                self._authenticated -= 1
            slot.state = _State.DONE
            handle, slot._handle = slot._handle, None
        _close(handle, shutdown=False)
