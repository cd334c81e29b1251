"""dash-memd's disk failing under it: the writer never dies, a failed write is tried again, a stop names what it loses.

In-process tests inject the fault into the disk tier (an OSError from its put or delete, an error nobody foresaw);
the end-to-end ones give a real dash-memd a real full file system (a small tmpfs) and a real SIGTERM.
"""

from __future__ import annotations

import errno
import os
import signal

import pytest
from conftest import wait_for

from dashrun.errors import NoSpaceError
from dashrun.memd.store import disk_writer
from dashrun.memd.store.catalogue import Catalogue, State
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import crc32c

LAYOUT = "ef" * 32


def header(job: str, step: int, nbytes: int = 4096) -> ShardHeader:
    return ShardHeader(job, step, 0, 1, nbytes - 64, 0, nbytes - 64, 48, 16, LAYOUT)


def commit(cat: Catalogue, job: str, step: int, nbytes: int = 4096) -> bytes:
    h = header(job, step, nbytes)
    payload = os.urandom(h.nbytes)
    ticket = cat.receiver.begin_shard(h)
    ticket.buffer[:h.nbytes] = payload
    assert cat.receiver.finish_shard(ticket, crc32c(payload))
    return payload


class FlakyDisk(DiskTier):
    """The real disk tier, whose next ``put_faults`` writes and ``delete_faults`` deletions fail as a disk does."""

    def __init__(self, path):
        super().__init__(path)
        self.put_faults: list[BaseException] = []
        self.delete_faults: list[BaseException] = []

    def put(self, *args, **kwargs):
        if self.put_faults:
            raise self.put_faults.pop(0)
        return super().put(*args, **kwargs)

    def delete(self, job, step):
        if self.delete_faults:
            raise self.delete_faults.pop(0)
        super().delete(job, step)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(disk_writer, "RETRY_FIRST", 0.01)
    monkeypatch.setattr(disk_writer, "RETRY_LONGEST", 0.05)


@pytest.fixture
def flaky(tmp_path):
    disk = FlakyDisk(tmp_path / "disk")
    return disk, Catalogue(RamTier(1 << 20), disk, keep_ram=2, keep_disk=2)


def states(cat: Catalogue, job: str) -> dict[int, str]:
    return {c["step"]: c["state"] for c in next(j for j in cat.jobs() if j["job"] == job)["checkpoints"]}


def summary(cat: Catalogue, job: str) -> dict:
    return next(j for j in cat.jobs() if j["job"] == job)


def run_writer_until(cat: Catalogue, predicate, what: str) -> None:
    def step():
        cat.disk_writer.persist_next(timeout=0.01)
        return predicate()
    wait_for(step, 10, what, interval=0)


def test_a_failed_disk_write_is_written_again_once_the_disk_works(flaky):
    disk, cat = flaky
    disk.put_faults = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EIO, "Input/output error")]
    commit(cat, "j", 5)
    assert cat.disk_writer.persist_next(timeout=1)  # the first write fails
    assert states(cat, "j") == {5: "committed"} and cat.disk_writer.pending() == 1
    assert summary(cat, "j")["disk_error"] == "No space left on device"
    # Nothing new is committed: the writer tries the same checkpoint again by itself, until the disk takes it.
    run_writer_until(cat, lambda: states(cat, "j") == {5: "on_disk"}, "step 5 written again")
    job = summary(cat, "j")
    assert job["disk_error"] is None and job["disk_failures"] == 2 and cat.disk_writer.pending() == 0
    assert (disk.step_dir("j", 5)).is_dir()


def test_only_the_jobs_newest_checkpoint_not_on_disk_is_tried_again(flaky):
    disk, cat = flaky
    disk.put_faults = [OSError(errno.ENOSPC, "No space left on device")] * 2
    commit(cat, "j", 1)
    commit(cat, "j", 2)
    assert cat.disk_writer.persist_next(timeout=1) and cat.disk_writer.persist_next(timeout=1)  # both writes fail
    assert cat.disk_writer.pending() == 2  # every RAM-only committed checkpoint counts
    run_writer_until(cat, lambda: states(cat, "j").get(2) == "on_disk", "step 2 written again")
    # Step 2's write makes step 1 safe too (nothing is lost without it): it is never written, nor pending.
    assert cat.disk_writer.pending() == 0 and not disk.step_dir("j", 1).exists()
    assert cat.disk_writer.retries == {}


def test_a_failed_deletion_does_not_stop_the_writer_and_is_done_again(flaky):
    disk, cat = flaky
    for step in (1, 2):
        commit(cat, "j", step)
        assert cat.disk_writer.persist_next(timeout=1)
    disk.delete_faults = [OSError(errno.EIO, "Input/output error")]
    commit(cat, "j", 3)
    assert cat.disk_writer.persist_next(timeout=1)  # written; trimming step 1 (keep_disk=2) fails
    assert states(cat, "j") == {2: "on_disk", 3: "on_disk"} and disk.step_dir("j", 1).exists()
    assert summary(cat, "j")["disk_failures"] == 1
    commit(cat, "j", 4)
    run_writer_until(cat, lambda: states(cat, "j").get(4) == "on_disk", "step 4 written")
    assert not disk.step_dir("j", 1).exists() and not disk.step_dir("j", 2).exists()
    assert sorted(i.step for i in disk.scan()) == [3, 4]


def test_an_error_nobody_foresaw_is_a_failed_write_tried_again(flaky):
    disk, cat = flaky
    disk.put_faults = [RuntimeError("a bug in the tier")]
    commit(cat, "j", 7)
    assert cat.disk_writer.persist_next(timeout=1)  # does not raise
    assert "a bug in the tier" in summary(cat, "j")["disk_error"]
    run_writer_until(cat, lambda: states(cat, "j") == {7: "on_disk"}, "step 7 written again")


def test_a_receive_refused_for_room_names_the_failing_disk(tmp_path):
    disk = FlakyDisk(tmp_path / "disk")
    cat = Catalogue(RamTier(10_000), disk, keep_ram=2, keep_disk=2)
    cat.retention.room_wait = 0.05
    disk.put_faults = [OSError(errno.ENOSPC, "No space left on device")]
    commit(cat, "j", 1, nbytes=6000)
    assert cat.disk_writer.persist_next(timeout=1)
    with pytest.raises(NoSpaceError) as refused:
        cat.receiver.begin_shard(header("j", 2, nbytes=6000))
    assert "No space left on device" in str(refused.value) and "faster disk" not in str(refused.value)
    # The retry frees the RAM once the disk works again: the same receive then fits.
    run_writer_until(cat, lambda: states(cat, "j") == {1: "on_disk"}, "step 1 written again")
    cat.retention.trim_ram("j")
    commit(cat, "j", 2, nbytes=6000)
    assert states(cat, "j")[2] == State.COMMITTED.value


# --- a real dash-memd on a real full disk --------------------------------------------------------------------


def send(memd, job: str, step: int) -> None:
    h = header(job, step, 64 << 10)
    with memd.client() as client:
        assert client.put_shard(h, [os.urandom(h.nbytes)])["committed"]


def listing(memd, job: str) -> dict:
    with memd.client() as client:
        return next(j for j in client.list()["jobs"] if j["job"] == job)


def on_disk(memd, job: str) -> list[int]:
    return [c["step"] for c in listing(memd, job)["checkpoints"] if "disk" in c["tiers"]]


@pytest.mark.slow
def test_memd_writes_again_after_the_disk_frees_and_a_stop_names_every_step_it_loses(small_fs, memd_factory):
    fs = small_fs("4m")
    memd = memd_factory("--memory-limit", "64MiB", "--shutdown-timeout", "1", data_dir=fs.path / "data")
    filler = fs.fill()
    send(memd, "full", 29)
    send(memd, "full", 39)
    wait_for(lambda: listing(memd, "full")["disk_error"], 30, "the disk writes to fail")
    with memd.client() as client:
        assert client.list()["pending_disk_writes"] == 2
    filler.unlink()
    # Nothing more is sent: the writer tries the newest again by itself, and that write makes step 29 safe too.
    wait_for(lambda: on_disk(memd, "full") == [39], 60, "step 39 written once space is back", interval=0.1)
    with memd.client() as client:
        wait_for(lambda: client.list()["pending_disk_writes"] == 0, 30, "nothing pending")
    assert listing(memd, "full")["disk_error"] is None

    filler = fs.fill()
    send(memd, "full", 49)
    send(memd, "full", 59)
    wait_for(lambda: listing(memd, "full")["disk_error"], 30, "the disk writes to fail again")
    assert memd.proc.poll() is None
    memd.proc.send_signal(signal.SIGTERM)
    assert memd.proc.wait(timeout=60) == 0
    log = memd.log()
    assert "full: steps 49, 59 are in RAM only and lost with this stop; the newest on disk is step 39" in log, \
        log[-3000:]
