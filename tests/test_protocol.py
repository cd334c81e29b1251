"""The wire format: golden bytes, bounds checked before allocation, fields validated."""

import json
import socket
import struct

import pytest

from dashrun import protocol
from dashrun.channel import Channel
from dashrun.errors import ChecksumError, ProtocolError, UnavailableError
from dashrun.protocol import (
    HEADER, MAX_BODY, CheckpointInfo, Kind, ShardHeader, crc32c, decode_body, decode_header, encode_body,
    encode_header,
)


def test_crc32c_is_castagnoli():
    # RFC 3720 B.4: CRC-32C of 32 zero bytes; and the classic check value of "123456789".
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"123456789") == 0xE3069283


def test_header_golden_bytes():
    body = encode_body({"job": "gpt-1", "step": 7})
    assert body == b'{"job":"gpt-1","step":7}'
    raw = encode_header(Kind.LATEST, body, data_len=5)
    assert raw == (b"DASH" + bytes([1, 18]) + b"\x00\x00" + struct.pack("!I", len(body))
                   + struct.pack("!Q", 5) + struct.pack("!I", crc32c(body)))
    assert raw.hex() == "444153480112000000000018000000000000000538c3e2c1".replace(
        "38c3e2c1", struct.pack("!I", crc32c(body)).hex())
    header = decode_header(raw, max_body=1024, max_data=10)
    assert (header.kind, header.body_len, header.data_len) == (Kind.LATEST, len(body), 5)
    assert decode_body(header, body) == {"job": "gpt-1", "step": 7}


def test_header_fixed_layout():
    assert HEADER.size == 24
    assert protocol.MAGIC == b"DASH" and protocol.VERSION == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda h: b"HTTP" + h[4:], "bad magic"),
    (lambda h: h[:4] + b"\x09" + h[5:], "version"),
    (lambda h: h[:5] + b"\xee" + h[6:], "unknown frame kind"),
    (lambda h: h[:6] + b"\x00\x01" + h[8:], "reserved flags"),
    (lambda h: h[:8] + struct.pack("!I", 0xFFFFFFFF) + h[12:], "exceeds the limit"),
    (lambda h: h[:12] + struct.pack("!Q", 1 << 62) + h[20:], "more than the"),
    (lambda h: h[:10], "truncated"),
])
def test_header_refuses_before_allocating(mutate, message):
    raw = encode_header(Kind.PING, b"{}")
    with pytest.raises(ProtocolError, match=message):
        decode_header(mutate(raw), max_body=MAX_BODY, max_data=0)


def test_body_must_be_a_checked_json_object():
    good = encode_body({"a": 1})
    header = decode_header(encode_header(Kind.PING, good), max_body=100, max_data=0)
    with pytest.raises(ProtocolError, match="checksum"):
        decode_body(header, b'{"a":2}')
    for bad in (b"[1,2]", b"\xff\xfe", b'{"a": NaN}', b"{" * 10, b'{"a": 1e999999}'):
        bad_header = decode_header(encode_header(Kind.PING, bad), max_body=100, max_data=0)
        with pytest.raises(ProtocolError):
            decode_body(bad_header, bad)


@pytest.mark.parametrize("job", ["../x", "..", "", ".hidden", "a/b", "a\x00b", "x" * 129, 5, None, "é"])
def test_hostile_job_ids_are_refused(job):
    with pytest.raises(ProtocolError, match="job id"):
        protocol.field_job({"job": job})


def test_integer_fields_refuse_bools_floats_and_out_of_range():
    for value in (True, 1.5, "3", -1, 1 << 60, None):
        with pytest.raises(ProtocolError):
            protocol.field_int({"n": value}, "n", 0, 1 << 50)
    assert protocol.field_int({"n": 3}, "n") == 3


def _shard(rank=0, world=2, total=100, start=0, end=50, **kw):
    return ShardHeader("job", 3, rank, world, total, start, end, 10, 20, "ab" * 32, **kw)


def test_shard_header_round_trip_and_bounds():
    shard = _shard()
    assert ShardHeader.from_body(json.loads(encode_body(shard.to_body()))) == shard
    assert shard.nbytes == 50 + 10 + 20
    for field, value in (("rank", 2), ("rep_end", 101), ("rep_start", 101), ("world", 0), ("layout", "zz"),
                         ("private_len", -1), ("meta_len", 1 << 40)):
        with pytest.raises(ProtocolError):
            ShardHeader.from_body({**shard.to_body(), field: value})


def test_checkpoint_info_checks_that_shards_tile_the_state():
    shards = (_shard(0, start=0, end=50), _shard(1, start=50, end=100))
    info = CheckpointInfo("job", 3, 2, 100, "ab" * 32, 1.0, shards)
    assert CheckpointInfo.from_body(json.loads(encode_body(info.to_body()))) == info
    gap = info.to_body()
    gap["shards"][1]["rep_start"] = 60
    with pytest.raises(ProtocolError, match="does not follow"):
        CheckpointInfo.from_body(gap)
    short = info.to_body()
    short["shards"][1]["rep_end"] = 90
    with pytest.raises(ProtocolError, match="cover"):
        CheckpointInfo.from_body(short)


def test_channel_round_trip_with_data_and_trailer():
    a, b = socket.socketpair()
    with a, b:
        sender, receiver = Channel(a), Channel(b)
        sender.send(Kind.SHARD_DATA, {"x": 1}, data=[b"hello ", memoryview(b"world")])
        frame = receiver.recv(max_data=100)
        assert frame.body == {"x": 1} and frame.data_len == 11
        first, second = bytearray(6), bytearray(5)
        assert receiver.recv_data_into(frame, [memoryview(first), memoryview(second)]) == crc32c(b"hello world")
        assert bytes(first + second) == b"hello world"


def test_channel_detects_corrupted_data():
    a, b = socket.socketpair()
    with a, b:
        Channel(a).send(Kind.SHARD_DATA, {}, data=[b"payload"], crc=12345)
        receiver = Channel(b)
        frame = receiver.recv(max_data=100)
        with pytest.raises(ChecksumError):
            receiver.recv_data(frame)


def test_channel_refuses_unannounced_data_and_reports_truncation():
    a, b = socket.socketpair()
    with a, b:
        Channel(a).send(Kind.SHARD_DATA, {}, data=[b"x" * 10])
        with pytest.raises(ProtocolError, match="more than the 0 allowed"):
            Channel(b).recv()
    a, b = socket.socketpair()
    with b:
        a.sendall(encode_header(Kind.PING, b"{}")[:10])
        a.close()
        with pytest.raises(UnavailableError):
            Channel(b).recv()
