"""One logged-in connection to a dashrun server, requests one at a time: what dash-memd's and the peer link's
clients share, the data set cache's objects among it (both serve them: :mod:`dashrun.data.objects`).

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
from dashrun.wire.protocol import Kind, field_bool
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

    def data_object(self, url: str, info: dict, nbytes: int) -> tuple[str, bytes] | None:
        """(SHA-256, bytes) of the listed object ``info`` (an ObjectInfo's JSON) of ``url`` from the server's data
        cache (dash-memd's, a peer agent's node's), or None where it holds none."""
        def run(ch: Channel) -> tuple[str, bytes] | None:
            reply = ch.call(Kind.DATA_OBJECT_GET, {"url": url, "object": info}, max_data=nbytes)
            if not field_bool(reply.body, "found"):
                return None
            if reply.data_len != nbytes:
                raise ProtocolError("DATA_OBJECT_GET answered another length than the object's")
            sha256 = reply.body.get("sha256")
            data = ch.recv_data(reply)
            if not isinstance(sha256, str) or len(sha256) != 64:
                raise ProtocolError("malformed DATA_OBJECT_GET reply")
            return sha256, data
        return self._request(run)

    def put_data_object(self, url: str, info: dict, sha256: str, data: bytes) -> bool:
        """Offer an object to the server's data cache; whether it took it (False: it holds it, keeps none, or has
        no room)."""
        def run(ch: Channel) -> bool:
            reply = ch.call(Kind.DATA_OBJECT_PUT, {"url": url, "object": info, "sha256": sha256})
            if not field_bool(reply.body, "accept"):
                return False
            ch.send(Kind.DATA_OBJECT_BYTES, data=[data])
            ch.expect_reply()
            return True
        return self._request(run)
