"""One logged-in connection to a dashrun server, requests one at a time: what dash-memd's and the peer link's
clients share.

The connection is made on the first request (TLS unless the settings say plaintext, then the login:
:mod:`dashrun.wire.auth`). A connection the server closed while it idled (its idle timeout, a restart) is
found before a request is sent on it, and replaced; one that breaks mid-request is dropped, and the next
request reconnects. Retrying is the caller's decision.
"""

from __future__ import annotations

import select
import threading
from typing import Callable, TypeVar

from dashrun.errors import ProtocolError, UnavailableError
from dashrun.wire.auth import client_handshake
from dashrun.wire.channel import Channel
from dashrun.wire.tls import TlsSettings, connect

__all__ = ["Link"]

T = TypeVar("T")


class Link:
    """A client of the server at ``host:port``, logged in with ``token`` (what a token file holds).

    ``what`` names the server in connection errors; ``drop_on``: the errors of a request after which the
    connection is out of step and is dropped.
    """

    what = "dash-memd"
    drop_on: tuple[type[BaseException], ...] = (UnavailableError, ProtocolError)

    def __init__(self, host: str, port: int, token: bytes, *, timeout: float = 60.0, connect_timeout: float = 5.0,
                 tls: TlsSettings = TlsSettings()):
        self.host, self.port = host, port
        self._token = token
        self.tls = tls
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ch: Channel | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._ch is not None:
            self._ch.close()
            self._ch = None

    def idle_and_open(self) -> bool:
        """Whether the connection is up with nothing to read: an idle connection that the server closed (it
        restarted, or timed the connection out) reads as ready, with its end of stream."""
        if self._ch is None:
            return False
        try:
            readable, _, _ = select.select([self._ch.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def _channel(self) -> Channel:
        if self._ch is not None and not self.idle_and_open():  # the server closed it while it idled
            self.close()
        if self._ch is None:
            sock = connect(self.host, self.port, self.tls, timeout=self.timeout, connect_timeout=self.connect_timeout,
                           what=self.what)
            ch = Channel(sock)
            try:
                ch.settimeout(self.timeout)
                client_handshake(ch, self._token, self.address)
            except BaseException:
                ch.close()
                raise
            self._ch = ch
        return self._ch

    def _request(self, fn: Callable[[Channel], T]) -> T:
        """Run ``fn(channel)`` holding the connection; drop the connection if it breaks mid-request."""
        with self._lock:
            ch = self._channel()
            try:
                return fn(ch)
            except self.drop_on:
                self.close()
                raise
