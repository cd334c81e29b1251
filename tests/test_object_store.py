"""dash-memd with an object tier (moto's S3 server): uploads behind the disk, fall-through reads, faults.

The catalogue tests drive one Catalogue by hand (persist, then upload); the
process tests run dash-memd with ``--s3`` and real training jobs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REFERENCE_STEPS, TRAIN, Memd, dashrun_cmd, wait_for
from runs import assert_identical, starts
from test_catalogue import deliver, headers

from dashrun.errors import ChecksumError, SignatureError, UnavailableError
from dashrun.memd.fleet.membership import MEMBERSHIP, Membership
from dashrun.memd.store.catalogue import Catalogue, State
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.memd.store.tiers.object import RECORD, ObjectTier
from dashrun.memd.store.tiers.signing import manifest_key
from dashrun.memd.store.tombstones import TOMBSTONES
from dashrun.util.tokens import write_token
from dashrun.wire.domain import FailureDomain
from dashrun.wire.history import Restored
from dashrun.wire.messages import JobSpec, MembershipEvent, ShardHeader
from dashrun.wire.protocol import crc32c
from dashrun.wire.tls import TlsSettings

#: The manifest key of the catalogues these tests make (a dash-memd derives its own from its token).
KEY = manifest_key(b"test_object_store")


def checkpoint(cat: Catalogue, step: int, job: str = "j") -> list[bytes]:
    """Commit ``step`` (every rank's shard), write it to disk, and let the uploader take it up."""
    payloads = [deliver(cat, header)[1] for header in headers(job, step, rep_total=64 << 10)]
    assert cat.disk_writer.persist_next(timeout=5)
    return payloads


def drain(cat: Catalogue, timeout: float = 60) -> None:
    """Run queued object-store tasks (the initial listing first), retries included, until none is left."""
    def done():
        cat.uploader.next(timeout=0.2)
        return cat.uploader.tasks_left() == 0
    wait_for(done, timeout, "the object-store tasks", interval=0)


def make_catalogue(tmp_path, url: str, name: str = "data", **kwargs) -> Catalogue:
    cat = Catalogue(RamTier(8 << 20), DiskTier(tmp_path / name), keep_ram=1, keep_disk=2,
                    objects=ObjectTier(url, attempts=2, backoff=0.1, request_attempts=2, connect_timeout=2,
                                       read_timeout=5, key=KEY), **kwargs)
    cat.load_disk()
    return cat


def read(cat: Catalogue, job: str, step: int, rank: int) -> bytes:
    with cat.open_shard(job, step, rank) as (view, crc, _marks):
        data = bytes(view)
    assert crc32c(data) == crc
    return data


def steps_in_bucket(bucket, job="j") -> list[int]:
    return sorted(int(k.split("/")[-2]) for k in bucket.keys() if k.endswith("MANIFEST.json") and f"/{job}/" in k)


def test_checkpoints_move_through_every_state_into_the_bucket(s3_bucket, tmp_path):
    cat = make_catalogue(tmp_path, s3_bucket.url(), keep_object=3)
    drain(cat)  # the initial listing: an empty bucket
    cat.put_spec("j", JobSpec(argv=("train.py",), cwd="/w", host="n1", created=1.0))
    for step in (1, 2, 3, 4):
        checkpoint(cat, step)
        drain(cat)
    summary = cat.jobs()[0]
    states = {c["step"]: (c["state"], c["tiers"]) for c in summary["checkpoints"]}
    assert states[4] == (State.IN_OBJECT_STORE.value, ["disk", "object", "ram"])
    assert states[3] == (State.IN_OBJECT_STORE.value, ["disk", "object"])
    assert states[2] == (State.IN_OBJECT_STORE.value, ["object"])       # gone from disk (keep 2), kept in the bucket
    assert 1 not in states                                              # beyond every tier's retention
    assert steps_in_bucket(s3_bucket) == [2, 3, 4]
    assert any(k.endswith("/j/SPEC.json") for k in s3_bucket.keys())
    assert summary["object_error"] is None and cat.uploader.pending_uploads() == 0


def test_an_empty_data_dir_restores_from_the_bucket_and_a_corrupt_object_gives_way(s3_bucket, tmp_path):
    first = make_catalogue(tmp_path, s3_bucket.url())
    drain(first)
    first.put_spec("j", JobSpec(argv=("train.py", "--lr", "0.1",), cwd="/w", host="n1", created=1.0))
    payloads = {}
    for step in (10, 20):
        payloads[step] = checkpoint(first, step)
        drain(first)

    reborn = make_catalogue(tmp_path, s3_bucket.url(), name="empty")
    with pytest.raises(UnavailableError, match="not listed its object store"):
        reborn.latest("j")  # it cannot yet say the job has no checkpoint
    drain(reborn)
    assert reborn.latest("j").step == 20
    assert reborn.spec("j").argv == ("train.py", "--lr", "0.1")
    assert read(reborn, "j", 20, 1) == payloads[20][1]
    assert reborn.ram.used > 0 and reborn.downloads.held() == 1  # kept a while for the next range of it
    with reborn.ledger.cond:
        reborn.downloads.expire(time.monotonic() + reborn.downloads.linger)
    assert reborn.ram.used == 0  # the downloaded shard's buffer went back

    # Rank 0's object of step 20 rots in place: same size, other bytes.
    key = next(k for k in s3_bucket.keys() if k.endswith("/0000000000000020/rank-00000.bin"))
    bad = bytearray(payloads[20][0])
    bad[1234] ^= 0xFF
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(bad))
    with pytest.raises(ChecksumError):
        read(reborn, "j", 20, 0)
    assert reborn.latest("j").step == 10          # the next older good checkpoint
    assert read(reborn, "j", 10, 0) == payloads[10][0]


def test_a_manifest_from_before_signed_manifests_is_refused_and_the_disk_copy_goes_up_again_signed(s3_bucket,
                                                                                                     tmp_path):
    first = make_catalogue(tmp_path, s3_bucket.url())
    drain(first)
    payloads = checkpoint(first, 6)
    drain(first)
    key = next(k for k in s3_bucket.keys() if k.endswith("/0000000000000006/MANIFEST.json"))
    manifest = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    del manifest["mac"], manifest["sha256"]  # as a dashrun before signed manifests wrote it
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=json.dumps(manifest).encode())

    bare = make_catalogue(tmp_path, s3_bucket.url(), name="empty")  # only the bucket: nothing to take
    drain(bare)
    assert bare.latest("j") is None
    again = make_catalogue(tmp_path, s3_bucket.url())  # its disk holds the step: it goes up again, signed
    drain(again)
    assert again.jobs()[0]["checkpoints"][-1]["tiers"] == ["disk", "object"]
    assert "mac" in json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    taken = make_catalogue(tmp_path, s3_bucket.url(), name="empty-again")
    drain(taken)
    assert taken.latest("j").step == 6 and read(taken, "j", 6, 1) == payloads[1]


def test_a_shard_only_the_bucket_holds_is_downloaded_once_for_every_range_and_stream(s3_bucket, tmp_path):
    """A restore reads a shard in many ranges over several streams; the bucket is the only copy, and RAM has
    room for two shards, not one per stream."""
    first = make_catalogue(tmp_path, s3_bucket.url())
    drain(first)
    shards = headers("j", 5, rep_total=4 << 20)
    payloads = [deliver(first, header)[1] for header in shards]
    assert first.disk_writer.persist_next(timeout=5)
    drain(first)
    reborn = Catalogue(RamTier(5 << 20), DiskTier(tmp_path / "empty"), objects=ObjectTier(s3_bucket.url(), key=KEY))
    drain(reborn)
    downloads = []
    real_read = reborn.objects.read_into
    reborn.objects.read_into = lambda *args, **kwargs: downloads.append(args[:3]) or real_read(*args, **kwargs)
    ranges = [(start, start + len(payloads[0]) // 16) for start in range(0, len(payloads[0]), len(payloads[0]) // 16)]
    got, failures = {}, []

    def stream(mine):
        try:
            for start, end in mine:
                with reborn.open_shard("j", 5, 0) as (view, _crc, _marks):
                    got[start] = bytes(view[start:end])
        except Exception as e:  # noqa: BLE001 (asserted below)
            failures.append(e)

    streams = [threading.Thread(target=stream, args=(ranges[i::4],)) for i in range(4)]
    for thread in streams:
        thread.start()
    for thread in streams:
        thread.join(60)
    assert failures == []
    assert b"".join(got[start] for start, _ in ranges) == payloads[0]
    assert downloads == [("j", 5, 0)]  # one download, verified once, for 16 ranges over 4 streams
    # Idle, it gives way to a receive that needs the room.
    ticket = reborn.receiver.begin_shard(headers("k", 1, rep_total=8 << 20, world=2)[0])
    assert reborn.downloads.held() == 0
    reborn.receiver.abort_shard(ticket)


def test_a_store_that_is_down_blocks_neither_commits_nor_the_disk(s3_server, s3_bucket, tmp_path):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    drain(cat)
    s3_server.stop()
    try:
        checkpoint(cat, 1)
        checkpoint(cat, 2)  # committed and on disk while the store is unreachable
        assert cat.latest("j").step == 2 and cat.jobs()[0]["newest"]["state"] == State.ON_DISK.value
        assert cat.uploader.pending_uploads() == 1      # step 2 superseded step 1 in the queue
        # The uploader fails, shows why, and keeps the task for another try.
        assert cat.uploader.next(timeout=1)
        assert "object store" in cat.jobs()[0]["object_error"]
    finally:
        s3_server.start()  # moto holds nothing after a restart: the bucket comes back empty
    s3_bucket.client.create_bucket(Bucket=s3_bucket.name)
    checkpoint(cat, 3)  # queued behind the failed upload of step 2, which it supersedes
    drain(cat)
    assert steps_in_bucket(s3_bucket) == [3]
    summary = cat.jobs()[0]
    assert summary["object_error"] is None and summary["newest"]["tiers"] == ["disk", "object", "ram"]


def test_rm_and_gc_reach_the_bucket(s3_bucket, tmp_path):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    drain(cat)
    cat.put_spec("j", JobSpec(argv=("t.py",), cwd="/w", host="n1", created=1.0))
    for step in (1, 2, 3):
        checkpoint(cat, step)
        drain(cat)
    assert cat.delete("j", keep=1) == [1, 2]
    drain(cat)
    assert steps_in_bucket(s3_bucket) == [3]
    cat.delete("j")
    drain(cat)
    assert s3_bucket.keys() == []


def test_rm_before_the_first_listing_deletes_the_buckets_copies_too(s3_bucket, tmp_path):
    first = make_catalogue(tmp_path, s3_bucket.url())
    drain(first)
    first.put_spec("j", JobSpec(argv=("t.py",), cwd="/w", host="n1", created=1.0))
    for step in (1, 2):
        checkpoint(first, step)
        drain(first)
    first.close()
    # dash-memd starts on an empty data dir, and `rm` (or a launch with --fresh) comes before it listed the bucket.
    reborn = make_catalogue(tmp_path, s3_bucket.url(), name="empty")
    assert reborn.delete("j") == []
    assert reborn.latest("j") is None  # deleted: nothing to wait for
    drain(reborn)
    assert reborn.latest("j") is None and reborn.spec("j") is None
    assert s3_bucket.keys() == []


@pytest.mark.parametrize("keep", [0, 1], ids=["rm", "gc"])
def test_a_deletion_the_bucket_has_not_caught_up_with_survives_a_restart(s3_bucket, tmp_path, keep):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    drain(cat)
    cat.put_spec("j", JobSpec(argv=("t.py",), cwd="/w", host="n1", created=1.0))
    for step in (1, 2):
        checkpoint(cat, step)
        drain(cat)
    assert cat.delete("j", keep) == [1, 2][:2 - keep]
    cat.close()  # dash-memd stops, or dies, before its uploader deleted anything from the bucket
    reborn = make_catalogue(tmp_path, s3_bucket.url())
    drain(reborn)
    assert sorted(reborn.ledger.committed.get("j", {})) == [2][:keep]
    assert steps_in_bucket(s3_bucket) == [2][:keep] and (reborn.spec("j") is None) == (keep == 0)
    assert not (tmp_path / "data" / TOMBSTONES).exists()  # the bucket caught up
    checkpoint(reborn, 3)                                 # what the job commits afterwards is not deleted
    drain(reborn)
    assert steps_in_bucket(s3_bucket) == [2, 3][1 - keep:]


@pytest.mark.parametrize("keep", [0, 1], ids=["rm", "gc"])
def test_a_restart_with_the_bucket_unreachable_never_loads_a_deleted_step_the_disk_brought_back(
        s3_server, s3_bucket, tmp_path, keep):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    drain(cat)
    for step in (1, 2):
        checkpoint(cat, step)
        drain(cat)
    job_dir = tmp_path / "data" / "jobs" / "j"
    shutil.copytree(job_dir, tmp_path / "before")
    assert cat.delete("j", keep) == [1, 2][:2 - keep]
    cat.close()
    # dash-memd dies before the bucket caught up, and the step directories come back: removals an older
    # dash-memd did not fsync, lost with the machine (or removals that failed).
    for step_dir in (tmp_path / "before").iterdir():
        if not (job_dir / step_dir.name).exists():
            shutil.copytree(step_dir, job_dir / step_dir.name)
    s3_server.stop()
    try:
        reborn = make_catalogue(tmp_path, s3_bucket.url())  # its start scans the disk, the listing fails
        assert reborn.uploader.next(timeout=1) and not reborn.uploader.listed
        assert sorted(reborn.ledger.committed.get("j", {})) == [2][:keep]
        assert (reborn.latest("j").step if keep else reborn.latest("j")) == (2 if keep else None)
        assert not (job_dir / f"{1:016d}").exists()  # removed again
    finally:
        s3_server.start()  # moto holds nothing after a restart: the bucket comes back empty
    s3_bucket.client.create_bucket(Bucket=s3_bucket.name)
    drain(reborn)
    assert sorted(reborn.ledger.committed.get("j", {})) == [2][:keep]
    assert not (tmp_path / "data" / TOMBSTONES).exists()  # disk and bucket caught up


def test_a_full_upload_queue_drops_its_oldest(s3_bucket, tmp_path):
    cat = make_catalogue(tmp_path, s3_bucket.url(), upload_queue=2)
    drain(cat)
    for job in ("a", "b", "c"):
        checkpoint(cat, 1, job=job)
    assert cat.uploader.pending_uploads() == 2
    drain(cat)
    assert [steps_in_bucket(s3_bucket, job) for job in ("a", "b", "c")] == [[], [1], [1]]
    # Job a's newest checkpoint stays on disk; it goes up at dash-memd's next start.
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    reborn = make_catalogue(tmp_path, s3_bucket.url(), name="copy")
    drain(reborn)
    assert steps_in_bucket(s3_bucket, "a") == [1]


# --- membership records ------------------------------------------------------------------------------


def with_records(cat: Catalogue, tmp_path, name: str = "data") -> Membership:
    """The catalogue's uploader keeping a Membership's records in the bucket, as dash-memd wires them."""
    members = Membership(tmp_path / name / MEMBERSHIP)
    members.load()
    cat.uploader.keep_records(members)
    return members


def shard_header(step: int, job: str = "j") -> ShardHeader:
    return ShardHeader(job, step, 0, 1, 0, 0, 0, 0, 0, "x")


def record_in_bucket(bucket, job: str = "j") -> dict | None:
    key = next((k for k in bucket.keys() if k.endswith(f"/{job}/{RECORD}")), None)
    if key is None:
        return None
    return json.loads(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())["record"]


def test_a_jobs_membership_record_survives_a_lost_data_dir_through_the_bucket(s3_bucket, tmp_path):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    members = with_records(cat, tmp_path)
    drain(cat)
    members.record("j", MembershipEvent(100.0, "n1", "joined", "started", 1, 0))
    assert members.raise_generation("j", 3) == 3
    members.note_snapshot(shard_header(4), Restored(-1, 0.5, 101.0))
    members.note_snapshot(shard_header(9), None)
    members.note_domain("j", "n1", FailureDomain("us-east-1a", "m5.large:spot", "spot"))
    drain(cat)
    assert record_in_bucket(s3_bucket) == members.body("j")

    # The data dir is lost; the job reconnects and records an event before the bucket is listed.
    reborn = make_catalogue(tmp_path, s3_bucket.url(), name="empty")
    again = with_records(reborn, tmp_path, name="empty")
    again.record("j", MembershipEvent(200.0, "n1", "joined", "restarted", 1, 0))
    again.note_snapshot(shard_header(14), Restored(9, 2.0, 201.0))
    drain(reborn)
    assert again.generation("j") == 3
    assert [e.why for e in again.history("j")] == ["started", "restarted"]
    history = again.run_history("j")
    assert [p[1] for p in history["points"]] == [4, 9, 14]
    assert history["restores"] == 1 and history["restore_s"] == pytest.approx(2.5)
    assert history["domains"]["n1"]["zone"] == "us-east-1a"
    assert record_in_bucket(s3_bucket) == again.body("j")  # the merged record went back up
    # on disk too: a restart of this dash-memd reads it from its data dir
    third = Membership(tmp_path / "empty" / MEMBERSHIP)
    third.load()
    assert third.body("j") == again.body("j")

    # `dashrun rm`: the bucket's copy goes with the job, and a restart on an empty data dir takes nothing back.
    reborn.delete("j")
    again.delete_job("j")
    drain(reborn)
    assert record_in_bucket(s3_bucket) is None and s3_bucket.keys() == []
    fourth = make_catalogue(tmp_path, s3_bucket.url(), name="empty-again")
    nothing = with_records(fourth, tmp_path, name="empty-again")
    drain(fourth)
    assert nothing.jobs() == []


def test_a_membership_record_planted_edited_or_moved_in_the_bucket_is_refused(s3_bucket, tmp_path, caplog):
    cat = make_catalogue(tmp_path, s3_bucket.url())
    members = with_records(cat, tmp_path)
    drain(cat)
    members.record("a", MembershipEvent(100.0, "n1", "joined", "started", 1, 0))
    members.raise_generation("a", 2)
    drain(cat)
    key = next(k for k in s3_bucket.keys() if k.endswith(f"/a/{RECORD}"))
    signed = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    edited = {**signed, "record": {**signed["record"], "generation": 1 << 40}}  # would fence the job out
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=json.dumps(edited).encode())
    # a's record, signed, copied to b's key: refused as another job's
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key.replace("/a/", "/b/"), Body=json.dumps(signed).encode())
    unsigned = {k: v for k, v in signed.items() if k != "mac"}
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key.replace("/a/", "/c/"),
                                Body=json.dumps({**unsigned, "job": "c"}).encode())

    reborn = make_catalogue(tmp_path, s3_bucket.url(), name="empty")
    again = with_records(reborn, tmp_path, name="empty")
    with caplog.at_level("WARNING"):
        drain(reborn)
    assert again.jobs() == [] and again.generation("a") == 0
    refused = [r.getMessage() for r in caplog.records if "membership record of" in r.getMessage()]
    assert len(refused) == 3, refused
    assert any("of b" in m and "another job" in m for m in refused)
    assert any("of c" in m and "not signed" in m for m in refused)
    with pytest.raises(SignatureError):
        reborn.objects.get_record("a")


# --- dash-memd processes and real jobs ------------------------------------------------------------------


@pytest.mark.slow
def test_memd_lost_with_its_data_dir_the_bucket_resumes_the_job_bit_identical(memd_factory, s3_bucket, tmp_path,
                                                                               reference):
    url = s3_bucket.url("team")
    memd = memd_factory("--memory-limit", "256MiB", "--s3", url)
    out = tmp_path / "out"
    args = [str(TRAIN), "--steps", str(REFERENCE_STEPS), "--interval", "5", "--out", str(out)]
    stop_at = 17
    # a little time per step, so no due snapshot is skipped on a loaded machine (the steps below are 4, 9, 14)
    first = subprocess.run(dashrun_cmd(memd, *args, "--stop-after", str(stop_at), "--delay", "0.05", job="s3-job"),
                           capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    with memd.client() as client:
        wait_for(lambda: client.list()["jobs"][0]["newest"]["state"] == "in_object_store", 180,
                 "the newest checkpoint in the bucket")
        newest = client.latest("s3-job").step
    assert newest == 14
    # the job's membership record too (the launch's end is its last event): what `dashrun report` reads
    def changes_in_bucket() -> list[str]:
        return [e["change"] for e in (record_in_bucket(s3_bucket, "s3-job") or {}).get("events", [])]
    wait_for(lambda: "finished" in changes_in_bucket(), 60, "the job's membership record in the bucket")

    memd.kill()
    shutil.rmtree(memd.data_dir)
    reborn = memd_factory("--memory-limit", "256MiB", "--s3", url)
    second = subprocess.run(dashrun_cmd(reborn, *args, "--delay", "0.05", job="s3-job"),  # the last step's is due too
                            capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert starts(out) == [0, newest + 1]
    assert_identical(reference, out)
    ledger = subprocess.run([sys.executable, "-m", "dashrun", "report", "s3-job", "--json", "--memd", reborn.address,
                             "--token-file", str(reborn.token_file), *reborn.tls_args],
                            capture_output=True, text=True, timeout=60)
    assert ledger.returncode == 0, ledger.stderr
    found = json.loads(ledger.stdout)
    steps = [point[1] for point in found["points"]]
    assert steps[:3] == [4, 9, 14] and steps[-1] == REFERENCE_STEPS - 1, steps  # the first launch's snapshots too
    assert found["restores"] == 1 and found["steps_done"] == REFERENCE_STEPS
    status = subprocess.run([sys.executable, "-m", "dashrun", "status", "--memd", reborn.address, "--token-file",
                             str(reborn.token_file)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and url in status.stdout, status.stdout + status.stderr


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_in_the_bucket_resumes_from_the_one_before(memd_factory, s3_bucket, tmp_path,
                                                                               reference):
    url = s3_bucket.url()
    memd = memd_factory("--memory-limit", "256MiB", "--s3", url)
    out = tmp_path / "out"
    args = [str(TRAIN), "--steps", str(REFERENCE_STEPS), "--interval", "5", "--out", str(out)]
    first = subprocess.run(dashrun_cmd(memd, *args, "--stop-after", "12", job="rot"),
                           capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    with memd.client() as client:
        wait_for(lambda: [c["state"] for c in client.list()["jobs"][0]["checkpoints"]][-2:]
                 == ["in_object_store"] * 2, 180, "steps 4 and 9 in the bucket")
    memd.kill()
    shutil.rmtree(memd.data_dir)
    key = next(k for k in s3_bucket.keys() if k.endswith("/0000000000000009/rank-00001.bin"))
    body = bytearray(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(body))

    reborn = memd_factory("--memory-limit", "256MiB", "--s3", url)
    second = subprocess.run(dashrun_cmd(reborn, *args, job="rot"), capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert starts(out) == [0, 5]  # step 9 failed its checksum: resumed after step 4
    assert_identical(reference, out)
    assert "fails its checksum" in reborn.log()


class Planted:
    """A value whose unpickling would create a file: what someone with write access to the bucket would plant."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_planted_or_edited_in_the_bucket_is_refused_at_adoption_and_never_unpickled(
        memd_factory, s3_bucket, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from dashrun import dcp as ddcp

    def writer(memd):
        return ddcp.Writer("dcp-s3", memd.address, memd.token_file, tls=TlsSettings(plaintext=bool(memd.tls_args)))

    url, marker = s3_bucket.url(), tmp_path / "ran"
    memd = memd_factory("--memory-limit", "64MiB", "--s3", url)
    for step in (1, 3):
        dcp.save({"w": torch.full((4,), float(step)), "epoch": step}, checkpoint_id=step, storage_writer=writer(memd),
                 no_dist=True)
        wait_for(lambda: step in steps_in_bucket(s3_bucket, "dcp-s3"), 60, f"step {step} in the bucket")
    memd.stop()
    # Someone who can write into the bucket but does not hold the token: a dash-memd of theirs, their own token.
    write_token(tmp_path / "planter-token")
    planter = Memd(tmp_path / "planter-data", tmp_path / "planter-token", "--memory-limit", "64MiB", "--s3", url,
                   log_path=tmp_path / "planter.log")
    try:
        planter.start()
        dcp.save({"w": torch.zeros(4), "epoch": Planted(marker)}, checkpoint_id=5, storage_writer=writer(planter),
                 no_dist=True)
        wait_for(lambda: 5 in steps_in_bucket(s3_bucket, "dcp-s3"), 60, "the planted step 5 in the bucket")
    finally:
        planter.stop()
    marker.unlink(missing_ok=True)  # (pickling it ran nothing; this is the bucket before the adoption)
    # And step 3's manifest edited in place: its commit time, say, so that it would outlive a deletion.
    key = next(k for k in s3_bucket.keys() if k.endswith("/dcp-s3/0000000000000003/MANIFEST.json"))
    manifest = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    manifest["checkpoint"]["committed_at"] += 1e6
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=json.dumps(manifest).encode())

    reborn = memd_factory("--memory-limit", "64MiB", "--s3", url)  # its data dir empty: the bucket is all there is
    with reborn.client() as client:
        def listed():
            try:
                return client.latest("dcp-s3")
            except UnavailableError:  # not listed the bucket yet
                return None
        assert wait_for(listed, 60, "the bucket's listing").step == 1
        assert client.latest("dcp-s3", 3) is None and client.latest("dcp-s3", 5) is None
    state = {"w": torch.zeros(4), "epoch": None}
    reader = ddcp.Reader("dcp-s3", memd=reborn.address, token_file=reborn.token_file, allow_pickle=True,
                         tls=TlsSettings(plaintext=bool(reborn.tls_args)))
    dcp.load(state, storage_reader=reader, no_dist=True)  # the newest it took: even a full unpickling is safe
    reader.close()
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(4))
    assert not marker.exists()
    log = reborn.log()
    refusals = [line for line in log.splitlines() if " ERROR " in line and "refused s3://" in line]
    assert len(refusals) == 2, log[-3000:]
    assert any("0000000000000005/MANIFEST.json does not carry a valid MAC" in line for line in refusals)
    assert any("0000000000000003/MANIFEST.json does not carry a valid MAC" in line for line in refusals)


def test_memd_refuses_a_bad_bucket_url(tmp_path, token_file):
    result = subprocess.run([sys.executable, "-m", "dashrun.memd", "start", "--data-dir", str(tmp_path / "d"),
                             "--token-file", str(token_file), "--s3", "bucket/prefix"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "s3://bucket/prefix" in result.stderr and "Traceback" not in result.stderr
