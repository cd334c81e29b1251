"""dash-memd's catalogue: commit only when whole, retention, eviction, pinning."""

import os
import threading

import pytest

from dashrun.errors import ConflictError, NoSpaceError, NotFoundError
from dashrun.memd.catalogue import Catalogue, State
from dashrun.memd.tiers import DiskTier, RamTier
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import crc32c

LAYOUT = "ef" * 32


def headers(job="j", step=1, world=2, rep_total=4096, tail=64, layout=LAYOUT):
    cut = [rep_total * r // world for r in range(world + 1)]
    return [ShardHeader(job, step, r, world, rep_total, cut[r], cut[r + 1], tail - 16, 16, layout)
            for r in range(world)]


def deliver(cat, header, payload=None):
    payload = payload if payload is not None else os.urandom(header.nbytes)
    ticket = cat.begin_shard(header)
    ticket.buffer[:header.nbytes] = payload
    return cat.finish_shard(ticket, crc32c(payload)), payload


@pytest.fixture
def cat(tmp_path):
    return Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "disk"), keep_ram=2, keep_disk=2)


def test_invisible_until_every_rank_arrived(cat):
    first, second, third = headers(world=3)
    assert deliver(cat, first)[0] is False
    assert deliver(cat, second)[0] is False
    assert cat.latest("j") is None
    with pytest.raises(NotFoundError):
        with cat.open_shard("j", 1, 0):
            pass
    committed, payload = deliver(cat, third)
    assert committed and cat.latest("j").step == 1
    with cat.open_shard("j", 1, 2) as (view, crc):
        assert bytes(view) == payload and crc == crc32c(payload)


def test_ranks_disagreeing_on_the_layout_never_commit(cat):
    first, second = headers()
    deliver(cat, first)
    bad = ShardHeader(**{**second.__dict__, "layout": "00" * 32})
    deliver(cat, bad)  # another layout: a new attempt replaces the incomplete one
    assert cat.latest("j") is None
    leaves_a_gap = ShardHeader(**{**first.__dict__, "rep_end": 1024, "layout": "00" * 32})
    with pytest.raises(ConflictError, match="does not follow"):
        deliver(cat, leaves_a_gap)
    assert cat.latest("j") is None and cat.ram.used == 0


def test_newest_committed_wins_and_stale_partials_are_dropped(cat):
    deliver(cat, headers(step=5)[0])          # step 5 never completes (a rank died)
    for header in headers(step=6):
        deliver(cat, header)
    assert cat.latest("j").step == 6
    assert cat.jobs()[0]["receiving"] == []   # step 5's partial shard was freed
    assert cat.latest("j", 5) is None


def test_persisted_then_evicted_from_ram_by_retention(cat):
    payloads = {}
    for step in (1, 2, 3):
        for header in headers(step=step):
            payloads[(step, header.rank)] = deliver(cat, header)[1]
        while cat.persist_next(timeout=0):
            pass
    jobs = {c["step"]: c for c in cat.jobs()[0]["checkpoints"]}
    assert jobs[3]["tiers"] == ["disk", "ram"] and jobs[2]["tiers"] == ["disk", "ram"]
    assert 1 not in jobs  # keep_disk=2: deleted from disk, and from RAM before that
    assert not cat.disk.step_dir("j", 1).exists()
    assert cat.latest("j").step == 3 and jobs[3]["state"] == State.ON_DISK.value


def test_reads_fall_back_to_disk_after_eviction(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=1, keep_disk=3)
    payloads = {}
    for step in (1, 2):
        for header in headers(step=step):
            payloads[(step, header.rank)] = deliver(cat, header)[1]
        while cat.persist_next(timeout=0):
            pass
    step1 = {c["step"]: c["tiers"] for c in cat.jobs()[0]["checkpoints"]}[1]
    assert step1 == ["disk"]
    with cat.open_shard("j", 1, 1) as (view, _crc):
        assert bytes(view) == payloads[(1, 1)]


def test_full_ram_refuses_only_what_cannot_fit_safely(tmp_path):
    cat = Catalogue(RamTier(40_000), DiskTier(tmp_path / "d"), keep_ram=5, keep_disk=5)  # 2 checkpoints fit
    for header in headers(step=1, rep_total=8192):   # ~8 KiB in RAM, not yet on disk
        deliver(cat, header)
    for header in headers(step=2, rep_total=8192):
        deliver(cat, header)
    with pytest.raises(NoSpaceError, match="not yet safe on disk"):
        deliver(cat, headers(step=3, rep_total=8192)[0])
    assert cat.latest("j").step == 2            # the previous checkpoint stays valid
    while cat.persist_next(timeout=0):
        pass
    for header in headers(step=3, rep_total=8192):  # now older ones can be evicted to make room
        deliver(cat, header)
    assert cat.latest("j").step == 3
    with pytest.raises(NoSpaceError, match="exceeds"):
        cat.begin_shard(headers(step=4, rep_total=1 << 20, world=1)[0])


def test_a_reader_pins_the_checkpoint(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=1, keep_disk=1)
    payload = {}
    for header in headers(step=1):
        payload[header.rank] = deliver(cat, header)[1]
    cat.persist_next(timeout=0)
    with cat.open_shard("j", 1, 0) as (view, _):
        for step in (2, 3):
            for header in headers(step=step):
                deliver(cat, header)
            while cat.persist_next(timeout=0):
                pass
        assert bytes(view) == payload[0]        # not freed or overwritten under the reader
    assert cat.latest("j").step == 3


def test_wait_returns_when_committed(cat):
    first, second = headers(step=9)
    deliver(cat, first)
    assert cat.wait("j", 9, timeout=0.05) is False
    threading.Timer(0.1, deliver, args=(cat, second)).start()
    assert cat.wait("j", 9, timeout=10) is True


def test_rebuilt_from_disk_after_a_restart(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    payloads = {}
    for header in headers(step=4):
        payloads[header.rank] = deliver(cat, header)[1]
    cat.persist_next(timeout=0)
    reborn = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    assert reborn.load_disk() == []
    assert reborn.latest("j").step == 4
    with reborn.open_shard("j", 4, 1) as (view, _):
        assert bytes(view) == payloads[1]


def test_once_a_checkpoint_is_on_disk_the_buffers_of_the_next_one_are_ready(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=2, keep_disk=2)
    for header in headers(step=1):
        deliver(cat, header)
    assert not [buf for bufs in cat.ram._free.values() for buf in bufs]
    assert cat.persist_next(timeout=5)
    ready = [buf for bufs in cat.ram._free.values() for buf in bufs]
    assert len(ready) == 2                                 # one per shard of the job
    tickets = [cat.begin_shard(header) for header in headers(step=2)]
    assert all(any(ticket.buffer is buf for buf in ready) for ticket in tickets)
    for ticket in tickets:
        cat.abort_shard(ticket)


def test_a_state_changes_only_forward_through_the_checked_transition():
    from dashrun.memd.entry import Entry, State

    entry = Entry("job", 1, 1, 64, "ab" * 32)
    with pytest.raises(AttributeError, match="only through advance"):
        entry.state = State.ON_DISK
    with pytest.raises(AssertionError, match="receiving -> on_disk is not allowed"):
        entry.advance(State.ON_DISK)
    entry.advance(State.COMMITTED)
    entry.advance(State.ON_DISK)
    with pytest.raises(AssertionError, match="on_disk -> committed"):
        entry.advance(State.COMMITTED)
    assert entry.state == State.ON_DISK
    assert Entry("job", 2, 1, 64, "ab" * 32, state=State.IN_OBJECT_STORE).state == State.IN_OBJECT_STORE
