"""A rank's connection to its node's dash-agent.

Requests carry an ``id`` and may overlap (a snapshot in flight while the rank
waits for a commit); a reader thread matches replies to futures. Nothing
here blocks a rank for long: connecting and every request have timeouts,
and if the agent goes away every pending request fails at once with
UnavailableError — the rank reports it and trains on. Each future carries
its ``request_id`` and ``answered``: whether the agent replied (or the request
never left: nothing of it is with the agent), or the link dropped first (a
SNAPSHOT's segment may then still be streaming).

The link holds at most :data:`MAX_PENDING` requests waiting for a reply; one
more fails at once with BusyError. A request whose caller gave up on it (the
timeout of :meth:`AgentLink.call`, or :meth:`AgentLink.forget`) is forgotten
then, and a reply that comes later is dropped (its descriptors closed), so a
slow agent costs the rank nothing that grows.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import socket
import threading
from typing import Any, Callable, Sequence

from dashrun import errors
from dashrun.errors import BusyError, UnavailableError
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.protocol import Kind

__all__ = ["AgentLink", "MAX_PENDING"]

#: Requests one link may have waiting for the agent's reply: a rank has a few snapshots in flight (one per
#: staging buffer) and a restore or a wait; thousands mean replies are not coming.
MAX_PENDING = 256


class AgentLink:
    """A rank's one connection to its node's dash-agent, made on the first request and again after a loss.

    Bodies are plain dicts: a typed message of :mod:`dashrun.wire.agent_messages`
    goes as its ``to_body()``, and the reply's body is read with its ``from_body``.
    """

    def __init__(self, path: str, *, connect_timeout: float = 5.0,
                 on_notice: Callable[[dict[str, Any]], None] | None = None,
                 on_reshape: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        self.connect_timeout = connect_timeout
        self.on_notice = on_notice  # called (on the reader thread) with each NOTICE the agent pushes
        self.on_reshape = on_reshape  # likewise with each RESHAPE (the world changes at a checkpoint)
        self._lock = threading.Lock()  # the connection: held while a request is sent
        self._ch: Channel | None = None
        # Never held across I/O: the reader takes it for each reply, also while a send blocks under _lock.
        self._pending_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future[Frame]] = {}
        self._ids = itertools.count(1)
        self._readers: list[threading.Thread] = []

    def _connect(self) -> Channel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise UnavailableError(f"cannot reach dash-agent at {self.path}: {e.strerror or e}") from None
        sock.settimeout(None)  # replies may be minutes apart; each request has its own timeout
        ch = Channel(sock)
        reader = threading.Thread(target=self._read_loop, args=(ch,), name="dashrun-agent-reader", daemon=True)
        self._readers = [r for r in self._readers if r.is_alive()] + [reader]
        reader.start()
        return ch

    def request(self, kind: Kind, body: dict[str, Any] | None = None,
                fds: Sequence[int] = ()) -> concurrent.futures.Future[Frame]:
        """Send a request; the future resolves to the OK reply or fails with the agent's error."""
        future: concurrent.futures.Future[Frame] = concurrent.futures.Future()
        future.answered = False
        with self._lock:
            request_id = future.request_id = next(self._ids)
            with self._pending_lock:
                if len(self._pending) >= MAX_PENDING:  # futures their callers cancelled go first
                    self._pending = {i: f for i, f in self._pending.items() if not f.done()}
                waiting = len(self._pending)
            if waiting >= MAX_PENDING:
                future.answered = True  # never sent: the agent holds nothing of it
                future.set_exception(BusyError(f"{waiting} requests to dash-agent wait for a reply already (at most "
                                               f"{MAX_PENDING}): {kind.name} not sent"))
                return future
            try:
                if self._ch is None:
                    self._ch = self._connect()
                with self._pending_lock:
                    self._pending[request_id] = future
                self._ch.send(kind, {**(body or {}), "id": request_id}, fds=fds)
            except UnavailableError as e:
                with self._pending_lock:
                    self._pending.pop(request_id, None)
                self._drop(self._ch, e)
                future.set_exception(e)
        return future

    def notify(self, kind: Kind, body: dict[str, Any]) -> bool:
        """Send a one-way message (no reply); False if the agent is unreachable (already reported)."""
        with self._lock:
            if self._ch is None:
                return False
            try:
                self._ch.send(kind, body)
                return True
            except UnavailableError as e:
                self._drop(self._ch, e)
                return False

    def call(self, kind: Kind, body: dict[str, Any] | None = None, *, timeout: float,
             fds: Sequence[int] = ()) -> Frame:
        """Send a request and wait up to ``timeout`` s for its reply; UnavailableError (and the request
        forgotten) past it."""
        future = self.request(kind, body, fds)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if not self.forget(future):
                return future.result()  # the reply came meanwhile: the reader is handing it over now
            raise UnavailableError(f"dash-agent did not answer {kind.name} within {timeout:.0f}s") from None

    def forget(self, future: concurrent.futures.Future[Frame]) -> bool:
        """Give up on a request of :meth:`request`: it no longer counts against MAX_PENDING, its future fails
        with UnavailableError, and a reply to it that comes later is dropped. False if its reply was taken
        already (the future is, or is about to be, resolved with it)."""
        with self._pending_lock:
            forgotten = self._pending.pop(future.request_id, None) is future
        if forgotten:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(UnavailableError("the request to dash-agent was given up"))
        return forgotten

    def _read_loop(self, ch: Channel) -> None:
        try:
            while True:
                frame = ch.recv()
                if frame.kind in (Kind.NOTICE, Kind.RESHAPE):
                    frame.close_fds()
                    callback = self.on_notice if frame.kind == Kind.NOTICE else self.on_reshape
                    if callback is not None:
                        callback(frame.body)
                    continue
                with self._pending_lock:  # not while forget() takes it: a reply goes to its waiter or nowhere
                    future = self._pending.pop(frame.body.get("id"), None)
                if future is None:  # forgotten (its caller gave up), or never asked: nothing waits for it
                    frame.close_fds()
                    continue
                future.answered = True
                try:
                    if frame.kind == Kind.ERROR:
                        frame.close_fds()
                        future.set_exception(errors.from_code(str(frame.body.get("code", "")),
                                                              str(frame.body.get("message", ""))))
                    else:
                        future.set_result(frame)
                except concurrent.futures.InvalidStateError:  # its caller cancelled it meanwhile
                    frame.close_fds()
        except errors.DashError as e:
            with self._lock:
                self._drop(ch, e if isinstance(e, UnavailableError) else UnavailableError(str(e)))
        except Exception as e:  # the reader is gone: requests waiting on it fail now instead of at their timeout
            with self._lock:
                self._drop(ch, UnavailableError(f"the connection to dash-agent failed: {e!r}"))
            raise

    def _drop(self, ch: Channel | None, err: errors.DashError) -> None:
        """Forget a broken connection and fail what waited on it (call with the lock held)."""
        if ch is not None and ch is self._ch:
            self._ch = None
            ch.close()
            with self._pending_lock:
                pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(err)

    def close(self, timeout: float = 5.0) -> None:
        """Close the connection and wait (up to ``timeout`` s) for its reader: nothing of the link, nor what its
        callbacks hold, is left to a thread that outlives the caller's teardown."""
        with self._lock:
            self._drop(self._ch, UnavailableError("closed"))
            readers, self._readers = self._readers, []
        for reader in readers:
            if reader is not threading.current_thread():
                reader.join(timeout)
