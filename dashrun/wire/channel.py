"""Frames over a socket: the I/O half of :mod:`dashrun.wire.protocol`.

A :class:`Channel` sends and receives whole frames on a TCP or Unix stream
socket; a TCP one may be an ``ssl.SSLSocket`` (:mod:`dashrun.wire.tls`) for the
login, and after it carries records keyed from the login (:meth:`Channel.seal`,
:mod:`dashrun.wire.sealed`: sealed over TLS, signed with ``--no-tls``); file
descriptors travel on Unix sockets only.
Receiving is two-phase: :meth:`Channel.recv` returns the header and the
validated body, and the caller then decides where the data goes
(:meth:`Channel.recv_data_into`), so a shard lands straight in its final
buffer and a refused one is never allocated. Large data is sent straight
from the caller's memoryviews (a shared-memory mapping, a RAM buffer), never
copied in user space; the CRC-32C trailer is computed chunk by chunk as the
bytes go out, while they are still in cache. When the peer runs on this
machine, the sender yields the CPU after each chunk (see :data:`YIELD_TO_LOCAL_PEER`).
Received data goes through a chunk-sized buffer that stays in cache and on
into its destination with streaming stores that also checksum, where dashrun's
C helper is built (see :meth:`Channel.recv_data_into`).
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import ipaddress
import os
import socket
import time
from typing import Any, Callable, Iterable, Sequence

from dashrun import errors
from dashrun.errors import ProtocolError, UnavailableError
from dashrun.util.faults import crash_point
from dashrun.util.files import populated
from dashrun.wire.blocks import BLOCK, Marks
from dashrun.wire.protocol import (
    HEADER,
    MAX_BODY,
    MAX_FDS,
    TRAILER,
    Kind,
    crc32c,
    decode_body,
    decode_header,
    encode_body,
    encode_header,
)
from dashrun.wire.sealed import Records

__all__ = ["Channel", "CHUNK", "Frame", "peer_on_this_machine", "YIELD_TO_LOCAL_PEER"]

try:
    from dashrun.util import _ntcopy
except ImportError:  # not built (no C compiler at install): data is received straight into its destination
    _ntcopy = None
if _ntcopy is not None and not _ntcopy.STREAMING:  # built, but the CPU lacks what it needs
    _ntcopy = None

#: Bytes moved per send/recv call for bulk data: large enough to amortise the
#: Python overhead, small enough that the CRC of a chunk is still in cache.
CHUNK = 1 << 20
assert BLOCK % CHUNK == 0, "a received chunk must not cross a block's end"

#: After each chunk sent to a peer on this machine, yield the CPU. Where the
#: peer shares the sender's core (dash-agent and a local dash-memd), it then
#: takes each chunk while the chunk is still in cache, instead of after the
#: sender has filled the socket buffers (megabytes, out of the L2);
#: ``scripts/bench_stream.py`` measures the difference. With nothing else to
#: run the yield returns at once; a peer on another machine is never yielded to, so a sender on a busy
#: node keeps its share of the CPU.
YIELD_TO_LOCAL_PEER = True


def peer_on_this_machine(sock: socket.socket) -> bool:
    """Whether the other end of a TCP socket runs on this machine (loopback, or this machine's own address)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:  # not connected (yet, or any more)
        return False
    address = ipaddress.ip_address(peer.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return peer == local or address.is_loopback


@dataclasses.dataclass
class Frame:
    kind: Kind
    body: dict[str, Any]
    data_len: int
    fds: list[int] = dataclasses.field(default_factory=list)

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


class Channel:
    """One peer connection. Not thread-safe: callers serialise sends and receives."""

    def __init__(self, sock: socket.socket, *, max_body: int = MAX_BODY):
        self.sock = sock
        self.max_body = max_body
        self._unix = sock.family == socket.AF_UNIX
        self._pending_data = 0  # data bytes (+ trailer) of the last frame not yet consumed
        self._deadline: float | None = None
        self._peer_local = peer_on_this_machine(sock)
        self._landing: tuple[memoryview, int] | None = None  # (view, address) of the receive buffer, made on use
        self._records: Records | None = None  # after a login on TCP: its records (see seal())

    # --- plumbing ---------------------------------------------------------

    def settimeout(self, seconds: float | None) -> None:
        """Bound each wait for the peer (silence), as the socket's timeout does."""
        self._deadline = None
        self.sock.settimeout(seconds)

    def set_deadline(self, seconds: float) -> None:
        """Bound everything received from now on to ``seconds`` in total, however the peer trickles it."""
        self._deadline = time.monotonic() + seconds

    def seal(self, records: Records) -> None:
        """From now on send and receive through ``records`` (:mod:`dashrun.wire.sealed`), on this socket."""
        self._records = records

    def _arm(self) -> None:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise UnavailableError("peer timed out")
            self.sock.settimeout(left)

    def close(self) -> None:
        # shutdown first: a thread blocked in recv() on this socket would otherwise keep it open (no FIN sent).
        for end in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                end()
            except OSError:
                pass

    def _recv_exact(self, view: memoryview) -> None:
        got, size = 0, len(view)
        while got < size:
            self._arm()
            try:
                n = (self._records or self.sock).recv_into(view[got:], min(size - got, CHUNK))
            except socket.timeout:
                raise UnavailableError("peer timed out") from None
            except OSError as e:
                raise UnavailableError(f"connection lost: {e.strerror or e}") from None
            if n == 0:
                raise UnavailableError("connection closed by peer")
            got += n

    def _recv_header(self) -> tuple[bytes, list[int]]:
        if not self._unix:
            buf = bytearray(HEADER.size)
            self._recv_exact(memoryview(buf))
            return bytes(buf), []
        fds: list[int] = []
        self._arm()
        try:
            msg, ancdata, _flags, _addr = self.sock.recvmsg(
                HEADER.size, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:
            raise UnavailableError("peer timed out") from None
        except OSError as e:
            raise UnavailableError(f"connection lost: {e.strerror or e}") from None
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if not msg:
            for fd in fds:
                os.close(fd)
            raise UnavailableError("connection closed by peer")
        if len(msg) < HEADER.size:
            rest = bytearray(HEADER.size - len(msg))
            self._recv_exact(memoryview(rest))
            msg += bytes(rest)
        return msg, fds

    # --- receiving ----------------------------------------------------------

    def recv(self, *, max_data: int = 0, max_body: int | None = None) -> Frame:
        """Read one frame's header and body; its data (if any) is left for the caller."""
        if self._pending_data:
            raise ProtocolError("previous frame's data not consumed")
        raw, fds = self._recv_header()
        try:
            if len(fds) > MAX_FDS:
                raise ProtocolError("too many file descriptors attached")
            header = decode_header(raw, max_body=min(max_body or self.max_body, self.max_body), max_data=max_data)
            body_buf = bytearray(header.body_len)
            self._recv_exact(memoryview(body_buf))
            body = decode_body(header, bytes(body_buf))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._pending_data = header.data_len + TRAILER.size if header.data_len else 0
        return Frame(header.kind, body, header.data_len, fds)

    def recv_data_into(self, frame: Frame, views: Sequence[memoryview], marks: Marks | None = None) -> int:
        """Read the frame's data into ``views`` (their lengths must add up), verify the trailer.

        Returns the data's CRC-32C. Raises ChecksumError on a mismatch. ``marks`` (emptied first) receives
        the running CRC-32C at every block boundary of the data (see :mod:`dashrun.wire.blocks`).
        """
        if sum(len(v) for v in views) != frame.data_len:
            raise ProtocolError("receive buffers do not match the announced length")
        if marks is not None:
            del marks[:]
            marks.append(0)
        if not frame.data_len:
            return 0
        crc, received = 0, 0
        for view in views:
            # A sealed record is decrypted straight into the destination, written once, and the CRC reads it
            # back from cache: faster than landing it first (0.15 against 0.17-0.18 s per GiB here), and no
            # landing buffer per connection beside the record's. A signed record (--no-tls) is plaintext: it
            # lands, its tag is checked while it is in cache, and it moves on as plaintext does.
            landed = _ntcopy is not None and len(view) and (self._records is None or not self._records.encrypts)
            target = ctypes.c_char.from_buffer(view) if landed else None  # holds the view's buffer meanwhile
            try:
                start = 0
                while start < len(view):
                    n = min(CHUNK - received % CHUNK, len(view) - start)  # never across a block's end
                    if landed:
                        crc = self._recv_landed(ctypes.addressof(target) + start, n, crc)
                    else:
                        piece = view[start:start + n]
                        self._recv_exact(piece)
                        crc = crc32c(piece, crc)
                    start += n
                    received += n
                    if marks is not None and (received % BLOCK == 0 or received == frame.data_len):
                        marks.append(crc)
            finally:
                del target
        self._check_trailer(crc)
        return crc

    def _recv_landed(self, address: int, n: int, crc: int) -> int:
        """Receive ``n`` bytes (at most CHUNK) into the landing buffer, then on to ``address`` with streaming
        stores and the CRC (plaintext only, signed or not: a sealed record is decrypted straight into place).

        Received straight into a large destination (dash-memd's RAM buffer), the kernel's
        copy reads every destination line before writing it, then the CRC reads the chunk
        again. Landing in one reused chunk-sized buffer, the bytes stay in cache; the
        helper's copy writes them out without reading the destination and checksums
        them as it goes (``scripts/bench_stream.py`` compares both ways).
        """
        if self._landing is None:
            buf = populated(CHUNK)
            self._landing = memoryview(buf), ctypes.addressof(ctypes.c_char.from_buffer(buf))
        landing, landing_at = self._landing
        self._recv_exact(landing[:n])
        return _ntcopy.copy_crc(address, landing_at, n, crc)

    def recv_data(self, frame: Frame) -> bytes:
        buf = bytearray(frame.data_len)
        self.recv_data_into(frame, [memoryview(buf)])
        return bytes(buf)

    def _check_trailer(self, crc: int) -> None:
        trailer = bytearray(TRAILER.size)
        self._recv_exact(memoryview(trailer))
        self._pending_data = 0
        (expected,) = TRAILER.unpack(trailer)
        if expected != crc:
            raise errors.ChecksumError("data checksum mismatch: the bytes were corrupted in transit or at rest")

    # --- sending -------------------------------------------------------------

    def _sendall(self, data) -> None:
        try:
            (self._records or self.sock).sendall(data)
        except socket.timeout:
            raise UnavailableError("peer stopped reading (timed out)") from None
        except OSError as e:
            raise UnavailableError(f"connection lost: {e.strerror or e}") from None

    def send(self, kind: Kind, body: dict[str, Any] | None = None, *,
             data: Iterable[memoryview | bytes] | None = None, fds: Sequence[int] = (),
             crc: int | Callable[[], int] | None = None, gate: Callable[[int], None] | None = None) -> None:
        """Send a frame; ``data`` goes out as it is, from the caller's memory (no copy in user space).

        ``crc`` skips computing the data's checksum: a known value, or a function
        that gives it once the data is out (the rank's, computed as it staged).
        ``gate(end)`` is called before each chunk with the data offset the chunk
        ends at, and returns once those bytes are final: a shard can stream while
        its rank is still staging it. The receiver verifies the checksum.
        """
        parts = [memoryview(p).cast("B") for p in data] if data is not None else []
        data_len = sum(len(p) for p in parts)
        encoded = encode_body(body)
        head = encode_header(kind, encoded, data_len) + encoded
        if fds:
            try:
                sent = self.sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            except OSError as e:
                raise UnavailableError(f"connection lost: {e.strerror or e}") from None
            if sent < len(head):
                self._sendall(head[sent:])
        else:
            self._sendall(head)
        if not data_len:
            return
        running, offset = 0, 0
        for part in parts:
            for start in range(0, len(part), CHUNK):
                piece = part[start:start + CHUNK]
                offset += len(piece)
                if gate is not None:
                    gate(offset)
                if crc is None:
                    running = crc32c(piece, running)
                self._sendall(piece)
                if self._peer_local and YIELD_TO_LOCAL_PEER:
                    os.sched_yield()
                if offset == len(piece):  # the frame's first chunk is out
                    crash_point("channel.mid_data")
        if callable(crc):
            crc = crc()
        self._sendall(TRAILER.pack(crc if crc is not None else running))

    # --- request / reply ------------------------------------------------------

    def call(self, kind: Kind, body: dict[str, Any] | None = None, *, max_data: int = 0, **send_kwargs) -> Frame:
        """Send a request and return the reply; an ERROR reply is raised as the peer's exception."""
        self.send(kind, body, **send_kwargs)
        return self.expect_reply(max_data=max_data)

    def expect_reply(self, *, max_data: int = 0) -> Frame:
        reply = self.recv(max_data=max_data)
        if reply.kind == Kind.ERROR:
            reply.close_fds()
            raise errors.from_code(str(reply.body.get("code", "")), str(reply.body.get("message", "")))
        return reply

    def send_error(self, err: BaseException, **extra: Any) -> None:
        code = err.code.value if isinstance(err, errors.DashError) else errors.ErrorCode.INTERNAL.value
        message = err.message if isinstance(err, errors.DashError) else f"internal error: {type(err).__name__}"
        self.send(Kind.ERROR, {**extra, "code": code, "message": message[:1000]})
