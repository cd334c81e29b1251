"""The wire format: golden bytes, bounds checked before allocation, fields validated."""

import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dashrun.errors import ChecksumError, ProtocolError, UnavailableError
from dashrun.util.boundedjson import MAX_DEPTH, check_depth, loads_bounded
from dashrun.wire import protocol
from dashrun.wire.channel import CHUNK, Channel, peer_on_this_machine
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.protocol import HEADER, MAX_BODY, Kind, crc32c, decode_body, decode_header, encode_body, encode_header


def test_crc32c_is_castagnoli():
    # RFC 3720 B.4: CRC-32C of 32 zero bytes; and the classic check value of "123456789".
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"123456789") == 0xE3069283


def test_header_golden_bytes():
    body = encode_body({"job": "gpt-1", "step": 7})
    assert body == b'{"job":"gpt-1","step":7}'
    raw = encode_header(Kind.LATEST, body, data_len=5)
    assert raw == (b"DASH" + bytes([4, 18]) + b"\x00\x00" + struct.pack("!I", len(body))
                   + struct.pack("!Q", 5) + struct.pack("!I", 0xDFDB4AE7))
    # The CRC-32C pinned (computed bit by bit with the Castagnoli polynomial 0x82F63B78, not by crc32c()).
    assert raw.hex() == "4441534804120000000000180000000000000005dfdb4ae7"
    header = decode_header(raw, max_body=1024, max_data=10)
    assert (header.kind, header.body_len, header.data_len) == (Kind.LATEST, len(body), 5)
    assert decode_body(header, body) == {"job": "gpt-1", "step": 7}


def test_header_fixed_layout():
    assert HEADER.size == 24
    assert protocol.MAGIC == b"DASH" and protocol.VERSION == 4


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


def _decode(raw: bytes) -> dict:
    header = decode_header(encode_header(Kind.PING, raw), max_body=MAX_BODY, max_data=0)
    return decode_body(header, raw)


def _nested(depth: int, shape: str) -> dict:
    """A body ``depth`` levels deep (the body itself is one): lists, objects, or both in turn, around a null."""
    value = None
    for level in range(depth - 1):
        as_list = shape == "lists" or (shape == "both" and level % 2)
        value = [value] if as_list else {"k": value}
    return {"a": value}


def test_json_nesting_deeper_than_64_is_refused_before_parsing():
    assert MAX_DEPTH == 64
    for shape in ("lists", "objects", "both"):
        fits, too_deep = _nested(64, shape), _nested(65, shape)
        assert (_depth(fits), _depth(too_deep)) == (64, 65)
        assert _decode(json.dumps(fits).encode()) == fits
        assert loads_bounded(json.dumps(fits)) == fits
        with pytest.raises(ProtocolError, match="deeper than 64"):
            _decode(json.dumps(too_deep).encode())
        with pytest.raises(ValueError, match="deeper than 64"):
            loads_bounded(json.dumps(too_deep, indent=1))


def test_brackets_inside_strings_do_not_count_and_escapes_end_strings_where_json_does():
    deep_text = "[" * 5000 + "{" * 5000
    for body in ({"a": deep_text}, {deep_text: 1}, {"a": '\\"' + deep_text, "b": '\\'},
                 {"a": ["\\", deep_text, '"', "]" * 100]}):
        raw = json.dumps(body).encode()
        assert _decode(raw) == body
        assert _decode(json.dumps(body, ensure_ascii=False).encode()) == body
    # A string ending in an escaped backslash ends there: what follows is structure, and counts.
    hidden = b'{"a":"x\\\\","b":' + b"[" * 70 + b"]" * 70 + b"}"
    assert json.loads(hidden)["a"] == "x\\"
    with pytest.raises(ProtocolError, match="deeper than 64"):
        _decode(hidden)
    # An escaped quote does not end a string: the brackets after it are text.
    quoted = b'{"a":"\\"' + b"[" * 70 + b'"}'
    assert _decode(quoted) == {"a": '"' + "[" * 70}
    # A string that never closes (invalid anyway) leaves its brackets counted: refused as too deep.
    with pytest.raises(ProtocolError, match="deeper than 64"):
        _decode(b'{"a":"' + b"[" * 70)


def test_four_kib_of_open_brackets_is_refused_without_recursing():
    """The pre-auth attack: a whole 4 KiB body of ``[``, decoded on a thread with a 64 KiB stack.

    Run in a child process: before the depth was bounded, the parser recursed 4096 levels
    deep and overflowed such a stack (SIGSEGV), or raised RecursionError where it did not.
    """
    code = textwrap.dedent("""
        import threading
        from dashrun.errors import ProtocolError
        from dashrun.wire.protocol import MAX_BODY_PREAUTH, Kind, decode_body, decode_header, encode_header
        bomb = b"[" * MAX_BODY_PREAUTH
        header = decode_header(encode_header(Kind.AUTH, bomb), max_body=MAX_BODY_PREAUTH, max_data=0)
        result = []
        def attack():
            try:
                decode_body(header, bomb)
            except ProtocolError as e:
                result.append(str(e))
        threading.stack_size(64 << 10)
        thread = threading.Thread(target=attack)
        thread.start()
        thread.join()
        print(result)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "['body nests JSON deeper than 64 levels']", out.stdout


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\n\u00e9\U0001f600', max_size=8)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TRICKY_TEXT,
                     lambda children: st.lists(children, max_size=3) | st.dictionaries(_TRICKY_TEXT, children,
                                                                                      max_size=3),
                     max_leaves=40)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(value=_JSON, limit=st.integers(0, 12), ensure_ascii=st.booleans(), indent=st.sampled_from([None, 1]))
def test_the_depth_scan_agrees_with_the_parsed_document(value, limit, ensure_ascii, indent):
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)
    if _depth(value) > limit:
        with pytest.raises(ValueError, match="deeper than"):
            check_depth(text, limit)
    else:
        check_depth(text, limit)
        assert loads_bounded(text.encode(), limit) == value


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


@pytest.mark.parametrize("helper", [True, False], ids=["landing-buffer", "straight-in"])
def test_channel_receives_large_data_exactly_into_unaligned_views(monkeypatch, helper):
    from dashrun.wire import channel

    if helper and channel._ntcopy is None:
        pytest.skip("dashrun's C helper is not built here")
    copies = []
    if helper:
        real = channel._ntcopy

        class Counting:
            @staticmethod
            def copy_crc(*args):
                copies.append(args[2])
                return real.copy_crc(*args)

        monkeypatch.setattr(channel, "_ntcopy", Counting)
    else:
        monkeypatch.setattr(channel, "_ntcopy", None)
    data = os.urandom(2 * CHUNK + 12345)
    backing = bytearray(len(data) + 64)
    # Three views at odd offsets, one of them empty, the first crossing a chunk boundary.
    cut = CHUNK + 7
    views = [memoryview(backing)[3:3 + cut], memoryview(backing)[3 + cut:3 + cut],
             memoryview(backing)[3 + cut + 5:3 + len(data) + 5]]
    a, b = socket.socketpair()
    with a, b:
        receiver = Channel(b)
        sender = threading.Thread(target=Channel(a).send, args=(Kind.SHARD_DATA, {}), kwargs={"data": [data]})
        sender.start()
        crc = receiver.recv_data_into(receiver.recv(max_data=len(data)), views)
        sender.join(timeout=60)
    assert crc == crc32c(data)
    assert bytes(views[0]) + bytes(views[2]) == data
    assert backing[:3] == bytes(3) and backing[3 + cut:3 + cut + 5] == bytes(5)  # nothing written outside the views
    assert sum(copies) == (len(data) if helper else 0)


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


# --- yielding the CPU to a receiver on this machine ------------------------------------------------------------------

_SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
total = 0
while chunk := conn.recv(1 << 20):
    total += len(chunk)
print(total, flush=True)
"""


@pytest.fixture
def other_host():
    """(address, port, process) of a TCP sink on another network host: a namespace of its own behind a veth pair.

    The sink prints the port it listens on, then, at EOF, how many bytes it got.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    tag = secrets.token_hex(3)
    ns, here, there = f"dash-test-{tag}", f"dsh{tag}a", f"dsh{tag}b"
    net = f"198.18.{secrets.randbelow(250)}"  # RFC 2544's range for network tests, here inside the namespace only

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.decode().strip()}")
    sink = None
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", ns)
        ip("addr", "add", f"{net}.1/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
        sink = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SINK, f"{net}.2"],
                                stdout=subprocess.PIPE, text=True)
        yield f"{net}.2", int(sink.stdout.readline()), sink
    finally:
        if sink is not None:
            sink.kill()
            sink.wait(timeout=30)
            sink.stdout.close()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)


def _count_yields(monkeypatch) -> list[int]:
    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    return yields


def test_a_sender_yields_the_cpu_after_each_chunk_to_a_receiver_on_this_machine(monkeypatch):
    data = os.urandom(3 * CHUNK + 5)  # four chunks
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname()) as a:
        b, _ = srv.accept()
        with b:
            assert peer_on_this_machine(a) and peer_on_this_machine(b)
            got = bytearray(len(data))
            receiver = Channel(b)

            def receive():
                receiver.recv_data_into(receiver.recv(max_data=len(data)), [memoryview(got)])

            reader = threading.Thread(target=receive)
            reader.start()
            yields = _count_yields(monkeypatch)
            Channel(a).send(Kind.SHARD_DATA, {}, data=[data])
            reader.join(timeout=60)
    assert not reader.is_alive() and bytes(got) == data
    assert len(yields) == 4


def test_no_yield_where_the_peer_is_not_a_tcp_peer_on_this_machine():
    a, b = socket.socketpair()  # a Unix socket: ranks and their agent (no bulk data goes over it)
    with a, b:
        assert not peer_on_this_machine(a)
    with socket.socket() as unconnected:
        assert not peer_on_this_machine(unconnected)


def test_a_sender_keeps_the_cpu_when_the_receiver_is_on_another_host(monkeypatch, other_host):
    address, port, sink = other_host
    data = os.urandom(3 * CHUNK + 5)
    with socket.create_connection((address, port), timeout=30) as sock:
        assert not peer_on_this_machine(sock)
        yields = _count_yields(monkeypatch)
        Channel(sock).send(Kind.SHARD_DATA, {}, data=[data])
    assert yields == []
    sent = HEADER.size + len(encode_body({})) + len(data) + protocol.TRAILER.size
    assert int(sink.stdout.readline()) == sent
