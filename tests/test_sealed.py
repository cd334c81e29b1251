"""The records a TCP link goes on in after its login (dashrun/wire/sealed.py), on real sockets.

Two channels on a socket pair exchange frames through :class:`Records` (sealed,
after a TLS login) or :class:`SignedRecords` (``--no-tls``); a raw socket in
between (or a copy of what one end wrote) lets a test alter, replay, reorder,
splice or cut what crosses. Against a real dash-memd: the client's channel is
sealed (or signed) after the login and carries a shard both ways, and a relay
that alters or injects bytes after a ``--no-tls`` login is found out.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from conftest import wait_for

from dashrun.errors import ChecksumError, ProtocolError, RecordTagError, UnavailableError
from dashrun.wire import sealed
from dashrun.wire.channel import CHUNK, Channel
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.tls import TlsSettings
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import Kind, encode_body, encode_header
from dashrun.wire.sealed import MAX_RECORD, Records, SignedRecords

KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


def sealed_pair(kind: type[Records] = Records) -> tuple[Channel, Channel]:
    """Two channels on a loopback TCP connection (a channel reads a Unix socket's headers with recvmsg)."""
    a, b = tcp_pair()
    for s in (a, b):
        s.settimeout(10)
    left, right = Channel(a), Channel(b)
    left.seal(kind(a, KEY_A, KEY_B))
    right.seal(kind(b, KEY_B, KEY_A))
    return left, right


def written_by(records: Records, *payloads: bytes) -> bytes:
    """What ``records`` puts on the wire for ``payloads``, one sendall each."""
    out, into = socket.socketpair()
    records.sock = out
    with out, into:
        for payload in payloads:
            records.sendall(payload)
        out.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := into.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)


def reader_of(wire: bytes, send_key: bytes = KEY_B, recv_key: bytes = KEY_A, kind: type[Records] = Records) -> Records:
    """Records reading ``wire`` (then the end of the stream)."""
    out, into = socket.socketpair()
    threading.Thread(target=lambda: (out.sendall(wire), out.shutdown(socket.SHUT_WR)), daemon=True).start()
    into.settimeout(10)
    return kind(into, send_key, recv_key)


def read_all(records: Records, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    got = 0
    while got < nbytes:
        n = records.recv_into(memoryview(buf)[got:], nbytes - got)
        assert n, "the stream ended early"
        got += n
    return bytes(buf)


def test_frames_of_every_size_cross_sealed_and_nothing_is_in_the_clear():
    left, right = sealed_pair()
    sizes = [0, 1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 3 * MAX_RECORD + 5]
    payloads = [os.urandom(n) for n in sizes]
    seen = []

    def receive():
        for n in sizes:
            frame = right.recv(max_data=1 << 30)
            buf = bytearray(frame.data_len)
            right.recv_data_into(frame, [memoryview(buf)])
            seen.append((frame.body["n"], bytes(buf)))

    reader = threading.Thread(target=receive)
    reader.start()
    for n, payload in zip(sizes, payloads):
        left.send(Kind.PING, {"n": n}, data=[payload] if payload else None)
    reader.join(30)
    assert seen == list(zip(sizes, payloads))
    # and the records are not the bytes: sealing a known payload shows none of it on the wire
    marker = b"plaintext-marker" * 4096
    wire = written_by(Records(None, KEY_A, KEY_B), marker)
    assert len(wire) == len(marker) + 4 + 16 and b"plaintext-marker" not in wire
    # sealed with AES-128-GCM under the first half of the direction's key: record 0's nonce, its length as AAD
    body, nonce = wire[4:], bytes(12)
    assert AESGCM(KEY_A[:16]).decrypt(nonce, body, wire[:4]) == marker
    with pytest.raises(InvalidTag):  # not AES-256-GCM under the whole key
        AESGCM(KEY_A).decrypt(nonce, body, wire[:4])


def test_a_record_is_read_whole_or_in_pieces():
    wire = written_by(Records(None, KEY_A, KEY_B), b"0123456789" * 10, b"tail")
    reader = reader_of(wire)
    assert reader.recv_into(memoryview(bytearray(3)), 3) == 3  # part of the first record; the rest kept
    assert read_all(reader, 97) == (b"0123456789" * 10)[3:]
    assert read_all(reader, 4) == b"tail"
    assert reader.recv_into(memoryview(bytearray(8)), 8) == 0  # the peer closed between records


@pytest.mark.parametrize("at", [0, 3, 4, 20, -1])
def test_any_altered_byte_drops_the_connection(at):
    """The length, the ciphertext, the tag: a flipped bit anywhere is refused, never handed on."""
    wire = bytearray(written_by(Records(None, KEY_A, KEY_B), os.urandom(64)))
    wire[at] ^= 0x01
    with pytest.raises((UnavailableError, ProtocolError)):
        read_all(reader_of(bytes(wire)), 64)


def test_replayed_reordered_spliced_or_cut_records_are_refused():
    first, second = b"first record", b"second record"
    wire = written_by(Records(None, KEY_A, KEY_B), first, second)
    one = 4 + len(first) + 16
    with pytest.raises(UnavailableError, match="authentication"):  # the second before the first
        read_all(reader_of(wire[one:] + wire[:one]), len(second))
    replayed = reader_of(wire[:one] + wire[:one])
    assert read_all(replayed, len(first)) == first
    with pytest.raises(UnavailableError, match="authentication"):  # the first again
        read_all(replayed, len(first))
    other = written_by(Records(None, bytes(32), KEY_A), first)  # another connection's keys
    with pytest.raises(UnavailableError, match="authentication"):
        read_all(reader_of(other), len(first))
    with pytest.raises(UnavailableError, match="cut"):
        read_all(reader_of(wire[:one - 1]), len(first))
    with pytest.raises(UnavailableError, match="authentication"):  # a sender's own record sent back to it
        read_all(reader_of(wire, send_key=KEY_A, recv_key=KEY_B), len(first))


def test_a_length_past_the_bound_is_refused_before_anything_is_allocated():
    reader = reader_of((MAX_RECORD + 1).to_bytes(4, "big") + b"x" * 64)
    with pytest.raises(ProtocolError, match="at most"):
        reader.recv_into(memoryview(bytearray(16)), 16)
    assert len(reader._in) == 0
    with pytest.raises(ProtocolError):
        reader_of(bytes(4) + b"x" * 32).recv_into(memoryview(bytearray(16)), 16)  # an empty record


def test_keys_move_on_every_rekey_interval(monkeypatch):
    """Past the interval both ends seal under the next key, in step; a reader that did not move cannot open."""
    monkeypatch.setattr(sealed, "REKEY_RECORDS", 4)
    payloads = [os.urandom(32) for _ in range(10)]
    wire = written_by(Records(None, KEY_A, KEY_B), *payloads)
    reader = reader_of(wire)
    assert [read_all(reader, 32) for _ in payloads] == payloads
    assert reader._recv.key != KEY_A
    monkeypatch.setattr(sealed, "REKEY_RECORDS", 1 << 16)
    stale = reader_of(wire)
    assert [read_all(stale, 32) for _ in range(4)] == payloads[:4]
    with pytest.raises(UnavailableError, match="authentication"):  # the fifth is sealed under the next key
        read_all(stale, 32)


def test_a_sealed_receive_decrypts_into_place_holding_one_record_buffer():
    """What the README's sizing counts per connection: a sealed channel's receive keeps its record buffer, no
    landing buffer beside it."""
    left, right = sealed_pair()
    payload = os.urandom(3 * CHUNK + 5)
    sender = threading.Thread(target=left.send, args=(Kind.PING, {}), kwargs={"data": [payload]})
    sender.start()
    frame = right.recv(max_data=1 << 30)
    buf = bytearray(len(payload))
    right.recv_data_into(frame, [memoryview(buf)])
    sender.join(30)
    assert buf == payload
    assert right._landing is None and len(right._records._in) <= MAX_RECORD + 16
    assert len(right._records._plain) < 4096  # a frame's header, read before its body


def test_a_corrupted_shard_under_the_seal_still_fails_its_checksum():
    """The seal guards the link; the CRC trailer still guards the bytes end to end (a sender's wrong CRC)."""
    left, right = sealed_pair()
    payload = os.urandom(CHUNK + 7)
    left.send(Kind.PING, {}, data=[payload], crc=12345)
    frame = right.recv(max_data=1 << 30)
    with pytest.raises(ChecksumError):
        right.recv_data_into(frame, [memoryview(bytearray(len(payload)))])


def test_a_tls_login_leaves_the_channel_sealed(memd):
    """Against a real dash-memd: after the login the TLS layer is gone (close_notify both ways) and records
    carry every frame; a shard of several records goes in and comes back whole, twice on one connection."""
    payload = os.urandom(3 * CHUNK + 11)
    with MemdClient(memd.host, memd.port, memd.token, timeout=10) as c:
        c.ping()
        ch = c._ch
        assert isinstance(ch.sock, ssl.SSLSocket) and ch.sock._sslobj is None and ch._records is not None
        assert c.put_shard(ShardHeader("sealed-job", 1, 0, 1, len(payload), 0, len(payload), 0, 0, "ab" * 32),
                           [payload])["committed"]
        for _ in range(2):
            back = bytearray(len(payload))
            c.get_shard_into("sealed-job", 1, 0, [memoryview(back)])
            assert back == payload
        assert c._ch is ch  # one connection throughout


# --- signed records: --no-tls ---------------------------------------------------------------------------


def test_signed_records_carry_frames_of_every_size_in_the_clear():
    left, right = sealed_pair(SignedRecords)
    sizes = [0, 1, 17, CHUNK - 1, CHUNK, CHUNK + 1, 3 * MAX_RECORD + 5]
    payloads = [os.urandom(n) for n in sizes]
    seen = []

    def receive():
        for _ in sizes:
            frame = right.recv(max_data=1 << 30)
            buf = bytearray(frame.data_len)
            right.recv_data_into(frame, [memoryview(buf)])
            seen.append((frame.body["n"], bytes(buf)))

    reader = threading.Thread(target=receive)
    reader.start()
    for n, payload in zip(sizes, payloads):
        left.send(Kind.PING, {"n": n}, data=[payload] if payload else None)
    reader.join(30)
    assert seen == list(zip(sizes, payloads))
    marker = b"plaintext-marker" * 4096
    wire = written_by(SignedRecords(None, KEY_A, KEY_B), marker)
    assert len(wire) == 4 + 16 + len(marker) and wire.endswith(marker)  # the bytes as they are, after the tag


@pytest.mark.parametrize("at", [0, 3, 4, 19, 20, 40, -1], ids=["length", "length-end", "tag", "tag-end", "bytes",
                                                                "middle", "last"])
def test_a_bit_flipped_anywhere_in_a_signed_record_drops_the_connection(at):
    wire = bytearray(written_by(SignedRecords(None, KEY_A, KEY_B), os.urandom(64)))
    wire[at] ^= 0x01
    with pytest.raises((UnavailableError, ProtocolError)):
        read_all(reader_of(bytes(wire), kind=SignedRecords), 64)


def test_signed_records_replayed_reordered_or_from_another_link_are_refused():
    first, second = b"first record", b"second record"
    wire = written_by(SignedRecords(None, KEY_A, KEY_B), first, second)
    one = 4 + 16 + len(first)
    with pytest.raises(UnavailableError, match="authentication"):
        read_all(reader_of(wire[one:] + wire[:one], kind=SignedRecords), len(second))
    replayed = reader_of(wire[:one] + wire[:one], kind=SignedRecords)
    assert read_all(replayed, len(first)) == first
    with pytest.raises(UnavailableError, match="authentication"):
        read_all(replayed, len(first))
    sealed_keys_signed = written_by(Records(None, KEY_A, KEY_B), first)  # a sealed record is no signed one
    with pytest.raises((UnavailableError, ProtocolError)):
        read_all(reader_of(sealed_keys_signed, kind=SignedRecords), len(first))
    received = reader_of(wire, kind=SignedRecords)
    part = bytearray(5)
    assert received.recv_into(memoryview(part), 5) == 5 and part == first[:5]  # a record taken in pieces
    assert read_all(received, len(first) - 5 + len(second)) == first[5:] + second


def test_a_no_tls_login_leaves_the_channel_signed(memd_factory):
    memd = memd_factory("--memory-limit", "64MiB", "--no-tls")
    payload = os.urandom(3 * CHUNK + 11)
    with memd.client(timeout=10) as c:
        c.ping()
        assert isinstance(c._ch._records, SignedRecords)
        assert c.put_shard(ShardHeader("signed-job", 1, 0, 1, len(payload), 0, len(payload), 0, 0, "ab" * 32),
                           [payload])["committed"]
        back = bytearray(len(payload))
        c.get_shard_into("signed-job", 1, 0, [memoryview(back)])
        assert back == payload


def _frame(kind: Kind, body: dict) -> bytes:
    encoded = encode_body(body)
    return encode_header(kind, encoded) + encoded


#: What a client sends to log in: HELLO and AUTH (each body a 64-digit hex field), then it waits for WELCOME.
LOGIN_BYTES = len(_frame(Kind.HELLO, {"nonce": "0" * 64})) + len(_frame(Kind.AUTH, {"mac": "0" * 64}))


class TamperingRelay:
    """A relay on loopback to ``target`` for one connection: dash-memd's bytes go through as they are, the
    client's too but for ``inject`` (sent before the client's byte at offset ``at``) and one bit of the client's
    byte at offset ``flip``. Stopped (its sockets closed, its threads joined) by :meth:`close`."""

    def __init__(self, target: tuple[str, int], *, at: int = 0, inject: bytes = b"", flip: int | None = None):
        self.target, self.at, self.inject, self.flip = target, at, inject, flip
        self.tampered = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:  # closed before anyone connected
            return
        server = socket.create_connection(self.target, timeout=10)
        self._sockets += [client, server]
        back = threading.Thread(target=self._pump, args=(server, client, False), daemon=True)
        self._threads.append(back)
        back.start()
        self._pump(client, server, True)

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        offset = 0
        try:
            while chunk := bytearray(src.recv(1 << 16)):
                start, offset = offset, offset + len(chunk)
                if tamper and self.flip is not None and start <= self.flip < offset:
                    chunk[self.flip - start] ^= 0x04
                    self.tampered.set()
                if tamper and self.inject and start <= self.at < offset:
                    cut = self.at - start
                    chunk[cut:cut] = self.inject
                    self.tampered.set()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()
        for thread in self._threads:
            thread.join(10)


@pytest.fixture
def no_tls_memd_with_a_checkpoint(memd_factory):
    """A --no-tls dash-memd holding job ``kept`` step 1 (stored over a direct connection)."""
    memd = memd_factory("--memory-limit", "64MiB", "--no-tls")
    payload = os.urandom(4096)
    with memd.client(timeout=10) as c:
        assert c.put_shard(ShardHeader("kept", 1, 0, 1, len(payload), 0, len(payload), 0, 0, "ab" * 32),
                           [payload])["committed"]
    return memd


def test_a_frame_injected_after_a_no_tls_login_is_refused(no_tls_memd_with_a_checkpoint):
    """Frames are easy to forge (their checksums are CRCs anyone computes): one put on the path after the login,
    a DELETE of the job, ends the connection and deletes nothing."""
    memd = no_tls_memd_with_a_checkpoint
    relay = TamperingRelay((memd.host, memd.port), at=LOGIN_BYTES, inject=_frame(Kind.DELETE, {"job": "kept",
                                                                                                "keep": 0}))
    try:
        with MemdClient(relay.host, relay.port, memd.token, timeout=10, tls=TlsSettings(plaintext=True)) as c:
            with pytest.raises((UnavailableError, ProtocolError)):
                c.ping()
        assert relay.tampered.is_set()
    finally:
        relay.close()
    with memd.client(timeout=10) as c:
        assert c.latest("kept").step == 1


@pytest.mark.parametrize("kind_byte", [LOGIN_BYTES + 5, LOGIN_BYTES + 4 + 16 + 5],
                         ids=["where-an-unsigned-frame-has-its-kind", "the-kind-of-the-frame-in-the-record"])
def test_a_bit_flipped_after_a_no_tls_login_is_detected(no_tls_memd_with_a_checkpoint, kind_byte):
    """A bit of a request's kind flipped on the path makes another valid request, its checksums intact
    (LATEST, 18, becomes PING, 22): unsigned, the client would read "no checkpoint"; signed, the record fails
    its tag (the frame's header follows the record's length and tag) and the connection ends."""
    memd = no_tls_memd_with_a_checkpoint
    relay = TamperingRelay((memd.host, memd.port), flip=kind_byte)
    try:
        with MemdClient(relay.host, relay.port, memd.token, timeout=10, tls=TlsSettings(plaintext=True)) as c:
            with pytest.raises(UnavailableError):
                c.latest("kept")
        assert relay.tampered.is_set()
    finally:
        relay.close()
    with memd.client(timeout=10) as c:
        assert c.latest("kept").step == 1


# --- a record that fails, and records numbered by two threads ------------------------------------------------


def tampered_frame(kind: type[Records], payload: bytes, at: int) -> bytes:
    """What a channel sealed with ``kind`` sends for a frame carrying ``payload``, one bit flipped at ``at``."""
    a, b = tcp_pair()
    with a, b:
        sender = Channel(a)
        sender.seal(kind(a, KEY_A, KEY_B))
        sender.send(Kind.PING, {}, data=[payload])
        a.shutdown(socket.SHUT_WR)
        wire = bytearray()
        while chunk := b.recv(1 << 20):
            wire += chunk
    wire[at] ^= 0x01
    return bytes(wire)


@pytest.mark.parametrize("kind", [Records, SignedRecords], ids=["sealed", "signed"])
def test_a_record_that_fails_its_tag_leaves_zeros_where_it_landed(kind):
    """Decrypted before its tag is checked (sealed) or received in place (signed), a record that fails leaves
    none of its bytes in the destination; taken in part, none in the buffer that holds the rest."""
    payload = b"\x5a" * 4096
    wire = bytearray(written_by(kind(None, KEY_A, KEY_B), payload))
    wire[-100] ^= 0x01  # inside the record's bytes
    for wanted in (len(payload), 10):
        reader = reader_of(bytes(wire), kind=kind)
        into = bytearray(b"\xaa" * len(payload))
        with pytest.raises(RecordTagError, match="authentication"):
            reader.recv_into(memoryview(into), wanted)
        assert into == bytes(len(payload)) if wanted == len(payload) else into == b"\xaa" * len(payload)
        assert not any(reader._plain) and not reader._pending
    cut = reader_of(bytes(written_by(kind(None, KEY_A, KEY_B), payload))[:-100], kind=kind)
    into = bytearray(b"\xaa" * len(payload))
    with pytest.raises(UnavailableError, match="cut"):
        cut.recv_into(memoryview(into), len(payload))
    assert b"\x5a" not in into  # cut short: what came is unchecked, and not kept either


@pytest.mark.parametrize("kind", [Records, SignedRecords], ids=["sealed", "signed"])
def test_a_shard_whose_record_fails_its_tag_leaves_none_of_it_in_its_destination(kind):
    """As a rank or dash-memd receives a shard, into its tensors or its RAM buffer: the altered record's bytes
    never reach them (the frame's last record, 4-byte CRC, is 24 bytes: -100 is inside the data's)."""
    payload = b"\x5a" * (CHUNK + 4096)
    wire = tampered_frame(kind, payload, -100)
    c, d = tcp_pair()
    with c, d:
        threading.Thread(target=lambda: (c.sendall(wire), c.shutdown(socket.SHUT_WR)), daemon=True).start()
        d.settimeout(10)
        receiver = Channel(d)
        receiver.seal(kind(d, KEY_B, KEY_A))
        frame = receiver.recv(max_data=1 << 30)
        into = bytearray(b"\xaa" * len(payload))
        with pytest.raises(RecordTagError):
            receiver.recv_data_into(frame, [memoryview(into)])
    assert b"\x5a" * 16 not in into[CHUNK:]  # the first record (a chunk) passed its tag: it is the sender's


@pytest.mark.parametrize("kind", [Records, SignedRecords], ids=["sealed", "signed"])
def test_two_threads_sending_on_one_link_take_turns_and_never_share_a_record_number(kind):
    """Two threads send on one link at once, each a record and a half per call: they take turns, a call each,
    so the peer opens every record in order (a record number used twice, or records out of their numbers'
    order, fails its tag) and every call's bytes arrive together. Numbering outside the lock raises."""
    a, b = tcp_pair()
    for sock in (a, b):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # a send blocks part-way: threads switch
        sock.settimeout(30)
    sender, receiver = kind(a, KEY_A, KEY_B), kind(b, KEY_B, KEY_A)
    piece, calls = MAX_RECORD + MAX_RECORD // 2, 12
    failures: list[BaseException] = []

    def send(letter: bytes) -> None:
        try:
            for _ in range(calls):
                sender.sendall(letter * piece)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            failures.append(e)

    threads = [threading.Thread(target=send, args=(letter,)) for letter in (b"A", b"B")]
    with a, b:
        for thread in threads:
            thread.start()
        received = [read_all(receiver, piece) for _ in range(2 * calls)]
        for thread in threads:
            thread.join(30)
    assert not failures, failures
    assert sorted(call[:1] for call in received) == [b"A"] * calls + [b"B"] * calls
    assert all(call == call[:1] * piece for call in received)  # each call's records together, in order
    assert sender._send.number == receiver._recv.number == 2 * calls * 2
    with pytest.raises(RuntimeError, match="outside its direction's lock"):
        Records(None, KEY_A, KEY_B)._send.next()


def test_a_tag_failure_is_counted_and_logged_by_dash_memd(no_tls_memd_with_a_checkpoint):
    """dash-memd tells a record that failed its tag from a link that failed: a WARNING line and a count in
    every LIST reply, for 'dashrun status' to show."""
    memd = no_tls_memd_with_a_checkpoint
    with memd.client(timeout=10) as c:
        assert c.list()["tag_failures"] == 0
    relay = TamperingRelay((memd.host, memd.port), flip=LOGIN_BYTES + 4 + 16 + 5)
    try:
        with MemdClient(relay.host, relay.port, memd.token, timeout=10, tls=TlsSettings(plaintext=True)) as c:
            with pytest.raises(UnavailableError):
                c.latest("kept")
    finally:
        relay.close()
    wait_for(lambda: "WARNING" in memd.log() and "a record failed authentication" in memd.log(), 10,
             "dash-memd to log the tag failure")
    with memd.client(timeout=10) as c:
        assert c.list()["tag_failures"] == 1
