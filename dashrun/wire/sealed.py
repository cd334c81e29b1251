"""Records of a logged-in TCP link, keyed from its login: sealed (AES-128-GCM) over TLS, signed with ``--no-tls``.

TLS carries the handshake and the login (:mod:`dashrun.wire.auth`). Then both
ends close TLS (``close_notify``: ``SSLSocket.unwrap``) and go on, on the same
TCP connection, with records of their own, because Python's ``ssl`` moves at
most one 16 KiB TLS record per call: about one CPU-second per GiB on each end
of a link on this project's build machine, where AES-GCM itself costs a tenth
of that. A record here carries up to :data:`MAX_RECORD` bytes (a channel's
chunk): a GiB is a thousand calls, not 65,536.

Keys: HKDF-SHA256 over the cluster's token and the two login nonces, salted
with the channel binding, one key per direction. Over TLS the nonces crossed
the wire inside TLS only, so an observer never saw them, and TLS's ephemeral
key exchange gives the records forward secrecy: a token stolen later does not
open a recorded connection. Each direction numbers its records; the number is
the nonce (never reused under a key) and every :data:`REKEY_RECORDS` records
the key is replaced by one derived from it, well inside AES-GCM's per-key
limits (RFC 8446, 5.5). A record's length is authenticated with its bytes. A
record that fails its tag — tampered with, replayed, reordered, spliced from
another connection — raises :class:`~dashrun.errors.RecordTagError` (an
UnavailableError told apart, for dash-memd to count), or is cut short, ends
the connection; either way its destination is zeroed first, so that no byte
of it (decrypted before its tag was checked, or received in the clear) is
ever taken for data.

A direction's record number is never shared between threads: each direction
has a lock, held while a record is numbered, sealed and sent (a whole
``sendall``), or read, numbered and opened, so two threads sending on one
link take turns, their records in the order of their numbers, instead of
sealing two records under one nonce.

A sealed record on the wire (:class:`Records`)::

    length (4 bytes, big-endian, 1..MAX_RECORD) | ciphertext (length) | tag (16)

With ``--no-tls`` the bytes stay in the clear (what the flag asks for), but the
token still keys the records, so that no one on the path can change, drop,
replay or inject a byte after the login unseen (:class:`SignedRecords`): the
same numbering and rekeying, keys derived under another label (from the token:
the nonces crossed in the clear), and the bytes go as they are, with a tag:
ChaCha20-Poly1305 with nothing to encrypt and the record's bytes as its
associated data, that is Poly1305 under a one-time key per record number
(RFC 8439; the construction authenticates the associated data's length too).
Poly1305 is as fast as GMAC and several times HMAC-SHA256
(``scripts/bench_mac.py`` measures them on 1 MiB records), without needing AES
instructions. The tag goes first, so that a record's bytes are received
straight into their destination and checked there::

    length (4 bytes, big-endian, 1..MAX_RECORD) | tag (16) | bytes (length)
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from dashrun.errors import ProtocolError, RecordTagError, UnavailableError

__all__ = ["MAX_RECORD", "REKEY_RECORDS", "Records", "SignedRecords", "after_login"]

#: Most plaintext bytes one record carries: the channel's chunk (it sends bulk data a chunk per call).
MAX_RECORD = 1 << 20
#: Records sealed under one key before both ends move to the next (at most 64 GiB of data).
REKEY_RECORDS = 1 << 16
_TAG = 16
_LENGTH = struct.Struct(">I")
_NONCE = struct.Struct(">4xQ")
_KEY = 32
#: HKDF's ``info`` of each kind of record: a signed link's keys never equal a sealed link's.
_SEALED_INFO = b"dashrun records v2"


def _aes128_gcm(key: bytes) -> AESGCM:
    """The sealed records' cipher, under the first half of a direction's key: AES-128-GCM is TLS 1.3's mandatory
    suite, with 128-bit security, and cheaper than AES-256-GCM everywhere it was measured (``scripts/bench_mac.py``:
    1.14x on the Intel Xeon build VM, 1.45x on cores without VAES, the same within noise on the AMD EPYC's)."""
    return AESGCM(key[:16])
_SIGNED_INFO = b"dashrun signed records v1"


def _next_key(key: bytes) -> bytes:
    return HKDFExpand(hashes.SHA256(), _KEY, b"dashrun record key update").derive(key)


class _Direction:
    """One direction's key and record number; the key moves on every REKEY_RECORDS records. ``lock`` is held by
    whoever numbers a record, for as long as the record takes to cross (see the module's text)."""

    def __init__(self, key: bytes, aead: Callable[[bytes], AESGCM | ChaCha20Poly1305] = AESGCM):
        self.key = key
        self._make = aead
        self.aead = aead(key)
        self.number = 0
        self.lock = threading.Lock()

    def next(self) -> tuple[AESGCM | ChaCha20Poly1305, bytes]:
        """The cipher and nonce of the next record; only under ``lock``."""
        if not self.lock.locked():
            raise RuntimeError("a record numbered outside its direction's lock")
        sealing = self.aead, _NONCE.pack(self.number)
        self.number += 1
        if self.number % REKEY_RECORDS == 0:
            self.key = _next_key(self.key)
            self.aead = self._make(self.key)
        return sealing


_REFUSED = "a record failed authentication (altered, replayed or reordered on the way): connection dropped"


def _wipe(view: memoryview) -> None:
    """Zero the destination of a record that failed: its bytes are not the sender's."""
    flat = view if view.format == "B" else view.cast("B")
    flat[:] = bytes(len(flat))


class Records:
    """``sendall`` and ``recv_into`` of a socket, in sealed records (see the module's text).

    Threads that send (or receive) at once take turns, a whole ``sendall`` (a ``recv_into``) each. Buffers are made on
    first use and reused: the ciphertext of the largest record seen, and the plaintext of a record
    only partly taken (a frame's header is read before its body).
    """

    #: Whether the records hide their bytes (else they are only signed: :class:`SignedRecords`).
    encrypts = True
    _AEAD: Callable[[bytes], AESGCM | ChaCha20Poly1305] = staticmethod(_aes128_gcm)

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._send = _Direction(send_key, self._AEAD)
        self._recv = _Direction(recv_key, self._AEAD)
        self._out = bytearray()
        self._in = bytearray()
        self._plain = bytearray()
        self._pending = memoryview(self._plain)

    # --- sending --------------------------------------------------------------

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        with self._send.lock:  # numbered, sealed and sent in one piece: never two records under one nonce
            for start in range(0, len(view), MAX_RECORD):
                self._send_record(view[start:start + MAX_RECORD])

    def _send_record(self, piece: memoryview) -> None:
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
        with self._recv.lock:
            return self._recv_into(view, nbytes)

    def _recv_into(self, view: memoryview, nbytes: int) -> int:
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
        """Read the next record's length; 0 at a clean end (the peer closed between records)."""
        head = bytearray(_LENGTH.size)
        if not self._read_exact(memoryview(head), at_boundary=True):
            return 0
        (n,) = _LENGTH.unpack(head)
        if not 0 < n <= MAX_RECORD:
            raise ProtocolError(f"a sealed record of {n} bytes (at most {MAX_RECORD})")
        return n

    def _open(self, n: int, into: memoryview) -> None:
        """Read the rest of the record whose length ``n`` was just read, and its ``n`` plaintext bytes into
        ``into``; raises RecordTagError, ``into`` zeroed, if it fails its tag."""
        if len(self._in) < n + _TAG:
            self._in = bytearray(n + _TAG)
        self._read_exact(memoryview(self._in)[:n + _TAG], at_boundary=False)
        aead, nonce = self._recv.next()
        try:
            aead.decrypt_into(nonce, memoryview(self._in)[:n + _TAG], _LENGTH.pack(n), into)
        except InvalidTag:
            _wipe(into)  # the ciphertext was decrypted into it before the tag was checked
            raise RecordTagError(_REFUSED) from None

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


class SignedRecords(Records):
    """:class:`Records` of a ``--no-tls`` link: the bytes in the clear, each record with its Poly1305 tag
    (see the module's text). Nothing is copied: a record goes out from the caller's buffer and is received
    into the caller's, then checked there; a record only partly taken is held as in :class:`Records`."""

    encrypts = False
    _AEAD = ChaCha20Poly1305
    _HEAD = struct.Struct(f">I{_TAG}s")  # length, tag: read in one call

    def _send_record(self, piece: memoryview) -> None:
        aead, nonce = self._send.next()
        head = self._HEAD.pack(len(piece), aead.encrypt(nonce, b"", piece))  # nothing to encrypt: the tag alone
        sent = self.sock.sendmsg([head, piece])  # one call for both, as a sealed record's one sendall
        if sent < len(head):
            self.sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(piece):
            self.sock.sendall(piece[sent - len(head):])

    def _next_record(self) -> int:
        head = bytearray(self._HEAD.size)
        if not self._read_exact(memoryview(head), at_boundary=True):
            return 0
        n, self._tag = self._HEAD.unpack(head)
        if not 0 < n <= MAX_RECORD:
            raise ProtocolError(f"a signed record of {n} bytes (at most {MAX_RECORD})")
        return n

    def _open(self, n: int, into: memoryview) -> None:
        try:
            self._read_exact(into, at_boundary=False)
            aead, nonce = self._recv.next()
            aead.decrypt(nonce, self._tag, into)
        except InvalidTag:
            _wipe(into)  # received in place, as they came: none of them is the sender's
            raise RecordTagError(_REFUSED) from None
        except BaseException:
            _wipe(into)  # cut short: what came is unchecked
            raise


def after_login(sock: socket.socket, token: bytes, binding: bytes, client_nonce: str, server_nonce: str, *,
                client: bool) -> Records:
    """The records of a logged-in connection, keyed from the login (see the module's text).

    Both ends call it once the login succeeded, the client after it checked WELCOME and the server after
    it sent it. Over TLS (an ``ssl.SSLSocket``) each first sends its ``close_notify`` and waits for the
    other's, and the records are sealed; on a plain socket (``--no-tls``) they are signed. Raises
    UnavailableError if the peer does not answer in time or the connection breaks.
    """
    tls = isinstance(sock, ssl.SSLSocket)
    keys = HKDF(hashes.SHA256(), 2 * _KEY, salt=binding, info=_SEALED_INFO if tls else _SIGNED_INFO).derive(
        token + bytes.fromhex(client_nonce) + bytes.fromhex(server_nonce))
    to_server, to_client = keys[:_KEY], keys[_KEY:]
    kind = Records if tls else SignedRecords
    if tls:
        try:
            sock = sock.unwrap()
        except socket.timeout:
            raise UnavailableError("the peer did not close TLS after the login (timed out)") from None
        except OSError as e:
            raise UnavailableError(f"connection lost closing TLS after the login: "
                                   f"{getattr(e, 'reason', None) or e.strerror or e}") from None
    return kind(sock, to_server, to_client) if client else kind(sock, to_client, to_server)
