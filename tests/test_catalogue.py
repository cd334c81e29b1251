"""dash-memd's catalogue: commit only when whole, retention, eviction, pinning."""

import dataclasses
import os
import threading

import pytest

from dashrun.errors import ConflictError, NoSpaceError, NotFoundError
from dashrun.memd.store.catalogue import Catalogue, State
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import crc32c

LAYOUT = "ef" * 32


def headers(job="j", step=1, world=2, rep_total=4096, tail=64, layout=LAYOUT):
    cut = [rep_total * r // world for r in range(world + 1)]
    return [ShardHeader(job, step, r, world, rep_total, cut[r], cut[r + 1], tail - 16, 16, layout)
            for r in range(world)]


def deliver(cat, header, payload=None):
    payload = payload if payload is not None else os.urandom(header.nbytes)
    ticket = cat.receiver.begin_shard(header)
    ticket.buffer[:header.nbytes] = payload
    return cat.receiver.finish_shard(ticket, crc32c(payload)), payload


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
    with cat.open_shard("j", 1, 2) as (view, crc, _marks):
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
        while cat.disk_writer.persist_next(timeout=0):
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
        while cat.disk_writer.persist_next(timeout=0):
            pass
    step1 = {c["step"]: c["tiers"] for c in cat.jobs()[0]["checkpoints"]}[1]
    assert step1 == ["disk"]
    with cat.open_shard("j", 1, 1) as (view, _crc, _marks):
        assert bytes(view) == payloads[(1, 1)]


def test_full_ram_refuses_only_what_cannot_fit_safely(tmp_path):
    cat = Catalogue(RamTier(40_000), DiskTier(tmp_path / "d"), keep_ram=5, keep_disk=5)  # 2 checkpoints fit
    cat.retention.room_wait = 0.2  # no disk writer runs here: waiting for room would not help
    for header in headers(step=1, rep_total=8192):   # ~8 KiB in RAM, not yet on disk
        deliver(cat, header)
    for header in headers(step=2, rep_total=8192):
        deliver(cat, header)
    with pytest.raises(NoSpaceError, match="not yet safe on disk"):
        deliver(cat, headers(step=3, rep_total=8192)[0])
    assert cat.latest("j").step == 2            # the previous checkpoint stays valid
    assert (cat.ledger.evictions, cat.ledger.room_waits) == (0, 1)  # what the metrics of RAM pressure count
    assert cat.ledger.room_wait_s >= 0.2
    while cat.disk_writer.persist_next(timeout=0):
        pass
    for header in headers(step=3, rep_total=8192):  # now older ones can be evicted to make room
        deliver(cat, header)
    assert cat.latest("j").step == 3
    assert cat.ledger.evictions >= 1 and cat.ledger.room_waits == 1
    with pytest.raises(NoSpaceError, match="exceeds"):
        cat.receiver.begin_shard(headers(step=4, rep_total=1 << 20, world=1)[0])


def test_a_reader_pins_the_checkpoint(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=1, keep_disk=1)
    payload = {}
    for header in headers(step=1):
        payload[header.rank] = deliver(cat, header)[1]
    cat.disk_writer.persist_next(timeout=0)
    with cat.open_shard("j", 1, 0) as (view, _, _marks):
        for step in (2, 3):
            for header in headers(step=step):
                deliver(cat, header)
            while cat.disk_writer.persist_next(timeout=0):
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
    cat.disk_writer.persist_next(timeout=0)
    reborn = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    assert reborn.load_disk() == []
    assert reborn.latest("j").step == 4
    with reborn.open_shard("j", 4, 1) as (view, _, _marks):
        assert bytes(view) == payloads[1]


def test_once_a_checkpoint_is_on_disk_the_buffers_of_the_next_one_are_ready(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=2, keep_disk=2)
    for header in headers(step=1):
        deliver(cat, header)
    assert not [buf for bufs in cat.ram._free.values() for buf in bufs]
    assert cat.disk_writer.persist_next(timeout=5)
    ready = [buf for bufs in cat.ram._free.values() for buf in bufs]
    assert len(ready) == 2                                 # one per shard of the job
    tickets = [cat.receiver.begin_shard(header) for header in headers(step=2)]
    assert all(any(ticket.buffer is buf for buf in ready) for ticket in tickets)
    for ticket in tickets:
        cat.receiver.abort_shard(ticket)


def test_a_state_changes_only_forward_through_the_checked_transition():
    from dashrun.memd.store.entry import Entry, State

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


class DiskWithAHook(DiskTier):
    """The disk tier, running ``during_put`` once as the next write begins (the disk writer's thread is busy)."""

    during_put = None

    def put(self, info, shards, **kwargs):
        hook, self.during_put = self.during_put, None
        if hook is not None:
            hook()
        return super().put(info, shards, **kwargs)


@pytest.mark.parametrize("keep", [0, 1], ids=["rm", "gc"])
def test_a_step_deleted_while_it_is_written_to_disk_stays_deleted(tmp_path, keep):
    cat = Catalogue(RamTier(1 << 20), DiskWithAHook(tmp_path / "d"), keep_ram=2, keep_disk=3)
    for step in (1, 2):
        for header in headers(step=step):
            deliver(cat, header)
    cat.disk.during_put = lambda: cat.delete("j", keep)  # rm, or gc --keep 1: step 1 goes while it is written
    assert cat.disk_writer.persist_next(timeout=0)
    assert not cat.disk.step_dir("j", 1).exists()
    while cat.disk_writer.persist_next(timeout=0):
        pass
    reborn = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    reborn.load_disk()
    assert sorted(reborn.ledger.committed.get("j", {})) == ([] if keep == 0 else [2])


def test_rm_removes_every_copy_of_the_job_on_disk_also_one_the_catalogue_forgot(tmp_path):
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=1, keep_disk=3)
    for step in (3, 4):
        for header in headers(step=step):
            deliver(cat, header)
        cat.disk_writer.persist_next(timeout=0)
    # A new attempt at step 3 (another layout) replaces the one on disk in the catalogue, and as step 4 is
    # on disk already it is dropped at once: the catalogue forgets step 3, its old copy stays on disk.
    for header in headers(step=3, layout="cd" * 32):
        deliver(cat, header)
    assert cat.latest("j", 3) is None and cat.disk.step_dir("j", 3).exists()
    cat.delete("j")
    reborn = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    reborn.load_disk()
    assert reborn.jobs() == []


def test_a_copy_of_a_shard_whose_first_copy_still_arrives_replaces_it_and_a_late_duplicate_is_refused(cat):
    first, second = headers()
    ended = []
    original = cat.receiver.begin_shard(first, cancel=lambda: ended.append("first"))
    free = cat.ram.limit - cat.ram.used
    # The agent's retry after its link dropped mid-shard: the stalled receive is ended at once, the copy taken.
    again = cat.receiver.begin_shard(first)
    assert ended == ["first"]
    payload = os.urandom(first.nbytes)
    again.buffer[:first.nbytes] = payload
    original.buffer[:first.nbytes] = os.urandom(first.nbytes)
    with pytest.raises(ConflictError, match="newer copy"):  # the first copy, should it still complete
        cat.receiver.finish_shard(original, crc32c(original.buffer[:first.nbytes]))
    assert cat.ram.limit - cat.ram.used == free  # its buffer went back
    assert cat.receiver.finish_shard(again, crc32c(payload)) is False
    assert deliver(cat, second)[0] is True
    used = cat.ram.used
    with pytest.raises(ConflictError, match="already committed"):  # a zombie node's copy, after the commit
        cat.receiver.begin_shard(first)
    cat.disk_writer.persist_next(timeout=0)
    with cat.open_shard("j", 1, 0) as (view, crc, _marks):
        assert bytes(view) == payload and crc == crc32c(payload)
    assert cat.ram.used == used
    held = [id(buf) for buf in cat.ledger.committed["j"][1].buffers.values()]
    assert not set(held) & {id(buf) for bufs in cat.ram._free.values() for buf in bufs}


def test_a_shard_sent_again_before_the_commit_replaces_the_first_and_never_frees_a_committed_buffer(cat):
    first, second = headers()
    deliver(cat, first)                   # rank 0 arrived; then its agent, unsure, sends it again
    again = cat.receiver.begin_shard(first)
    payload = os.urandom(first.nbytes)
    again.buffer[:first.nbytes] = payload
    committed, _ = deliver(cat, second)   # the checkpoint commits with rank 0's first copy meanwhile
    assert committed
    used = cat.ram.used
    with cat.open_shard("j", 1, 0) as (view, crc, _marks):
        before = bytes(view)
    assert cat.receiver.finish_shard(again, crc32c(before)) is True  # the same shard: it is stored
    assert cat.ram.used == used - len(again.buffer)         # its own buffer went back, not a committed one
    with cat.open_shard("j", 1, 0) as (view, crc, _marks):
        assert bytes(view) == before and crc32c(before) == crc
    other = cat.receiver.begin_shard(headers(step=2)[0])              # reused buffers are not the committed ones
    assert all(other.buffer is not buf for buf in cat.ledger.committed["j"][1].buffers.values())
    cat.receiver.abort_shard(other)


def test_a_new_attempt_at_a_step_that_never_committed_commits(cat):
    first, second = headers(step=7)
    deliver(cat, first)                   # a rank died before sending: the job restarts at the same step
    fresh = [deliver(cat, header)[1] for header in (first, second)]
    assert cat.latest("j").step == 7
    with cat.open_shard("j", 7, 0) as (view, _, _marks):
        assert bytes(view) == fresh[0]
    assert cat.ram.used == sum(len(b) for b in cat.ledger.committed["j"][7].buffers.values())


def test_a_step_is_never_made_of_two_runs_shards(cat):
    """A run that began fresh crashed after rank 0 sent step 9; the run that restored step 4 redoes it, rank 1
    first: the crashed run's shard leaves the step, which commits with the redoing run's shards only, and a late
    shard of the crashed run is refused."""
    crashed = [dataclasses.replace(h, base=-1) for h in headers(step=9)]
    redone = [dataclasses.replace(h, base=4) for h in headers(step=9)]
    _, old = deliver(cat, crashed[0])
    committed, _ = deliver(cat, redone[1])
    assert not committed                 # rank 0 of the crashed run does not complete the redoing run's step
    committed, new = deliver(cat, redone[0])
    assert committed
    with cat.open_shard("j", 9, 0) as (view, _, _marks):
        assert bytes(view) == new != old
    late = [dataclasses.replace(h, base=-1) for h in headers(step=10)]
    deliver(cat, dataclasses.replace(headers(step=10)[0], base=4))
    with pytest.raises(ConflictError, match="run that began at step -1, while a run that began at step 4"):
        cat.receiver.begin_shard(late[1])
    assert cat.ram.used == sum(len(b) for e in cat.ledger.committed["j"].values() for b in e.buffers.values()) + \
        sum(len(b) for e in cat.ledger.receiving.values() for b in e.buffers.values())


def test_a_receive_that_finds_no_room_leaves_no_empty_entry(tmp_path):
    cat = Catalogue(RamTier(40_000), DiskTier(tmp_path / "d"), keep_ram=5, keep_disk=5)
    cat.retention.room_wait = 0.2  # no disk writer runs here: waiting for room would not help
    for header in headers(step=1, rep_total=8192) + headers(step=2, rep_total=8192):
        deliver(cat, header)
    with pytest.raises(NoSpaceError):
        cat.receiver.begin_shard(headers(step=3, rep_total=8192)[0])
    assert cat.jobs()[0]["receiving"] == []


def marks_of(payload: bytes):
    from dashrun.wire.blocks import BLOCK, Marks
    return Marks("I", [crc32c(payload[:min(j * BLOCK, len(payload))]) for j in range(-(-len(payload) // BLOCK) + 1)])


def test_a_bad_ram_copy_held_nowhere_else_leaves_the_catalogue_once_no_one_reads_it(cat):
    """Found changed while it was read (before the disk writer got to it): the checkpoint before it is the
    newest from then on, and the bad copy's RAM goes back once its last reader is done."""
    from dashrun.errors import ChecksumError
    from dashrun.wire.blocks import range_crc

    for step in (1, 2):
        for header in headers(step=step):
            payload = os.urandom(header.nbytes)
            ticket = cat.receiver.begin_shard(header)
            ticket.buffer[:header.nbytes] = payload
            cat.receiver.finish_shard(ticket, crc32c(payload), marks_of(payload))
    used = cat.ram.used
    with cat.open_shard("j", 2, 1) as (view, _, marks):
        view[10] ^= 1  # a bit flipped in RAM
        with pytest.raises(ChecksumError) as failure:
            range_crc(view, marks, 5, 20)
        cat.ram_copy_failed("j", 2, 1, marks, failure.value)
        assert cat.latest("j").step == 1 and cat.ram.used == used  # still read here: its RAM stays meanwhile
        cat.ram_copy_failed("j", 2, 1, marks, failure.value)      # reported twice: once is enough
    assert cat.ram.used < used
    with pytest.raises(NotFoundError):
        with cat.open_shard("j", 2, 0):
            pass
    with cat.open_shard("j", 1, 0) as (view, _, marks):
        assert marks is not None and range_crc(view, marks, 0, len(view)) == crc32c(view)


def test_a_bad_ram_copy_also_on_disk_is_read_from_disk(cat):
    from dashrun.errors import ChecksumError

    for header in headers(step=1):
        deliver(cat, header)
    cat.disk_writer.persist_next(timeout=0)
    with cat.open_shard("j", 1, 0) as (view, crc, _):
        before = bytes(view)
    kept = cat.ledger.committed["j"][1].marks
    kept[0] = marks_of(before)  # as PUT_SHARD keeps them (deliver() kept none)
    cat.ram_copy_failed("j", 1, 0, kept[0], ChecksumError("a bit flipped"))
    entry = cat.ledger.committed["j"][1]
    assert entry.tiers == {"disk"} and not entry.buffers and cat.ram.used == 0
    with cat.open_shard("j", 1, 0) as (view, crc2, marks):
        assert bytes(view) == before and crc2 == crc and marks is None  # the disk copy, checked whole


def test_a_checkpoint_whose_ram_copy_changed_before_its_disk_write_never_reaches_the_disk(cat, caplog):
    """The disk writer checks the bytes it writes against their checksums from when they arrived: a bit
    flipped in RAM meanwhile leaves no copy of it on disk, trims nothing, and the one before it stays the
    newest, whole."""
    payloads = {}
    for step in (1, 2, 3):
        for header in headers(step=step):
            payloads[(step, header.rank)] = deliver(cat, header)[1]
        if step < 3:
            while cat.disk_writer.persist_next(timeout=0):
                pass
    third = cat.ledger.committed["j"][3]
    third.buffers[1][7] ^= 0x10  # a bit flipped after it arrived, before its write
    used = cat.ram.used
    assert cat.disk_writer.persist_next(timeout=0)
    assert "step 3: not written to disk" in caplog.text and "have changed in RAM" in caplog.text
    assert not cat.disk.step_dir("j", 3).exists()
    assert not [p for p in cat.disk.step_dir("j", 3).parent.iterdir() if p.name.startswith(".tmp")]
    newest = cat.latest("j")
    assert newest.step == 2 and cat.disk.step_dir("j", 1).exists()  # keep_disk=2: nothing trimmed for it
    with pytest.raises(NotFoundError):
        with cat.open_shard("j", 3, 0):
            pass
    for rank in (0, 1):
        with cat.open_shard("j", 2, rank) as (view, crc, _):
            assert bytes(view) == payloads[(2, rank)] and crc == crc32c(view)
    assert not third.buffers and cat.ram.used < used  # step 3's RAM given back
    assert cat.jobs()[0]["bad_ram"] == 1  # for dashrun status: this machine's memory may be failing
    restarted = Catalogue(RamTier(1 << 20), DiskTier(cat.disk.root), keep_ram=2, keep_disk=2)
    restarted.load_disk()
    assert restarted.latest("j").step == 2
