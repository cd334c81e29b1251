"""The sealed records a TCP link goes on in after its TLS login (dashrun/wire/sealed.py), on real sockets.

Two channels on a socket pair exchange frames through :class:`Records`; a raw
socket in between (or a copy of what one end wrote) lets a test alter,
replay, reorder, splice or cut what crosses. Against a real dash-memd: the
client's channel is sealed after the login and carries a shard both ways.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading

import pytest

from dashrun.errors import ChecksumError, ProtocolError, UnavailableError
from dashrun.wire import sealed
from dashrun.wire.channel import CHUNK, Channel
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import Kind
from dashrun.wire.sealed import MAX_RECORD, Records

KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


def sealed_pair() -> tuple[Channel, Channel]:
    """Two channels on a loopback TCP connection (a channel reads a Unix socket's headers with recvmsg)."""
    a, b = tcp_pair()
    for s in (a, b):
        s.settimeout(10)
    left, right = Channel(a), Channel(b)
    left.seal(Records(a, KEY_A, KEY_B))
    right.seal(Records(b, KEY_B, KEY_A))
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


def reader_of(wire: bytes, send_key: bytes = KEY_B, recv_key: bytes = KEY_A) -> Records:
    """Records reading ``wire`` (then the end of the stream)."""
    out, into = socket.socketpair()
    threading.Thread(target=lambda: (out.sendall(wire), out.shutdown(socket.SHUT_WR)), daemon=True).start()
    into.settimeout(10)
    return Records(into, send_key, recv_key)


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
