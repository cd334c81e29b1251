"""A client of dash-memd: one authenticated (and, unless ``--no-tls``, TLS) connection, requests one at a time.

Used by dash-agent (shards in, restores out) and by the ``dashrun``
commands. A broken connection is dropped and the next request reconnects;
retrying is the caller's decision.
"""

from __future__ import annotations

import select
import threading
from typing import Any, Callable, Sequence

from dashrun.errors import ProtocolError, UnavailableError
from dashrun.wire.auth import client_handshake
from dashrun.wire.channel import Channel
from dashrun.wire.messages import CheckpointInfo, JobSpec, Notice, ShardHeader
from dashrun.wire.protocol import MAX_BYTES, Kind
from dashrun.wire.tls import TlsSettings, connect

__all__ = ["MemdClient"]


class MemdClient:
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

    def __enter__(self) -> MemdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._ch is not None:
            self._ch.close()
            self._ch = None

    def idle_and_open(self) -> bool:
        """Whether the connection is up with nothing to read: an idle connection that dash-memd closed (it
        restarted, or timed the connection out) reads as ready, with its end of stream."""
        if self._ch is None:
            return False
        try:
            readable, _, _ = select.select([self._ch.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def _channel(self) -> Channel:
        if self._ch is None:
            sock = connect(self.host, self.port, self.tls, timeout=self.timeout, connect_timeout=self.connect_timeout)
            ch = Channel(sock)
            try:
                ch.settimeout(self.timeout)
                client_handshake(ch, self._token, self.address)
            except BaseException:
                ch.close()
                raise
            self._ch = ch
        return self._ch

    def _request(self, fn):
        """Run ``fn(channel)`` holding the connection; drop the connection if it breaks mid-request."""
        with self._lock:
            ch = self._channel()
            try:
                return fn(ch)
            except (UnavailableError, ProtocolError):
                self.close()
                raise

    # --- requests -------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        return self._request(lambda ch: ch.call(Kind.PING).body)

    def put_shard(self, header: ShardHeader, parts: Sequence[memoryview | bytes], *,
                  gate: Callable[[int], None] | None = None, node: str | None = None,
                  crc: Callable[[], int] | None = None) -> dict[str, Any]:
        """Send a shard's bytes (``parts``, in order); returns {committed, crc} once dash-memd stored them.

        ``gate`` lets the bytes stream while they are still being staged; ``crc``, the sender's checksum
        of them, known once they are (see Channel.send).
        """
        def run(ch: Channel):
            ch.call(Kind.PUT_SHARD, {**header.to_body(), "node": node})
            ch.send(Kind.SHARD_DATA, {}, data=parts, gate=gate, crc=crc)
            return ch.expect_reply().body
        return self._request(run)

    def latest(self, job: str, step: int | None = None) -> CheckpointInfo | None:
        body = self._request(lambda ch: ch.call(Kind.LATEST, {"job": job, "step": step}).body)
        raw = body.get("checkpoint")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ProtocolError("malformed LATEST reply")
        return CheckpointInfo.from_body(raw)

    def get_shard_into(self, job: str, step: int, rank: int, views: Sequence[memoryview], *,
                       offset: int | None = None) -> int:
        """Receive one committed shard into ``views`` (in order); returns its verified CRC-32C.

        With ``offset``, only the bytes from there that fill ``views`` (a byte range); the CRC returned
        is then the range's.
        """
        length = sum(len(v) for v in views)
        request = {"job": job, "step": step, "rank": rank}
        if offset is not None:
            request.update(offset=offset, length=length)

        def run(ch: Channel):
            ch.send(Kind.GET_SHARD, request)
            reply = ch.expect_reply(max_data=MAX_BYTES)
            if reply.data_len != length:
                ch.close()
                raise ProtocolError(f"shard {rank} of {job} step {step} has an unexpected size")
            return ch.recv_data_into(reply, views)
        return self._request(run)

    def wait(self, job: str, step: int, timeout: float, *, on_disk: bool = False) -> bool:
        """Block until the step is committed (with ``on_disk``: written to disk too); False on timeout."""
        def run(ch: Channel):
            ch.settimeout(self.timeout + timeout)
            try:
                body = {"job": job, "step": step, "timeout": timeout, "on_disk": on_disk}
                return bool(ch.call(Kind.WAIT, body).body.get("committed"))
            finally:
                ch.settimeout(self.timeout)
        return self._request(run)

    def list(self) -> dict[str, Any]:
        return self._request(lambda ch: ch.call(Kind.LIST).body)

    def put_spec(self, job: str, spec: JobSpec) -> None:
        self._request(lambda ch: ch.call(Kind.PUT_SPEC, {"job": job, "spec": spec.to_body()}))

    def get_spec(self, job: str) -> JobSpec | None:
        raw = self._request(lambda ch: ch.call(Kind.GET_SPEC, {"job": job}).body.get("spec"))
        if raw is not None and not isinstance(raw, dict):
            raise ProtocolError("malformed GET_SPEC reply")
        return JobSpec.from_body(raw) if raw is not None else None

    def delete(self, job: str, keep: int = 0) -> list[int]:
        """Delete a job's checkpoints but the newest ``keep`` (0: everything, launch spec included)."""
        return self._request(lambda ch: ch.call(Kind.DELETE, {"job": job, "keep": keep}).body.get("deleted", []))

    def notice(self, job: str, notice: Notice) -> None:
        """Record an interruption notice on the job (shown by ``dashrun status``)."""
        self._request(lambda ch: ch.call(Kind.NOTICE, {"job": job, **notice.to_body()}))
