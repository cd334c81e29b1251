"""A rank's connection to its node's dash-agent.

Requests carry an ``id`` and may overlap (a snapshot in flight while the rank
waits for a commit); a reader thread matches replies to futures. Nothing
here blocks a rank for long: connecting and every request have timeouts,
and if the agent goes away every pending request fails at once with
UnavailableError — the rank reports it and trains on. Each future carries
its ``request_id`` and ``answered``: whether the agent replied, or the link
dropped first (a SNAPSHOT's segment may then still be streaming).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import socket
import threading
from typing import Any, Callable, Sequence

from dashrun import errors
from dashrun.errors import UnavailableError
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.protocol import Kind

__all__ = ["AgentLink"]


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
        self._lock = threading.Lock()
        self._ch: Channel | None = None
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
            try:
                if self._ch is None:
                    self._ch = self._connect()
                self._pending[request_id] = future
                self._ch.send(kind, {**(body or {}), "id": request_id}, fds=fds)
            except UnavailableError as e:
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

    def call(self, kind: Kind, body: dict[str, Any] | None = None, *, timeout: float) -> Frame:
        future = self.request(kind, body)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise UnavailableError(f"dash-agent did not answer {kind.name} within {timeout:.0f}s") from None

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
                future = self._pending.pop(frame.body.get("id"), None)
                if future is None:
                    frame.close_fds()
                    continue
                future.answered = True
                if frame.kind == Kind.ERROR:
                    frame.close_fds()
                    future.set_exception(errors.from_code(str(frame.body.get("code", "")),
                                                          str(frame.body.get("message", ""))))
                else:
                    future.set_result(frame)
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
