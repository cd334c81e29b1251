"""Hostile input against a real dash-memd process, over raw loopback sockets.

Every test starts its own ``dash-memd`` (``memd_factory``), attacks it with
bytes a well-behaved client never sends, and then checks what must still hold:
the attacker was refused (an ERROR frame with the right code, or a closed
connection), nothing was allocated or stored for it, and the daemon still
serves good clients with their data intact.

Frames are built by hand from :mod:`dashrun.wire.protocol` so that lengths,
checksums and kinds can be wrong on purpose, and sent where an attacker's
would arrive: inside TLS, which anyone can open with dash-memd (the token is
checked by the login that follows), or as plain TCP. Nothing here sleeps to
synchronise: every wait is a blocking read or a poll with a deadline.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import select
import socket
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from dashrun.errors import AuthError, BusyError, UnavailableError
from dashrun.util.tokens import write_token
from dashrun.wire import tls
from dashrun.wire.auth import client_handshake
from dashrun.wire.channel import Channel
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import (
    HEADER,
    MAGIC,
    MAX_BODY,
    MAX_BODY_PREAUTH,
    MAX_BYTES,
    TRAILER,
    VERSION,
    Kind,
    crc32c,
    decode_body,
    decode_header,
    encode_body,
    encode_header,
)
from dashrun.wire.sealed import MAX_RECORD

LAYOUT = "ab" * 32
#: Longest any single blocking read of a test may take before the test fails.
IO_TIMEOUT = 10.0
MiB = 1 << 20


# --- helpers -------------------------------------------------------------------------------


def headers(job: str = "j", step: int = 1, world: int = 2, rep_total: int = 4096, tail: int = 64,
            layout: str = LAYOUT) -> list[ShardHeader]:
    """Shard headers of one checkpoint (as in tests/test_catalogue.py)."""
    cut = [rep_total * r // world for r in range(world + 1)]
    return [ShardHeader(job, step, r, world, rep_total, cut[r], cut[r + 1], tail - 16, 16, layout)
            for r in range(world)]


def raw_header(kind: int, body_len: int = 0, data_len: int = 0, body_crc: int = 0, *,
               magic: bytes = MAGIC, version: int = VERSION, flags: int = 0) -> bytes:
    """A 24-byte header with any field set to anything the struct can hold."""
    return HEADER.pack(magic, version, int(kind), flags, body_len, data_len, body_crc)


def frame(kind: Kind, body: dict | None = None, data_len: int = 0) -> bytes:
    """Header and body of a well-formed frame (the data, if any, is the caller's to send)."""
    encoded = encode_body(body)
    return encode_header(kind, encoded, data_len) + encoded


def raw_body_frame(kind: Kind, raw_body: bytes, data_len: int = 0) -> bytes:
    """A frame whose body is arbitrary bytes with a correct body checksum."""
    return raw_header(kind, len(raw_body), data_len, crc32c(raw_body)) + raw_body


def data_with_trailer(data: bytes, crc: int | None = None) -> bytes:
    return data + TRAILER.pack(crc32c(data) if crc is None else crc)


def tls_settings(memd) -> tls.TlsSettings:
    return tls.TlsSettings(plaintext=bool(memd.tls_args))


@contextlib.contextmanager
def raw_conn(memd):
    """A connection to dash-memd opened as a client opens one (TLS unless it runs --no-tls); nothing sent on it."""
    sock = tls.connect(memd.host, memd.port, tls_settings(memd), timeout=IO_TIMEOUT)
    try:
        yield sock
    finally:
        sock.close()


@contextlib.contextmanager
def authed(memd, token: bytes | None = None):
    """A raw Channel that has completed the HMAC handshake."""
    with raw_conn(memd) as sock:
        ch = Channel(sock)
        ch.settimeout(IO_TIMEOUT)
        client_handshake(ch, memd.token if token is None else token)
        yield ch


class _Wire:
    """A logged-in channel's connection as these tests write and read it: frames as bytes, through the sealed
    records that follow a TLS login (or the socket itself with --no-tls)."""

    def __init__(self, ch: Channel):
        self.ch = ch

    @property
    def _stream(self):
        return self.ch._records or self.ch.sock

    def sendall(self, data: bytes) -> None:
        self._stream.sendall(data)

    def recv(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        try:
            got = self._stream.recv_into(memoryview(buf), nbytes)
        except UnavailableError as e:  # cut inside a record: as a reset would read
            raise ConnectionResetError(str(e)) from None
        return bytes(buf[:got])

    def settimeout(self, seconds: float | None) -> None:
        self.ch.sock.settimeout(seconds)


def wire(ch: Channel) -> _Wire:
    return _Wire(ch)


def read_hello(sock: socket.socket) -> dict:
    """Say HELLO as a client does and read dash-memd's: what the connection expects next is AUTH."""
    ch = Channel(sock)
    ch.send(Kind.HELLO, {"nonce": secrets.token_hex(32)})
    hello = ch.recv(max_body=MAX_BODY_PREAUTH)
    assert hello.kind == Kind.HELLO, hello
    return hello.body


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send; False if the server already dropped the connection (a fine outcome for an attack)."""
    try:
        sock.sendall(data)
        return True
    except OSError:  # a broken pipe, a reset, or TLS saying either
        return False


def drain_until_closed(sock: socket.socket, timeout: float = IO_TIMEOUT) -> tuple[bytes, bool]:
    """Everything the server sends until it closes: (bytes, closed). closed is False at the deadline."""
    deadline = time.monotonic() + timeout
    got = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bytes(got), False
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(1 << 16)
        except socket.timeout:
            return bytes(got), False
        except OSError:  # reset: the server closed with our unread bytes in its buffer
            return bytes(got), True
        if not chunk:
            return bytes(got), True
        got += chunk


def parse_frames(data: bytes) -> list[tuple[Kind, dict]]:
    """Split what a server sent into (kind, body) pairs; a trailing partial frame fails the test."""
    frames, pos = [], 0
    while pos < len(data):
        assert len(data) - pos >= HEADER.size, f"partial frame header at the end: {data[pos:]!r}"
        header = decode_header(data[pos:pos + HEADER.size], max_body=MAX_BODY, max_data=MAX_BYTES)
        start = pos + HEADER.size
        frames.append((header.kind, decode_body(header, data[start:start + header.body_len])))
        pos = start + header.body_len + (header.data_len + TRAILER.size if header.data_len else 0)
    assert pos == len(data), "partial frame at the end"
    return frames


def expect_closed_with_error(sock: socket.socket, code: str, *, hello_pending: bool = False,
                             timeout: float = IO_TIMEOUT) -> dict:
    """The server answers ERROR ``code`` and closes the connection. Returns the ERROR body."""
    data, closed = drain_until_closed(sock, timeout)
    assert closed, f"dash-memd left the connection open (received {data[:200]!r})"
    frames = parse_frames(data)
    if hello_pending:
        assert frames and frames[0][0] == Kind.HELLO, frames
        frames = frames[1:]
    assert [kind for kind, _ in frames] == [Kind.ERROR], frames
    assert frames[0][1].get("code") == code, frames
    return frames[0][1]


def expect_closed(sock: socket.socket, *, hello_pending: bool = False, timeout: float = IO_TIMEOUT,
                  what: str = "") -> None:
    """The server closes the connection; whatever it managed to send before is HELLO then at most an ERROR."""
    data, closed = drain_until_closed(sock, timeout)
    assert closed, f"{what}: dash-memd left the connection open (received {data[:200]!r})"
    if not data:
        return  # a reset can discard what was in flight
    frames = parse_frames(data)
    if hello_pending and frames and frames[0][0] == Kind.HELLO:
        frames = frames[1:]
    assert all(kind == Kind.ERROR and body.get("code") == "bad_request" for kind, body in frames), (what, frames)
    assert len(frames) <= 1, (what, frames)


def reply(ch: Channel, max_data: int = 0):
    """The next frame, ERROR included (Channel.expect_reply would raise it)."""
    return ch.recv(max_data=max_data)


def rss(memd) -> int:
    return psutil.Process(memd.proc.pid).memory_info().rss


def used(client: MemdClient) -> int:
    return client.list()["memory"]["used"]


def server_connections(memd) -> int:
    """Established TCP connections the dash-memd process holds on its listening port."""
    conns = psutil.Process(memd.proc.pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == memd.port)


def assert_healthy(memd) -> None:
    """Alive, serving a good client, and no handler crashed with an unexpected exception."""
    assert memd.proc.poll() is None, f"dash-memd died: {memd.log()[-3000:]}"
    with memd.client(timeout=IO_TIMEOUT) as client:
        assert client.ping()["pid"] == memd.proc.pid
    log = memd.log()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


def store(client: MemdClient, job: str, step: int, world: int = 2, rep_total: int = 4096,
          tail: int = 64, seed: int = 0) -> dict[int, bytes]:
    """Store a whole checkpoint through the real client; returns each rank's bytes."""
    rng = random.Random(f"{job}/{step}/{seed}")
    payloads = {}
    for header in headers(job, step, world, rep_total, tail):
        payload = rng.randbytes(header.nbytes)
        payloads[header.rank] = payload
        client.put_shard(header, [payload])
    return payloads


def read_back(client: MemdClient, job: str, step: int, world: int) -> dict[int, bytes]:
    info = client.latest(job, step)
    assert info is not None and info.world == world
    out = {}
    for shard in info.shards:
        buf = bytearray(shard.nbytes)
        crc = client.get_shard_into(job, step, shard.rank, [memoryview(buf)])
        assert crc == shard.crc == crc32c(buf)
        out[shard.rank] = bytes(buf)
    return out


def manifest(memd, job: str, step: int) -> Path:
    return memd.data_dir / "jobs" / job / f"{step:016d}" / "MANIFEST.json"


def put_truncated_shard(memd, header: ShardHeader, cut_at: int, *, may_conflict: bool = False) -> None:
    """Announce a shard, have it accepted, send the first ``cut_at`` bytes of SHARD_DATA (framing included), close.

    ``may_conflict``: dash-memd may also refuse the shard as a conflict with what it holds (then nothing is sent).
    """
    payload = random.Random(cut_at).randbytes(header.nbytes)
    whole = frame(Kind.SHARD_DATA, {}, header.nbytes) + data_with_trailer(payload)
    assert 0 <= cut_at < len(whole)
    with authed(memd) as ch:
        ch.send(Kind.PUT_SHARD, header.to_body())
        answer = reply(ch)
        if may_conflict and answer.kind == Kind.ERROR and answer.body.get("code") == "conflict":
            return
        assert answer.kind == Kind.OK, answer
        wire(ch).sendall(whole[:cut_at])
    # closed here, mid-frame


# --- 1. authentication ---------------------------------------------------------------------


class RecordingSocket:
    """A socket that keeps a copy of every byte sent and received through it."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.sent = bytearray()
        self.received = bytearray()

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendall(self, data, *args):
        self.sent += bytes(memoryview(data).cast("B"))
        return self._sock.sendall(data, *args)

    def send(self, data, *args):
        n = self._sock.send(data, *args)
        self.sent += bytes(memoryview(data).cast("B")[:n])
        return n

    def sendmsg(self, buffers, *args):
        n = self._sock.sendmsg(buffers, *args)
        self.sent += b"".join(bytes(b) for b in buffers)[:n]
        return n

    def recv_into(self, buffer, nbytes=0, *args):
        n = self._sock.recv_into(buffer, nbytes, *args)
        self.received += bytes(memoryview(buffer)[:n])
        return n

    def recv(self, bufsize, *args):
        data = self._sock.recv(bufsize, *args)
        self.received += data
        return data


def assert_token_absent(token: bytes, wire: bytes) -> None:
    assert wire, "nothing was recorded"
    assert token not in wire
    forms = [token, token.hex().encode()]
    with contextlib.suppress(ValueError):
        forms.append(bytes.fromhex(token.decode()))
    for form in forms:
        # not even a 12-byte piece of it, in any encoding we can think of
        for start in range(0, len(form) - 11):
            piece = form[start:start + 12]
            assert piece not in wire, f"a piece of the token crossed the wire: {piece!r}"


def test_wrong_token_is_refused_and_the_token_never_crosses_the_wire(memd_factory, tmp_path, monkeypatch):
    # In plaintext, so that what the login itself sends can be read (under TLS nothing at all can be).
    memd = memd_factory("--memory-limit", "64MiB", "--no-tls")
    other = write_token(tmp_path / "other-token")
    assert other != memd.token

    # A real client holding another cluster's token.
    with MemdClient(memd.host, memd.port, other, timeout=IO_TIMEOUT, tls=tls_settings(memd)) as intruder:
        with pytest.raises(AuthError):
            intruder.ping()
        with pytest.raises(AuthError):  # and again on a fresh connection: still refused
            intruder.list()

    # A raw AUTH with a made-up mac: ERROR unauthorized, then the connection is closed.
    with raw_conn(memd) as sock:
        read_hello(sock)
        sock.sendall(frame(Kind.AUTH, {"nonce": "00" * 32, "mac": "0" * 64}))
        expect_closed_with_error(sock, "unauthorized")

    # A recorded login replayed byte for byte (HELLO, then an AUTH right for the nonce of that time) is refused.
    recorded = RecordingSocket(socket.create_connection((memd.host, memd.port), timeout=IO_TIMEOUT))
    try:
        client_handshake(Channel(recorded), memd.token)
        valid_login = bytes(recorded.sent)
    finally:
        recorded.close()
    assert [kind for kind, _ in parse_frames(valid_login)] == [Kind.HELLO, Kind.AUTH]
    with raw_conn(memd) as sock:
        sock.sendall(valid_login)
        expect_closed_with_error(sock, "unauthorized", hello_pending=True)

    # Skipping AUTH: a request before authenticating is refused, and nothing is answered for it.
    with raw_conn(memd) as sock:
        read_hello(sock)
        sock.sendall(frame(Kind.LIST))
        data, closed = drain_until_closed(sock)
        assert closed
        assert all(kind == Kind.ERROR for kind, _ in parse_frames(data))

    # What a successful real client sends (and receives) never contains the token: challenge-response.
    recordings: list[RecordingSocket] = []
    real_connect = socket.create_connection

    def recording_connect(*args, **kwargs):
        recordings.append(RecordingSocket(real_connect(*args, **kwargs)))
        return recordings[-1]

    with monkeypatch.context() as patch:
        patch.setattr(socket, "create_connection", recording_connect)
        with memd.client(timeout=IO_TIMEOUT) as client:
            assert client.ping()["pid"] == memd.proc.pid
            assert client.latest("nobody") is None
    assert len(recordings) == 1
    assert_token_absent(memd.token, bytes(recordings[0].sent))
    assert_token_absent(memd.token, bytes(recordings[0].received))
    assert_healthy(memd)


def test_non_ascii_mac_is_refused_as_unauthorized(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB")
    for mac in ("é" * 32, "\u0100", "０" * 64):
        with raw_conn(memd) as sock:
            read_hello(sock)
            sock.sendall(frame(Kind.AUTH, {"nonce": "00" * 32, "mac": mac}))
            data, closed = drain_until_closed(sock)
            assert closed
            frames = parse_frames(data)
            assert [kind for kind, _ in frames] == [Kind.ERROR], frames
            assert frames[0][1].get("code") in ("unauthorized", "bad_request"), frames
    assert_healthy(memd)  # includes: no "internal error" and no traceback in the daemon's log


# --- 2. garbage instead of frames -------------------------------------------------------------


def tls_client_hello(rng: random.Random) -> bytes:
    """Bytes shaped like a TLS 1.2/1.3 ClientHello record."""
    hello = (b"\x03\x03" + rng.randbytes(32) + b"\x20" + rng.randbytes(32)
             + b"\x00\x08\x13\x01\x13\x02\xc0\x2b\xc0\x2f" + b"\x01\x00"
             + b"\x00\x1c" + b"\x00\x00\x00\x0e\x00\x0c\x00\x00\x09localhost"
             + b"\x00\x0d\x00\x06\x00\x04\x04\x03\x08\x04")
    handshake = b"\x01" + len(hello).to_bytes(3, "big") + hello
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


GARBAGE = {
    "random": random.Random(1).randbytes(64 << 10),
    "http": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n",
    "http-post": (b"POST /v1/checkpoints HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
                  + b"A" * 4096),
    "tls": tls_client_hello(random.Random(2)),
    "ssh": b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n" + bytes(64),
    "zeros": bytes(4096),
    "wrong-version": raw_header(Kind.AUTH, version=99),
    "unknown-kind": raw_header(250),
    "reserved-flags": raw_header(Kind.AUTH, flags=1),
    "bad-body-crc": raw_header(Kind.AUTH, 2, 0, 12345) + b"{}",
    "body-not-json": raw_body_frame(Kind.AUTH, b"\xff\xfe not json"),
    "body-not-object": raw_body_frame(Kind.AUTH, b"[1,2,3]"),
    "body-nan": raw_body_frame(Kind.AUTH, b'{"nonce": NaN}'),
    "body-nested": raw_body_frame(Kind.AUTH, b"[" * 2000 + b"]" * 2000),
}


def test_garbage_instead_of_frames_closes_the_connection(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB")
    for name, garbage in GARBAGE.items():
        # Before authenticating.
        with raw_conn(memd) as sock:
            read_hello(sock)
            send_quietly(sock, garbage)
            expect_closed(sock, what=f"{name} before AUTH")

        # In place of the client's HELLO.
        with raw_conn(memd) as sock:
            send_quietly(sock, garbage)
            expect_closed(sock, what=f"{name} in place of HELLO")

        # After authenticating: the stream is out of step, so the connection goes.
        with authed(memd) as ch:
            send_quietly(wire(ch), garbage)
            expect_closed(wire(ch), what=f"{name} after AUTH")

        # Beneath the sealed records that follow the login (someone on the path, without their keys): the
        # connection goes at the first record, whatever length the garbage claims.
        with authed(memd) as ch:
            send_quietly(ch.sock, garbage + bytes(MAX_RECORD + 20))
            assert drain_until_closed(ch.sock)[1], f"{name} beneath the records: dash-memd left the connection open"

        # As plain TCP where dash-memd speaks TLS: refused by its first byte (a TLS record's is 0x16).
        if garbage[0] != 0x16:
            with socket.create_connection((memd.host, memd.port), timeout=IO_TIMEOUT) as sock:
                send_quietly(sock, garbage)
                assert drain_until_closed(sock)[1], f"{name} over plain TCP: dash-memd left the connection open"

        # And the daemon still serves a good client.
        with memd.client(timeout=IO_TIMEOUT) as client:
            assert client.ping()["pid"] == memd.proc.pid, name
    assert_healthy(memd)


def test_deeply_nested_json_after_auth_is_refused(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB")
    bomb = b"[" * (1 << 20) + b"]" * (1 << 20)  # 2 MiB, under MAX_BODY: the parser must not crash the daemon
    with authed(memd) as ch:
        wire(ch).sendall(raw_body_frame(Kind.PING, bomb))
        expect_closed_with_error(wire(ch), "bad_request")
    assert_healthy(memd)


@pytest.mark.parametrize("plaintext", [False, True], ids=["tls", "no-tls"])
def test_nested_brackets_before_the_login_are_refused_and_dash_memd_lives_on(memd_factory, plaintext):
    """4 KiB of ``[`` from someone without the token, in place of HELLO and of AUTH.

    Before JSON nesting was bounded, the parser recursed into it on a connection thread's 512 KiB stack:
    Python 3.13 died of SIGSEGV (every checkpoint held only in RAM gone), 3.11 raised RecursionError.
    """
    memd = memd_factory("--memory-limit", "64MiB", *(["--no-tls"] if plaintext else []))
    bomb = b"[" * MAX_BODY_PREAUTH
    for kind in (Kind.HELLO, Kind.AUTH):
        with raw_conn(memd) as sock:
            if kind == Kind.AUTH:
                read_hello(sock)
            sock.sendall(raw_body_frame(kind, bomb))
            refused = expect_closed_with_error(sock, "bad_request")
            assert "deeper than 64 levels" in refused["message"], refused
        assert memd.proc.poll() is None, f"dash-memd died ({memd.proc.returncode}): {memd.log()[-2000:]}"
        with memd.client(timeout=IO_TIMEOUT) as client:  # and serves the next client
            assert client.ping()["pid"] == memd.proc.pid
    assert_healthy(memd)


# --- 3. absurd lengths ------------------------------------------------------------------------


FOUR_GIB = 0xFFFFFFFF  # the largest body_len a header can carry
PIB = 1 << 50

PREAUTH_ABSURD = {
    "4GiB-body": raw_header(Kind.AUTH, FOUR_GIB),
    "body-over-preauth-limit": raw_header(Kind.AUTH, MAX_BODY_PREAUTH + 1),
    "1PiB-data": raw_header(Kind.AUTH, 0, PIB, crc32c(b"")),
    "2^64-data": raw_header(Kind.AUTH, 0, (1 << 64) - 1, crc32c(b"")),
}

POSTAUTH_ABSURD = {
    "4GiB-body": raw_header(Kind.PING, FOUR_GIB),
    "body-over-limit": raw_header(Kind.PUT_SHARD, MAX_BODY + 1),
    "1PiB-data-on-ping": raw_header(Kind.PING, 2, PIB, crc32c(b"{}")) + b"{}",
    "2^64-data-on-list": raw_header(Kind.LIST, 2, (1 << 64) - 1, crc32c(b"{}")) + b"{}",
    "private_len-2^60": frame(Kind.PUT_SHARD, {**headers("big", world=1)[0].to_body(), "private_len": 1 << 60}),
    "rank-2^40": frame(Kind.GET_SHARD, {"job": "big", "step": 1, "rank": 1 << 40}),
    "committed_at-1e300": frame(Kind.GET_SHARD, {"job": "big", "step": 1, "rank": 0, "committed_at": 1e300}),
    "step-2^63": frame(Kind.LATEST, {"job": "big", "step": 1 << 63}),
    "wait-1e300": frame(Kind.WAIT, {"job": "big", "step": 1, "timeout": 1e300}),
    "int-of-5000-digits": raw_body_frame(Kind.LATEST, b'{"job":"big","step":' + b"9" * 5000 + b"}"),
}


def test_absurd_lengths_are_refused_without_allocating(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB")
    with memd.client(timeout=IO_TIMEOUT) as client:
        client.ping()
        base_used = used(client)
    base_rss = rss(memd)

    for _ in range(5):  # repeated, so that a leak of even a fraction of what was announced would show
        for name, raw in PREAUTH_ABSURD.items():
            with raw_conn(memd) as sock:
                read_hello(sock)
                sock.sendall(raw)
                body = expect_closed_with_error(sock, "bad_request")
                assert body.get("message"), name
        for name, raw in POSTAUTH_ABSURD.items():
            with authed(memd) as ch:
                wire(ch).sendall(raw)
                expect_closed_with_error(wire(ch), "bad_request")

        with authed(memd) as ch:
            # A whole shard of 1 PiB is a valid request, but it cannot fit: refused, the connection stays usable.
            huge = ShardHeader("big", 1, 0, 1, PIB, 0, PIB, 0, 0, LAYOUT)
            ch.send(Kind.PUT_SHARD, huge.to_body())
            refused = reply(ch)
            assert refused.kind == Kind.ERROR and refused.body["code"] == "no_space", refused
            ch.send(Kind.PING)
            assert reply(ch).kind == Kind.OK

            # A shard that fits, accepted; then its SHARD_DATA announces 1 PiB instead of the shard's size.
            small = headers("big", world=1, rep_total=1 * MiB)[0]
            ch.send(Kind.PUT_SHARD, small.to_body())
            assert reply(ch).kind == Kind.OK
            wire(ch).sendall(frame(Kind.SHARD_DATA, {}, PIB))
            expect_closed_with_error(wire(ch), "bad_request")

    with memd.client(timeout=IO_TIMEOUT) as client:
        wait_for(lambda: used(client) == base_used, 10, "the refused shard's RAM to be released")
        assert client.latest("big") is None
    growth = rss(memd) - base_rss
    assert growth < 32 * MiB, f"dash-memd grew by {growth / MiB:.1f} MiB answering absurd lengths"
    assert_healthy(memd)


# --- 4. truncated frames ----------------------------------------------------------------------


def test_truncated_frames_leave_nothing_behind(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB")
    client = memd.client(timeout=IO_TIMEOUT)
    try:
        base_used = used(client)
        auth = frame(Kind.AUTH, {"nonce": "11" * 32, "mac": "22" * 32})

        # Before authenticating: the header cut short, then the body cut short.
        for cut in (1, 10, HEADER.size - 1, HEADER.size + 5, len(auth) - 1):
            with raw_conn(memd) as sock:
                read_hello(sock)
                sock.sendall(auth[:cut])
            client.ping()

        # After authenticating: a request's header cut short, its body cut short.
        latest = frame(Kind.LATEST, {"job": "cut", "step": 1})
        for cut in (1, HEADER.size - 1, HEADER.size + 3, len(latest) - 1):
            with authed(memd) as ch:
                wire(ch).sendall(latest[:cut])
            client.ping()

        # A shard accepted, then its SHARD_DATA cut off: in the header, in the data, in the trailer.
        header = headers("cut", step=1, world=1, rep_total=2 * MiB)[0]
        data_start = len(frame(Kind.SHARD_DATA, {}, header.nbytes))
        for cut in (0, 7, data_start, data_start + 1, data_start + header.nbytes // 2,
                    data_start + header.nbytes, data_start + header.nbytes + 3):
            put_truncated_shard(memd, header, cut)
            wait_for(lambda: used(client) == base_used, 10, f"RAM to be released after a cut at {cut}")
            assert client.latest("cut") is None, f"a shard cut at byte {cut} was committed"

        # Two ranks: rank 0 arrives whole, rank 1 is cut off: the checkpoint is not committed.
        rank0, rank1 = headers("cut2", step=3, world=2, rep_total=1 * MiB)
        client.put_shard(rank0, [bytes(rank0.nbytes)])
        put_truncated_shard(memd, rank1, data_start + rank1.nbytes // 2)
        assert client.latest("cut2") is None
        assert not client.wait("cut2", 3, timeout=0.0)
        assert "cut2" not in {j["job"] for j in client.list()["jobs"]}
    finally:
        client.close()
    assert not (memd.data_dir / "jobs" / "cut").exists()
    assert not (memd.data_dir / "jobs" / "cut2").exists()
    assert_healthy(memd)


# --- 5. hostile job ids -----------------------------------------------------------------------


ESCAPE_NAME = f"dashrun-hostile-{uuid.uuid4().hex[:12]}"
HOSTILE_JOBS = [
    "../x", "..", ".", "a/b", "", "x" * 129, "/etc", f"/tmp/{ESCAPE_NAME}", f"../../{ESCAPE_NAME}",
    f"../../../../../../../../tmp/{ESCAPE_NAME}", "a\x00b", "job\n", "-x", ".hidden", "a\\b", "é",
    5, None, True, 1.5, ["a"], {"a": 1},
]


def hostile_requests(job) -> dict[str, dict]:
    shard = {**headers("placeholder", world=1)[0].to_body(), "job": job}
    return {
        "PUT_SHARD": (Kind.PUT_SHARD, shard),
        "LATEST": (Kind.LATEST, {"job": job}),
        "GET_SHARD": (Kind.GET_SHARD, {"job": job, "step": 1, "rank": 0}),
        "WAIT": (Kind.WAIT, {"job": job, "step": 1, "timeout": 0.0}),
    }


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_hostile_job_ids_are_refused_and_create_nothing(memd_factory, tmp_path):
    memd = memd_factory("--memory-limit", "64MiB")
    outside_before = {p for p in tree(tmp_path) if not p.startswith(memd.data_dir.name) and not p.endswith(".log")}
    assert tree(memd.data_dir) == {"jobs", "LOCK", "ID", "tls-identity.pem"}

    for job in HOSTILE_JOBS:
        for name, (kind, body) in hostile_requests(job).items():
            with authed(memd) as ch:
                ch.send(kind, body)
                answer = reply(ch)
                if kind == Kind.PUT_SHARD and answer.kind == Kind.OK:
                    # accepted (a bug): complete it so that the damage, if any, reaches the disk
                    shard = headers("placeholder", world=1)[0]
                    ch.send(Kind.SHARD_DATA, {}, data=[bytes(shard.nbytes)])
                    answer = reply(ch)
                assert answer.kind == Kind.ERROR and answer.body.get("code") == "bad_request", \
                    f"{name} with job {job!r} was answered {answer.kind.name} {answer.body}"

    # Sync with the disk writer without sleeping: it works in commit order, so once a valid
    # checkpoint committed after the attacks is on disk, anything committed before it would be too.
    longest = "a" * 128
    with memd.client(timeout=IO_TIMEOUT) as client:
        store(client, longest, 1, world=1)
        assert client.latest(longest).step == 1
    wait_for(lambda: manifest(memd, longest, 1).exists(), 15, "the valid checkpoint to reach the disk")

    assert tree(memd.data_dir) == {"LOCK", "ID", "tls-identity.pem", "jobs", f"jobs/{longest}",
                                   f"jobs/{longest}/{1:016d}", f"jobs/{longest}/{1:016d}/MANIFEST.json",
                                   f"jobs/{longest}/{1:016d}/rank-00000.bin"}
    outside_after = {p for p in tree(tmp_path) if not p.startswith(memd.data_dir.name) and not p.endswith(".log")}
    assert outside_after == outside_before
    assert not Path("/tmp", ESCAPE_NAME).exists()
    assert not Path("/etc", "placeholder").exists()
    assert_healthy(memd)


# --- 6. idle connections: a budget of their own ----------------------------------------------------


def open_idle(memd, count: int) -> list[socket.socket]:
    """Open ``count`` plain TCP connections that send nothing, not even a TLS ClientHello (the cheapest attack).

    One at a time: each connect returns once the kernel queued the connection for dash-memd to accept, in order.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection((memd.host, memd.port), timeout=IO_TIMEOUT))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def wait_all_closed(socks: list[socket.socket], timeout: float) -> dict[socket.socket, bytes]:
    """Read every socket until the server closes it; fail at the deadline. Returns what each received."""
    received = {s: bytearray() for s in socks}
    open_ = set(socks)
    for sock in socks:
        sock.setblocking(False)
    deadline = time.monotonic() + timeout
    while open_:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{len(open_)} of {len(socks)} idle connections were not closed by dash-memd"
        readable, _, _ = select.select(list(open_), [], [], min(remaining, 1.0))
        for sock in readable:
            try:
                chunk = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                received[sock] += chunk
            else:
                open_.discard(sock)
    return {s: bytes(b) for s, b in received.items()}


def still_open(sock: socket.socket) -> bool:
    """Nothing to read and no end of stream: dash-memd still holds the connection."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


@pytest.mark.slow
def test_a_shard_whose_notes_for_the_run_history_are_malformed_is_refused_before_it_is_taken(memd_factory):
    """How the rank's run began and the node's failure domain ride on PUT_SHARD: checked before the shard is
    accepted, so a bad one never leaves a stored shard behind a connection closed after its reply."""
    memd = memd_factory("--memory-limit", "64MiB")
    header = headers("notes", 1, world=1)[0]
    for bad in ({"restored": "yesterday"}, {"restored": {"step": 2 ** 70}}, {"domain": 7},
                {"domain": {"zone": "z" * 100_000}}, {"domain": {"market": ["spot"]}}):
        with authed(memd) as ch:
            ch.send(Kind.PUT_SHARD, {**header.to_body(), "node": "n1", **bad})
            expect_closed_with_error(wire(ch), "bad_request")
    with memd.client(timeout=IO_TIMEOUT) as client:
        assert client.latest("notes") is None
        payload = random.Random(7).randbytes(header.nbytes)
        client.put_shard(header, [payload])  # the same shard, well formed, is taken
        assert read_back(client, "notes", 1, 1) == {0: payload}
    assert_healthy(memd)


def test_hundreds_of_idle_connections_time_out_and_do_not_block_good_clients(memd_factory):
    auth_timeout = 5.0  # long enough for 300 connects and a client on a loaded machine
    memd = memd_factory("--memory-limit", "64MiB", "--auth-timeout", str(auth_timeout),
                        "--max-connections", "400", "--max-unauthenticated", "400")
    proc = psutil.Process(memd.proc.pid)
    with memd.client(timeout=IO_TIMEOUT) as client:
        client.ping()
    base_rss, base_threads = rss(memd), proc.num_threads()

    socks = open_idle(memd, 300)
    try:
        wait_for(lambda: server_connections(memd) >= 300, auth_timeout, "dash-memd to accept the idle connections")
        opened = time.monotonic()
        # A good client is served while all of them are held open.
        with memd.client(timeout=IO_TIMEOUT) as client:
            assert client.ping()["pid"] == memd.proc.pid
            payloads = store(client, "busy-day", 1)
            assert read_back(client, "busy-day", 1, 2) == payloads
        held, threads = server_connections(memd), proc.num_threads()
        still = sum(still_open(sock) for sock in socks)  # none closed by its auth timeout yet: served meanwhile
        assert held >= 300 and still == len(socks), \
            f"the idle connections were not all open while the good client ran ({held} held, {still} open)"
        assert threads > 300  # a thread each: they really were being served, not left in the backlog
        growth = rss(memd) - base_rss
        assert growth < 64 * MiB, f"300 idle connections cost dash-memd {growth / MiB:.1f} MiB"

        # The server closes each of them once the auth timeout passes, saying nothing.
        received = wait_all_closed(socks, auth_timeout + 20)
        assert time.monotonic() - opened >= auth_timeout * 0.9  # and not before the timeout
        assert set(received.values()) == {b""}
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: server_connections(memd) == 0, 10, "dash-memd to drop the idle connections")
    wait_for(lambda: proc.num_threads() <= base_threads + 5, 10, "the connection threads to end")
    assert_healthy(memd)


def test_connections_that_never_log_in_cannot_keep_clients_out(memd_factory):
    """They count against --max-unauthenticated, not --max-connections; beyond it the oldest is dropped."""
    limit, budget, idle = 8, 4, 40
    memd = memd_factory("--memory-limit", "64MiB", "--auth-timeout", "120", "--max-connections", str(limit),
                        "--max-unauthenticated", str(budget))
    proc = psutil.Process(memd.proc.pid)
    base_threads = proc.num_threads()
    socks = open_idle(memd, idle)  # five times as many as there are client slots
    try:
        # Long before the auth timeout, every one but the newest few was dropped, saying nothing...
        dropped = wait_all_closed(socks[:idle - budget], IO_TIMEOUT)
        assert set(dropped.values()) == {b""}
        assert all(still_open(sock) for sock in socks[idle - budget:])  # ...and those few are still waited for
        assert proc.num_threads() <= base_threads + budget + 2  # no thread left behind for the dropped ones

        # A client with the token gets in at once, and is served in full.
        with memd.client(timeout=IO_TIMEOUT) as client:
            assert client.ping()["pid"] == memd.proc.pid
            payloads = store(client, "still-served", 1)
            assert read_back(client, "still-served", 1, 2) == payloads
        # It took the place of the oldest connection still waiting to log in.
        wait_all_closed(socks[idle - budget:idle - budget + 1], IO_TIMEOUT)
        assert all(still_open(sock) for sock in socks[idle - budget + 1:])
    finally:
        for sock in socks:
            sock.close()
    assert_healthy(memd)


def test_clients_beyond_the_maximum_are_told_busy_when_they_log_in(memd_factory):
    limit = 3
    memd = memd_factory("--memory-limit", "64MiB", "--max-connections", str(limit))
    clients = [memd.client(timeout=IO_TIMEOUT) for _ in range(limit)]
    try:
        for client in clients:
            assert client.ping()["pid"] == memd.proc.pid  # logged in, and holding its connection
        with memd.client(timeout=IO_TIMEOUT) as extra:
            with pytest.raises(BusyError, match=f"maximum of {limit} clients"):
                extra.ping()
        # Idle connections do not count: the slots are the logged-in clients', and one leaving frees one.
        socks = open_idle(memd, 2 * limit)
        try:
            clients.pop().close()

            def served() -> bool:
                with memd.client(timeout=IO_TIMEOUT) as client:
                    try:
                        return client.ping()["pid"] == memd.proc.pid
                    except BusyError:
                        return False
            wait_for(served, IO_TIMEOUT, "the slot of the client that left")
        finally:
            for sock in socks:
                sock.close()
    finally:
        for client in clients:
            client.close()
    assert_healthy(memd)


def test_trickling_bytes_does_not_extend_the_auth_timeout(memd_factory):
    auth_timeout = 1.0
    memd = memd_factory("--memory-limit", "64MiB", "--auth-timeout", str(auth_timeout))
    auth = frame(Kind.AUTH, {"nonce": "11" * 32, "mac": "22" * 32})
    with raw_conn(memd) as sock:
        read_hello(sock)
        # Never the last byte (the frame is never complete), one each auth_timeout / 3: the trickle lasts far
        # longer than the auth timeout, so only the login's own deadline ends it before the bytes run out.
        assert (len(auth) - 1) * auth_timeout / 3 > 10 * auth_timeout
        started, closed_after, sent = time.monotonic(), None, 0
        for byte in auth[:-1]:
            if not send_quietly(sock, bytes([byte])):
                closed_after = time.monotonic() - started
                break
            sent += 1
            # Wait for the next trickle on the socket itself: readable means the server gave up.
            readable, _, _ = select.select([sock], [], [], auth_timeout / 3)
            if readable:
                data, closed = drain_until_closed(sock, IO_TIMEOUT)
                assert closed
                closed_after = time.monotonic() - started
                break
        assert closed_after is not None and sent < len(auth) - 1, \
            f"an unauthenticated connection trickling bytes was held for all {sent} of them " \
            f"(--auth-timeout {auth_timeout:.0f})"
        assert closed_after >= auth_timeout * 0.9, closed_after  # at its deadline, not before
    assert_healthy(memd)


# --- 7. stored data survives all of it ------------------------------------------------------------


def test_stored_checkpoint_survives_every_attack(memd_factory, tmp_path):
    memd = memd_factory("--memory-limit", "64MiB")
    job, step = "precious", 5
    with memd.client(timeout=IO_TIMEOUT) as client:
        payloads = store(client, job, step, world=2, rep_total=6 * MiB, tail=4096)
        info_before = client.latest(job)
        assert info_before is not None and info_before.step == step

    # Wrong token.
    with MemdClient(memd.host, memd.port, write_token(tmp_path / "intruder"), timeout=IO_TIMEOUT,
                   tls=tls_settings(memd)) as intruder:
        with pytest.raises(AuthError):
            intruder.ping()
    # Garbage, before and after authentication.
    for garbage in GARBAGE.values():
        with raw_conn(memd) as sock:
            send_quietly(sock, garbage)
            expect_closed(sock, hello_pending=True)
        with authed(memd) as ch:
            send_quietly(wire(ch), garbage)
            expect_closed(wire(ch))
    # Absurd lengths.
    for raw in PREAUTH_ABSURD.values():
        with raw_conn(memd) as sock:
            read_hello(sock)
            sock.sendall(raw)
            expect_closed_with_error(sock, "bad_request")
    for raw in POSTAUTH_ABSURD.values():
        with authed(memd) as ch:
            wire(ch).sendall(raw)
            expect_closed_with_error(wire(ch), "bad_request")
    # Hostile job ids.
    for bad in ("../precious", "precious/../precious", "", "x" * 129, None):
        with authed(memd) as ch:
            ch.send(Kind.LATEST, {"job": bad})
            expect_closed_with_error(wire(ch), "bad_request")
    # Attempts at the very same job and step: cut off, with a bad checksum, with another layout (dash-memd may
    # take such a new attempt, or refuse it as a conflict with what it committed: either way its copy stays).
    replacement = ShardHeader(job, step, 0, 1, 1 * MiB, 0, 1 * MiB, 0, 0, "cd" * 32)
    data_start = len(frame(Kind.SHARD_DATA, {}, replacement.nbytes))
    put_truncated_shard(memd, replacement, data_start + replacement.nbytes // 2, may_conflict=True)
    put_truncated_shard(memd, replacement, data_start + replacement.nbytes + 2, may_conflict=True)
    with authed(memd) as ch:
        ch.send(Kind.PUT_SHARD, replacement.to_body())
        answer = reply(ch)
        if answer.kind == Kind.OK:
            forged = bytes(replacement.nbytes)
            wire(ch).sendall(frame(Kind.SHARD_DATA, {}, len(forged)) + data_with_trailer(forged, crc32c(forged) ^ 1))
            answer = reply(ch)
            assert answer.kind == Kind.ERROR and answer.body["code"] == "checksum", answer
        else:
            assert answer.kind == Kind.ERROR and answer.body["code"] == "conflict", answer
    # A newer step cut off, and a rank's shard of the same step again (refused: that step is committed).
    put_truncated_shard(memd, headers(job, step + 1, 2, 6 * MiB, 4096)[1], 100)
    with authed(memd) as ch:
        ch.send(Kind.PUT_SHARD, headers(job, step, 2, 6 * MiB, 4096)[0].to_body())
        answer = reply(ch)
        assert answer.kind == Kind.ERROR and answer.body["code"] == "conflict", answer
    # Reads of things that do not exist, and a read abandoned half-way.
    with authed(memd) as ch:
        ch.send(Kind.GET_SHARD, {"job": job, "step": step, "rank": 2})
        assert reply(ch).body.get("code") == "not_found"
        ch.send(Kind.GET_SHARD, {"job": job, "step": step - 1, "rank": 0})
        assert reply(ch).body.get("code") == "not_found"
        ch.send(Kind.GET_SHARD, {"job": job, "step": step, "rank": 1})
        got = reply(ch, max_data=MAX_BYTES)
        assert got.kind == Kind.OK and got.data_len == len(payloads[1])
        wire(ch).recv(1000)
    # closed with most of the shard unread

    with memd.client(timeout=IO_TIMEOUT) as client:
        info_after = client.latest(job)
        assert info_after == info_before
        assert read_back(client, job, step, 2) == payloads
    wait_for(lambda: manifest(memd, job, step).exists(), 15, "the checkpoint to reach the disk")
    assert_healthy(memd)

    # And what reached the disk is intact too: a new dash-memd on the same data dir serves it.
    assert memd.stop() == 0
    again = memd_factory("--memory-limit", "64MiB", data_dir=memd.data_dir)
    with again.client(timeout=IO_TIMEOUT) as client:
        assert client.latest(job).step == step
        assert read_back(client, job, step, 2) == payloads
    assert_healthy(again)


# --- 8. a bad checksum on SHARD_DATA ---------------------------------------------------------------


def test_bad_data_checksum_is_refused_and_the_connection_stays_usable(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB")
    header = headers("crc", step=1, world=1, rep_total=1 * MiB)[0]
    payload = random.Random(8).randbytes(header.nbytes)
    with memd.client(timeout=IO_TIMEOUT) as client:
        base_used = used(client)

    with authed(memd) as ch:
        for wrong in (crc32c(payload) ^ 1, 0, 0xFFFFFFFF):
            if wrong == crc32c(payload):
                continue
            ch.send(Kind.PUT_SHARD, header.to_body())
            assert reply(ch).kind == Kind.OK
            wire(ch).sendall(frame(Kind.SHARD_DATA, {}, len(payload)) + data_with_trailer(payload, wrong))
            answer = reply(ch)
            assert answer.kind == Kind.ERROR and answer.body.get("code") == "checksum", answer
            # Same connection, still in step.
            ch.send(Kind.PING)
            pong = reply(ch)
            assert pong.kind == Kind.OK and pong.body["pid"] == memd.proc.pid
            ch.send(Kind.LATEST, {"job": "crc"})
            assert reply(ch).body == {"checkpoint": None}
            ch.send(Kind.LIST)
            listing = reply(ch).body
            assert listing["memory"]["used"] == base_used
            assert "crc" not in {j["job"] for j in listing["jobs"]}

        # Bytes corrupted in transit (right trailer for other bytes) are caught the same way.
        corrupted = bytearray(payload)
        corrupted[len(corrupted) // 2] ^= 0x40
        ch.send(Kind.PUT_SHARD, header.to_body())
        assert reply(ch).kind == Kind.OK
        wire(ch).sendall(frame(Kind.SHARD_DATA, {}, len(payload)) + bytes(corrupted) + TRAILER.pack(crc32c(payload)))
        answer = reply(ch)
        assert answer.kind == Kind.ERROR and answer.body.get("code") == "checksum", answer

        # The right bytes on the same connection are then stored.
        ch.send(Kind.PUT_SHARD, header.to_body())
        assert reply(ch).kind == Kind.OK
        wire(ch).sendall(frame(Kind.SHARD_DATA, {}, len(payload)) + data_with_trailer(payload))
        stored = reply(ch)
        assert stored.kind == Kind.OK and stored.body == {"committed": True, "crc": crc32c(payload)}

    with memd.client(timeout=IO_TIMEOUT) as client:
        assert read_back(client, "crc", 1, 1) == {0: payload}
    assert_healthy(memd)
