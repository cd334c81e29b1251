"""A shard's marks (its CRC-32C at every block's end, kept as it arrived) and the checksums of ranges from them."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading

import pytest

from dashrun.errors import ChecksumError
from dashrun.wire import blocks, channel
from dashrun.wire.blocks import BLOCK, Marks, check_marks, range_crc, shift_block
from dashrun.wire.channel import Channel
from dashrun.wire.messages import ShardHeader
from dashrun.wire.planner import MemdSource, Planner, replicated_span
from dashrun.wire.protocol import Kind, crc32c


def received(payload: bytes, views_at: tuple[int, ...] = ()) -> tuple[bytearray, Marks, int]:
    """``payload`` sent over a real socket and received into a buffer (split into views at ``views_at``),
    with the marks the receive took."""
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    thread = threading.Thread(target=sender.send, args=(Kind.SHARD_DATA, {}), kwargs={"data": [payload]})
    thread.start()
    try:
        into = bytearray(len(payload))
        cuts = [0, *views_at, len(payload)]
        views = [memoryview(into)[lo:hi] for lo, hi in zip(cuts, cuts[1:])]
        marks = Marks("I", [7, 7])  # emptied by the receive
        crc = receiver.recv_data_into(receiver.recv(max_data=len(payload)), views, marks)
    finally:
        thread.join()
        sender.close()
        receiver.close()
    return into, marks, crc


def test_shifting_by_a_block_is_what_appending_a_block_does():
    rng = random.Random(1)
    for _ in range(3):
        a, b = rng.randbytes(rng.randrange(1, 5000)), rng.randbytes(BLOCK)
        assert crc32c(a + b) == shift_block(crc32c(a)) ^ crc32c(b)
    assert shift_block(0) == 0


@pytest.mark.parametrize("landed", [True, False], ids=["landing-buffer", "straight"])
@pytest.mark.parametrize("nbytes, views_at", [
    (3 * BLOCK + 12345, ()),
    (2 * BLOCK, (BLOCK - 5, BLOCK + 700)),  # views that cut blocks: the marks still fall on blocks' ends
    (100, ()),
    (0, ()),
])
def test_a_receive_marks_every_blocks_end_and_ranges_check_as_their_bytes_do(nbytes, views_at, landed,
                                                                              monkeypatch):
    if not landed:  # as without the C helper, and as a sealed record is received
        monkeypatch.setattr(channel, "_ntcopy", None)
    elif channel._ntcopy is None:
        pytest.skip("the C helper is not built here")
    payload = os.urandom(nbytes)
    into, marks, crc = received(payload, views_at)
    assert bytes(into) == payload and crc == crc32c(payload)
    check_marks(marks, nbytes, crc)
    assert list(marks) == [crc32c(payload[:min(j * BLOCK, nbytes)]) for j in range(len(marks))]
    edges = sorted({0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, nbytes - 1, nbytes, nbytes // 2}
                   & set(range(nbytes + 1)))
    rng = random.Random(nbytes)
    ranges = [(lo, hi) for lo in edges for hi in edges if lo <= hi]
    ranges += [tuple(sorted((rng.randrange(nbytes + 1), rng.randrange(nbytes + 1)))) for _ in range(20)]
    view = memoryview(into)
    for lo, hi in ranges:
        assert range_crc(view, marks, lo, hi) == crc32c(payload[lo:hi]), (lo, hi)
    with pytest.raises(ValueError):
        range_crc(view, marks, 0, nbytes + 1)


def test_bytes_changed_at_rest_are_not_vouched_for():
    payload = os.urandom(4 * BLOCK + 99)
    into, marks, _ = received(payload)
    view = memoryview(into)
    into[2 * BLOCK + 10] ^= 1  # a bit flipped in RAM, inside a block the range holds whole
    start, stop = BLOCK + 3, 3 * BLOCK + 50
    assert range_crc(view, marks, start, stop) == crc32c(payload[start:stop]) != crc32c(into[start:stop])
    into[BLOCK + 1] ^= 1  # and one in the block at the range's edge, before its start: read and checked
    with pytest.raises(ChecksumError, match="changed in RAM"):
        range_crc(view, marks, start, stop)
    assert range_crc(view, marks, 2 * BLOCK, 3 * BLOCK) == crc32c(payload[2 * BLOCK:3 * BLOCK])


def test_marks_of_another_shape_are_refused():
    payload = os.urandom(BLOCK + 1)
    _, marks, crc = received(payload)
    for wrong in (Marks("I", marks[:-1]), Marks("I", [1, *marks[1:]])):
        with pytest.raises(ValueError):
            check_marks(wrong, len(payload), crc)
    with pytest.raises(ValueError):
        check_marks(marks, len(payload), crc ^ 1)


def test_a_range_served_from_ram_reads_only_its_edge_blocks(monkeypatch):
    """The point of the marks: dash-memd's send of a range does not read it again to checksum it."""
    payload = os.urandom(8 * BLOCK)
    into, marks, _ = received(payload)
    read = []
    monkeypatch.setattr(blocks, "crc32c", lambda data, value=0: read.append(len(data)) or crc32c(data, value))
    assert range_crc(memoryview(into), marks, BLOCK, 7 * BLOCK) == crc32c(payload[BLOCK:7 * BLOCK])
    assert sum(read) == 0
    assert range_crc(memoryview(into), marks, BLOCK + 10, 7 * BLOCK - 10) == crc32c(payload[BLOCK + 10:7 * BLOCK - 10])
    assert sum(read) <= 4 * BLOCK


def test_bytes_changed_in_dash_memds_ram_are_never_served_and_its_disk_copy_is_read(memd):
    """A bit flipped in dash-memd's RAM copy of a shard (written through /proc/PID/mem): a range holding that
    block whole fails the reader's check; a range with that block at its edge, dash-memd's own, which drops its
    RAM copy: from then on the checkpoint is read from its disk copy, intact."""
    payload = os.urandom(4 * BLOCK)
    with memd.client() as client:
        put_on_disk(client, "at-rest", payload)
        flip_in_memory(memd.proc.pid, payload, 2 * BLOCK + 5)
        got = bytearray(2 * BLOCK)
        client.get_shard_into("at-rest", 1, 0, [memoryview(got)], offset=0)  # the blocks before it: served
        assert bytes(got) == payload[:2 * BLOCK]
        with pytest.raises(ChecksumError):  # dash-memd vouched for the bytes as they arrived: the reader's check
            client.get_shard_into("at-rest", 1, 0, [memoryview(got)], offset=BLOCK)
        with pytest.raises(ChecksumError, match="changed in RAM"):  # an edge block: read and checked there
            client.get_shard_into("at-rest", 1, 0, [memoryview(got)[:BLOCK]], offset=2 * BLOCK + 7)
        whole = bytearray(len(payload))
        client.get_shard_into("at-rest", 1, 0, [memoryview(whole)])
        assert bytes(whole) == payload
        assert client.ping()
    assert "the RAM copy is bad" in memd.log() and "read from disk instead" in memd.log()
    status = subprocess.run([sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file",
                             str(memd.token_file), *memd.tls_args], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "at-rest: 1 RAM copy changed in dash-memd's memory" in " ".join(status.stdout.split())


def test_a_read_that_fails_its_check_has_dash_memd_check_its_copy_and_gets_the_intact_one(memd):
    payload = os.urandom(4 * BLOCK)
    with memd.client() as client:
        put_on_disk(client, "checked", payload)
        flip_in_memory(memd.proc.pid, payload, 2 * BLOCK + 5)
        got = bytearray(2 * BLOCK)
        client.get_shard_checked_into("checked", 1, 0, [memoryview(got)], offset=BLOCK)
        assert bytes(got) == payload[BLOCK:3 * BLOCK]
        info = client.latest("checked")
    got = bytearray(len(payload))  # and through the restore's planner, as the agent reads
    Planner([MemdSource(memd.client)]).read(info, replicated_span(info, 0, len(payload)), memoryview(got))
    assert bytes(got) == payload
    assert "the RAM copy is bad" in memd.log()


def put_on_disk(client, job: str, payload: bytes) -> None:
    header = ShardHeader(job, 1, 0, 1, len(payload), 0, len(payload), 0, 0, "ab" * 32)
    assert client.put_shard(header, [payload])["committed"]
    assert client.wait(job, 1, 60, on_disk=True)


def flip_in_memory(pid: int, payload: bytes, at: int) -> None:
    """Flip one bit of the copy of ``payload`` in process ``pid``'s memory, ``at`` bytes into it."""
    address = find_in_memory(pid, payload[:4096])
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(address + at)
        (byte,) = mem.read(1)
        mem.seek(address + at)
        mem.write(bytes([byte ^ 0x10]))


def find_in_memory(pid: int, needle: bytes) -> int:
    """The address of ``needle`` in the writable memory of process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if "w" not in fields[1]:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for at in range(start, end, 64 << 20):
                mem.seek(at)
                try:
                    chunk = mem.read(min((64 << 20) + len(needle), end - at))
                except OSError:  # not readable this way ([vvar] and the like)
                    break
                found = chunk.find(needle)
                if found >= 0:
                    return at + found
    raise AssertionError("the shard's bytes are not in dash-memd's memory")
