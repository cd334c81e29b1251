"""Records of a logged-in TCP link: AES-256-GCM, keyed from this connection's TLS session.

TLS carries the handshake and the login (:mod:`dashrun.wire.auth`). Then both
ends close TLS (``close_notify``: ``SSLSocket.unwrap``) and go on, on the same
TCP connection, with records of their own, because Python's ``ssl`` moves at
most one 16 KiB TLS record per call: about one CPU-second per GiB on each end
of a link on this project's build machine, where AES-GCM itself costs a tenth
of that. A record here carries up to :data:`MAX_RECORD` bytes (a channel's
chunk): a GiB is a thousand calls, not 65,536.

Keys: HKDF-SHA256 over the cluster's token and the two login nonces, salted
with the channel binding, one key per direction. The nonces crossed the wire
inside TLS only, so an observer never saw them, and TLS's ephemeral key
exchange gives the records forward secrecy: a token stolen later does not
open a recorded connection. Each direction numbers its records; the number is
the AES-GCM nonce (never reused under a key) and every :data:`REKEY_RECORDS`
records the key is replaced by one derived from it, well inside AES-GCM's
per-key limits (RFC 8446, 5.5). A record's length is authenticated with its
bytes. A record that fails its tag — tampered with, replayed, reordered,
spliced from another connection — or is cut short ends the connection.

A record on the wire::

    length (4 bytes, big-endian, 1..MAX_RECORD) | ciphertext (length) | tag (16)
"""

from __future__ import annotations

import socket
import ssl
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from dashrun.errors import ProtocolError, UnavailableError

__all__ = ["MAX_RECORD", "REKEY_RECORDS", "Records", "after_login"]

#: Most plaintext bytes one record carries: the channel's chunk (it sends bulk data a chunk per call).
MAX_RECORD = 1 << 20
#: Records sealed under one key before both ends move to the next (at most 64 GiB of data).
REKEY_RECORDS = 1 << 16
_TAG = 16
_LENGTH = struct.Struct(">I")
_NONCE = struct.Struct(">4xQ")
_KEY = 32


def _next_key(key: bytes) -> bytes:
    return HKDFExpand(hashes.SHA256(), _KEY, b"dashrun record key update").derive(key)


class _Direction:
    """One direction's key and record number; the key moves on every REKEY_RECORDS records."""

    def __init__(self, key: bytes):
        self.key = key
        self.aead = AESGCM(key)
        self.number = 0

    def next(self) -> tuple[AESGCM, bytes]:
        """The cipher and nonce of the next record."""
        sealing = self.aead, _NONCE.pack(self.number)
        self.number += 1
        if self.number % REKEY_RECORDS == 0:
            self.key = _next_key(self.key)
            self.aead = AESGCM(self.key)
        return sealing


class Records:
    """``sendall`` and ``recv_into`` of a socket, in sealed records (see the module's text).

    One thread sends and one receives at a time, as on any stream a channel owns. Buffers are made on
    first use and reused: the ciphertext of the largest record seen, and the plaintext of a record
    only partly taken (a frame's header is read before its body).
    """

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._send = _Direction(send_key)
        self._recv = _Direction(recv_key)
        self._out = bytearray()
        self._in = bytearray()
        self._plain = bytearray()
        self._pending = memoryview(self._plain)

    # --- sending --------------------------------------------------------------

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), MAX_RECORD):
            piece = view[start:start + MAX_RECORD]
            n = len(piece)
            if len(self._out) < _LENGTH.size + n + _TAG:
                self._out = bytearray(_LENGTH.size + max(n, 4096) + _TAG)
            out = memoryview(self._out)
            length = _LENGTH.pack(n)
            out[:_LENGTH.size] = length
            aead, nonce = self._send.next()
            aead.encrypt_into(nonce, piece, length, out[_LENGTH.size:_LENGTH.size + n + _TAG])
            self.sock.sendall(out[:_LENGTH.size + n + _TAG])

    # --- receiving ------------------------------------------------------------

    def recv_into(self, view: memoryview, nbytes: int) -> int:
        """Up to ``nbytes`` plaintext bytes into ``view``; 0 only where the peer closed between records."""
        if not self._pending:
            n = self._next_record()
            if n == 0:
                return 0
            if nbytes >= n:  # the whole record is wanted: open it in place
                self._open(n, view[:n])
                return n
            if len(self._plain) < n:
                self._plain = bytearray(n)
            self._open(n, memoryview(self._plain)[:n])
            self._pending = memoryview(self._plain)[:n]
        take = min(nbytes, len(self._pending))
        view[:take] = self._pending[:take]
        self._pending = self._pending[take:]
        return take

    def _next_record(self) -> int:
        """Read the next record's length and sealed bytes into the ciphertext buffer; 0 at a clean end."""
        head = bytearray(_LENGTH.size)
        if not self._read_exact(memoryview(head), at_boundary=True):
            return 0
        (n,) = _LENGTH.unpack(head)
        if not 0 < n <= MAX_RECORD:
            raise ProtocolError(f"a sealed record of {n} bytes (at most {MAX_RECORD})")
        if len(self._in) < n + _TAG:
            self._in = bytearray(n + _TAG)
        self._read_exact(memoryview(self._in)[:n + _TAG], at_boundary=False)
        return n

    def _open(self, n: int, into: memoryview) -> None:
        aead, nonce = self._recv.next()
        try:
            aead.decrypt_into(nonce, memoryview(self._in)[:n + _TAG], _LENGTH.pack(n), into)
        except InvalidTag:
            raise UnavailableError("a record failed authentication (altered, replayed or reordered on the "
                                   "way): connection dropped") from None

    def _read_exact(self, view: memoryview, *, at_boundary: bool) -> bool:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if got == 0 and at_boundary:
                    return False
                raise UnavailableError("connection cut inside a record")
            got += n
        return True


def after_login(sock: ssl.SSLSocket, token: bytes, binding: bytes, client_nonce: str, server_nonce: str, *,
                client: bool) -> Records:
    """End TLS on a logged-in connection and return its records, keyed from the login (see the module's text).

    Both ends call it once the login succeeded, the client after it checked WELCOME and the server after
    it sent it; each sends its ``close_notify`` and waits for the other's. Raises UnavailableError if the
    peer does not answer in time or the connection breaks.
    """
    keys = HKDF(hashes.SHA256(), 2 * _KEY, salt=binding, info=b"dashrun records v1").derive(
        token + bytes.fromhex(client_nonce) + bytes.fromhex(server_nonce))
    to_server, to_client = keys[:_KEY], keys[_KEY:]
    try:
        plain = sock.unwrap()
    except socket.timeout:
        raise UnavailableError("the peer did not close TLS after the login (timed out)") from None
    except OSError as e:
        raise UnavailableError(f"connection lost closing TLS after the login: "
                               f"{getattr(e, 'reason', None) or e.strerror or e}") from None
    return Records(plain, to_server, to_client) if client else Records(plain, to_client, to_server)
