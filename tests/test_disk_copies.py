"""Disk copies checked against their CRC-32C: a bad one is quarantined and gives way, and a start lists
the disk without reading every shard (checked in the background instead)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from conftest import wait_for
from test_catalogue import deliver, headers
from test_object_store import checkpoint, drain, make_catalogue, read
from test_tiers import flip_byte, make_checkpoint

from dashrun.errors import ChecksumError, NotFoundError
from dashrun.memd.store.catalogue import Catalogue
from dashrun.memd.store.tiers import DiskTier, RamTier


def shard_file(disk: DiskTier, job: str, step: int, rank: int):
    return disk.step_dir(job, step) / f"rank-{rank:05d}.bin"


def restarted_with_steps(tmp_path, steps) -> tuple[Catalogue, dict]:
    """A catalogue that wrote ``steps`` of job "j" to disk, then a new one over the same disk (as after a
    restart: no RAM copies, every read goes to disk)."""
    first = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    payloads = {}
    for step in steps:
        for header in headers(step=step):
            payloads[(step, header.rank)] = deliver(first, header)[1]
        assert first.disk_writer.persist_next(timeout=5)
    reborn = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    assert reborn.load_disk() == []
    return reborn, payloads


def test_a_bad_disk_copy_is_quarantined_and_the_checkpoint_before_it_served(tmp_path):
    cat, payloads = restarted_with_steps(tmp_path, (1, 2))
    flip_byte(shard_file(cat.disk, "j", 2, 1))
    with pytest.raises(ChecksumError, match="fails its checksum"):
        with cat.open_shard("j", 2, 1):
            pass
    assert cat.latest("j").step == 1                        # what the agent's next request gets
    (moved,) = (tmp_path / "d" / "quarantine" / "j").iterdir()
    assert moved.name.startswith(f"{2:016d}-") and not cat.disk.step_dir("j", 2).exists()
    summary = cat.jobs()[0]
    assert summary["quarantined"] == 1 and [c["step"] for c in summary["checkpoints"]] == [1]
    with cat.open_shard("j", 1, 1) as (view, _, _marks):
        assert bytes(view) == payloads[(1, 1)]

    shard_file(cat.disk, "j", 1, 0).unlink()                # a copy gone from under dash-memd gives way too
    with pytest.raises(NotFoundError):
        with cat.open_shard("j", 1, 0):
            pass
    assert cat.latest("j") is None and cat.ram.used == 0


def test_a_start_lists_without_reading_and_checks_every_jobs_newest_first(tmp_path):
    disk = DiskTier(tmp_path / "d")
    for job, steps in (("job-a", (1, 2, 3)), ("job-b", (5, 6))):
        for step in steps:
            info, data = make_checkpoint(job=job, step=step)
            disk.put(info, [memoryview(d) for d in data])
    flip_byte(shard_file(disk, "job-a", 3, 2))
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    assert cat.load_disk() == []
    assert cat.latest("job-a").step == 3                    # listed from its manifest, not read yet
    order = list(dict.fromkeys((e.job, e.step) for e, *_ in cat.verifier.pending))
    assert set(order[:2]) == {("job-a", 3), ("job-b", 6)} and order[2:4] == [("job-b", 5), ("job-a", 2)]
    cat.verifier.part = 1000                                # each shard (~1.1 kB) is read in two parts
    checked = 0
    while cat.verifier.next():
        checked += 1
    assert checked == 5 * 3 * 2 and cat.verifier.unverified() == 0
    assert cat.latest("job-a").step == 2 and cat.latest("job-b").step == 6
    assert {j["job"]: j["quarantined"] for j in cat.jobs()} == {"job-a": 1, "job-b": 0}


@pytest.mark.slow
def test_a_bad_disk_copy_gives_way_to_the_bucket(s3_bucket, tmp_path):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    drain(cat)
    payloads = checkpoint(cat, 1)
    drain(cat)
    reborn = make_catalogue(tmp_path, s3_bucket.url())      # no RAM copy: reads go to disk
    drain(reborn)
    assert reborn.jobs()[0]["newest"]["tiers"] == ["disk", "object"]
    flip_byte(shard_file(reborn.disk, "j", 1, 0))
    assert read(reborn, "j", 1, 0) == payloads[0]           # from the bucket, in the same request
    summary = reborn.jobs()[0]
    assert summary["newest"]["tiers"] == ["object"] and summary["quarantined"] == 1


@pytest.mark.slow
def test_a_restore_gives_way_past_a_bad_disk_copy(stack, rank_env):
    memd, agent = stack
    model = torch.nn.Linear(8, 4)
    for step in (3, 7):
        with torch.no_grad():
            model.weight.fill_(step)
        ckpt = rank_env(agent, "rot", 0, 1, model=model)
        assert ckpt.save(step, force=True) and ckpt.wait(timeout=60)
        ckpt.close()
    with memd.client() as client:
        assert client.wait("rot", 7, 30, on_disk=True)
    memd.stop()
    memd.start(port=memd.port)                              # RAM is gone: step 7 is read from disk
    flip_byte(memd.data_dir / "jobs" / "rot" / f"{7:016d}" / "rank-00000.bin", at=100)
    restored = torch.nn.Linear(8, 4)
    ckpt = rank_env(agent, "rot", 0, 1, model=restored)
    assert ckpt.restore() == 4
    ckpt.close()
    assert torch.equal(restored.weight, torch.full((4, 8), 3.0))
    with memd.client() as client:
        (job,) = client.list()["jobs"]
    assert job["quarantined"] == 1 and [c["step"] for c in job["checkpoints"]] == [3]
    assert "the disk copy is bad" in memd.log()


@pytest.mark.slow
def test_memd_checks_its_disk_after_it_listens_and_status_shows_what_it_quarantined(memd_factory, tmp_path):
    data = tmp_path / "data"
    disk = DiskTier(data)
    for step in (1, 2):
        info, data_ = make_checkpoint(step=step)
        disk.put(info, [memoryview(d) for d in data_])
    flip_byte(shard_file(disk, "job-a", 2, 1))
    memd = memd_factory(data_dir=data)

    def job():
        with memd.client() as client:
            (listed,) = client.list()["jobs"]
        return listed if listed.get("quarantined") else None

    listed = wait_for(job, 30, "the bad copy quarantined")
    assert [c["step"] for c in listed["checkpoints"]] == [1]
    status = subprocess.run([sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file",
                             str(memd.token_file)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "job-a: 1 disk copy failed their checksum" in " ".join(status.stdout.split())


@pytest.mark.slow
def test_a_disk_copy_that_rotted_before_its_upload_is_quarantined_not_uploaded_again_and_again(s3_bucket, tmp_path):
    """The uploader reads the disk copy: bytes that no longer match their checksum never go up, and the copy is
    quarantined (as a read would), not retried forever; the checkpoint is served from RAM meanwhile."""
    cat = make_catalogue(tmp_path, s3_bucket.url())
    drain(cat)
    payloads = [deliver(cat, header)[1] for header in headers("j", 1, rep_total=64 << 10)]
    assert cat.disk_writer.persist_next(timeout=5)                      # on disk now, its upload queued
    flip_byte(shard_file(cat.disk, "j", 1, 1))              # rotted on disk before the uploader read it
    drain(cat)
    summary = cat.jobs()[0]
    assert summary["quarantined"] == 1 and summary["newest"]["tiers"] == ["ram"]
    assert not summary["object_error"] and not [k for k in s3_bucket.keys() if "/j/" in k]
    assert read(cat, "j", 1, 1) == payloads[1]              # from its RAM copy, intact


def test_a_shard_read_in_many_ranges_over_several_streams_is_checked_once(tmp_path, monkeypatch):
    """A restore reads one shard in many pieces over 4 streams: the disk copy is read whole once, not once per
    piece; a check longer than the recheck window does not start another for the reads still open."""
    from dashrun.memd.store.tiers import disk as disk_module

    reborn, payloads = restarted_with_steps(tmp_path, [1])
    checks = []
    real_check = DiskTier._check_fd
    first_check = threading.Event()
    release = threading.Event()

    def counted(fd, shard, *args, **kwargs):
        checks.append(shard.rank)
        first_check.set()
        release.wait(30)  # every stream comes while this check is under way
        return real_check(fd, shard, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "_check_fd", staticmethod(counted))
    monkeypatch.setattr(disk_module, "RECHECK_AFTER", 0.0)  # only an open read keeps a file checked
    want = payloads[(1, 0)]
    size = len(want) // 16
    pieces = [(start, start + size) for start in range(0, 16 * size, size)] * 4  # 64 reads
    got, failures = [], []
    holding = reborn.open_shard("j", 1, 0)  # a read held open across the others: one session

    def stream(mine):
        try:
            for start, end in mine:
                with reborn.open_shard("j", 1, 0) as (view, _crc, _marks):
                    got.append(bytes(view[start:end]) == want[start:end])
        except Exception as e:  # noqa: BLE001 (asserted below)
            failures.append(e)

    streams = [threading.Thread(target=stream, args=(pieces[i::4],)) for i in range(4)]
    opener = threading.Thread(target=holding.__enter__)
    opener.start()
    wait_for(first_check.is_set, 30, "the first check to start")
    for thread in streams:
        thread.start()
    release.set()
    for thread in (opener, *streams):
        thread.join(60)
    holding.__exit__(None, None, None)
    assert failures == [] and len(got) == len(pieces) and all(got)
    assert checks == [0]
