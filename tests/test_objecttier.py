"""What is specific to the object-storage tier, against a real S3 API (moto's server on loopback).

Multipart uploads with parallel parts, the manifest as the commit, faults in
the middle of an upload (injected, and the server itself going away), damage
caught on read, and the bucket layout another process can read.
"""

import base64
import functools
import hashlib
import hmac
import io
import json
import socket
import subprocess
import sys
import threading

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from conftest import wait_for

from test_tiers import make_checkpoint

from dashrun.errors import ChecksumError, NotFoundError, SignatureError, UnavailableError, UsageError
from dashrun.memd.store.tiers import DiskTier
from dashrun.memd.store.tiers.object import ObjectTier
from dashrun.memd.store.tiers.signing import manifest_key
from dashrun.testing.s3 import KEY, S3Server, make_bucket, use_endpoint
from dashrun.wire.messages import JobSpec
from dashrun.wire.protocol import crc32c

MiB = 1 << 20


def views(data):
    return [memoryview(d) for d in data]


def b64crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class Scripted:
    """The tier's boto3 client, with ``before(name, kwargs)`` run before every call, and every call recorded."""

    PASS_THROUGH = {"get_paginator", "can_paginate", "close", "meta", "exceptions"}

    def __init__(self, client, before=None):
        self._client, self._before = client, before
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str | None, int | None]] = []
        self.failures: list[tuple[str, Exception]] = []

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name in self.PASS_THROUGH or not callable(attr):
            return attr

        def call(**kwargs):
            with self.lock:
                self.calls.append((name, kwargs.get("Key"), kwargs.get("PartNumber")))
            try:
                if self._before:
                    self._before(name, kwargs)
                return attr(**kwargs)
            except Exception as e:
                with self.lock:
                    self.failures.append((name, e))
                raise
        return call

    def named(self, *names):
        with self.lock:
            return [c for c in self.calls if c[0] in names]


def injected(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "injected by the test"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "UploadPart")


def big_checkpoint(step=10, world=1, shard=12 * MiB):
    return make_checkpoint(step=step, world=world, rep_total=shard * world, tail=100)


def test_a_large_shard_goes_up_in_parallel_parts_verified_and_comes_back_whole(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), part_size=5 * MiB, threshold=5 * MiB, workers=4, key=KEY)
    together = threading.Barrier(2, timeout=20)  # parts 1 and 2 of a shard must be in flight at once
    sizes: dict[tuple[str, int], int] = {}

    def before(name, kwargs):
        if name == "upload_part":
            body = kwargs["Body"]
            sizes[(kwargs["Key"], kwargs["PartNumber"])] = body.seek(0, io.SEEK_END)
            body.seek(0)
            if kwargs["PartNumber"] in (1, 2):
                together.wait()

    tier.client = client = Scripted(tier.client, before)
    info, data = big_checkpoint(world=2)
    tier.put(info, views(data))

    for rank in range(2):
        key = tier.shard_key(info.job, info.step, rank)
        n = len(data[rank])
        assert n > 12 * MiB
        assert [sizes[(key, p)] for p in (1, 2, 3)] == [5 * MiB, 5 * MiB, n - 10 * MiB]
        head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=key, ChecksumMode="ENABLED")
        # moto computes the whole-object CRC-32C from the parts it stored: the server agrees with the manifest.
        assert head["ChecksumType"] == "FULL_OBJECT"
        assert head["ChecksumCRC32C"] == b64crc(info.shards[rank].crc)
        assert head["Metadata"] == {"dashrun-crc32c": f"{info.shards[rank].crc:08x}"}
    writes = [key for _, key, _ in client.named("put_object", "complete_multipart_upload")]
    assert writes[-1].endswith("/MANIFEST.json") and sum(k.endswith("/MANIFEST.json") for k in writes) == 1
    assert s3_bucket.uploads() == []

    buf = bytearray(len(data[1]) + 7)  # a caller's buffer, larger than the shard
    header = tier.read_into(info.job, info.step, 1, memoryview(buf))
    assert header == info.shards[1] and bytes(buf[:len(data[1])]) == data[1]
    ranged = [c for c in client.named("get_object") if c[1] == tier.shard_key(info.job, info.step, 1)]
    assert len(ranged) == 3  # parallel ranged GETs, one per part
    with tier.open(info.job, info.step, 0) as view:
        assert view == data[0]


def test_a_failure_mid_upload_commits_nothing_and_leaves_no_upload_behind(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), part_size=5 * MiB, threshold=5 * MiB, workers=3, attempts=1, key=KEY)
    old, old_data = make_checkpoint(step=1)
    tier.put(old, views(old_data))

    def before(name, kwargs):  # rank 0 is up; rank 1's second part is refused for good
        if name == "upload_part" and kwargs["Key"].endswith("rank-00001.bin") and kwargs["PartNumber"] == 2:
            raise injected("AccessDenied", 403)

    tier.client = client = Scripted(tier.client, before)
    new, new_data = big_checkpoint(step=2, world=2)
    with pytest.raises(UnavailableError, match="AccessDenied"):
        tier.put(new, views(new_data))

    assert [c[0] for c in client.named("abort_multipart_upload")] == ["abort_multipart_upload"]
    assert s3_bucket.uploads() == []
    assert not any(k.endswith("MANIFEST.json") and "/0000000000000002/" in k for k in s3_bucket.keys())
    assert [i.step for i in tier.scan()] == [1]
    assert not any("/0000000000000002/" in k for k in s3_bucket.keys())  # rank 0's object was cleaned up too
    with pytest.raises(NotFoundError):
        with tier.open(new.job, new.step, 0):
            pass
    with tier.open(old.job, old.step, 2) as view:  # the previous checkpoint is untouched
        assert view == old_data[2]


def test_a_transient_failure_restarts_the_whole_shard(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), part_size=5 * MiB, threshold=5 * MiB, workers=3, attempts=3, backoff=0.05,
                      key=KEY)
    failed = []

    def before(name, kwargs):
        if name == "upload_part" and kwargs["PartNumber"] == 3 and not failed:
            failed.append(kwargs["UploadId"])
            raise injected("InternalError", 500)

    tier.client = client = Scripted(tier.client, before)
    info, data = big_checkpoint()
    tier.put(info, views(data))
    assert len(client.named("create_multipart_upload")) == 2  # the lost upload was aborted and begun again
    assert len(client.named("abort_multipart_upload")) == 1
    assert s3_bucket.uploads() == []
    assert tier.scan() == [info]
    with tier.open(info.job, info.step, 0) as view:
        assert view == data[0]


@pytest.mark.slow
def test_the_server_going_away_mid_upload_and_coming_back(tmp_path, monkeypatch):
    """moto loses everything when it stops: the test recreates the bucket, and the retried upload completes."""
    server = S3Server(tmp_path / "moto.log").start()
    try:
        use_endpoint(monkeypatch, server.endpoint, tmp_path)
        bucket = make_bucket(server)
        tier = ObjectTier(bucket.url(), part_size=5 * MiB, threshold=5 * MiB, workers=3, attempts=5, backoff=0.1,
                          request_attempts=2, connect_timeout=2, read_timeout=10, key=KEY)
        in_part_2, stopped, restarted = threading.Event(), threading.Event(), threading.Event()

        def before(name, kwargs):
            if name == "upload_part" and kwargs["PartNumber"] == 2 and not in_part_2.is_set():
                in_part_2.set()
                assert stopped.wait(30)  # part 2 goes out to a dead server
            elif client.failures:
                assert restarted.wait(30)  # everything after the failure waits for the new server

        tier.client = client = Scripted(tier.client, before)
        info, data = big_checkpoint()
        errors = []
        uploader = threading.Thread(target=lambda: _catch(errors, tier.put, info, views(data)))
        uploader.start()
        try:
            wait_for(in_part_2.is_set, 30, "the upload to reach part 2")
            # under way, not visible
            assert ObjectTier(bucket.url(), key=KEY).scan() == [] and len(bucket.uploads()) == 1
            server.stop()
            stopped.set()
            wait_for(lambda: client.failures, 60, "the upload to fail against the stopped server")
            server.start()  # same port, empty
            make_bucket(server, bucket.name)
            fresh = ObjectTier(bucket.url(), key=KEY)
            assert fresh.scan() == []  # nothing partial is visible as committed
        finally:
            restarted.set()
            stopped.set()
            uploader.join(60)
        assert not uploader.is_alive() and errors == []
        assert any(isinstance(e, EndpointConnectionError) for _, e in client.failures)
        assert len(client.named("create_multipart_upload")) == 2  # the shard's upload began again on the new server
        assert [i.step for i in fresh.scan()] == [info.step]
        with fresh.open(info.job, info.step, 0) as view:
            assert view == data[0]
        assert bucket.uploads() == []
    finally:
        server.stop()


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # reported to the test thread
        errors.append(e)


@pytest.mark.parametrize("shard", [3000, 12 * MiB], ids=["single-get", "ranged-gets"])
def test_a_corrupted_or_truncated_object_is_caught_on_read(s3_bucket, shard):
    tier = ObjectTier(s3_bucket.url(), part_size=5 * MiB, threshold=5 * MiB, key=KEY)
    info, data = make_checkpoint(world=2, rep_total=2 * shard)
    tier.put(info, views(data))
    key = tier.shard_key(info.job, info.step, 1)
    damaged = bytearray(data[1])
    damaged[len(damaged) // 2] ^= 0xFF
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(damaged))
    with pytest.raises(ChecksumError, match="checksum"):
        with tier.open(info.job, info.step, 1):
            pass
    with pytest.raises(ChecksumError):
        tier.read_into(info.job, info.step, 1, memoryview(bytearray(len(data[1]))))
    with tier.open(info.job, info.step, 0) as view:  # the other rank is fine
        assert view == data[0]
    assert tier.scan() == [info]  # scan does not download shards: damage of the same size shows on read

    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(damaged[:-1]))
    with pytest.raises(ChecksumError, match="wrong size"):
        with tier.open(info.job, info.step, 1):
            pass
    found, problems = tier.scan_report()
    assert found == [] and "rank-00001.bin of the wrong size" in problems[0]


def test_another_process_reads_the_same_checkpoints_and_specs(s3_bucket):
    url = s3_bucket.url("shared/run")
    tier = ObjectTier(url, key=KEY)
    for job, step in (("job-a", 1), ("job-a", 2), ("job-b", 7)):
        info, data = make_checkpoint(job=job, step=step)
        tier.put(info, views(data))
    spec = JobSpec(("train.py", "--lr", "3e-4"), "/work", "node-1", 1.7e9)
    tier.put_spec(spec, "job-a")
    expected_crc = info.shards[1].crc

    code = ("import json, sys\n"
            "from dashrun.memd.store.tiers.object import ObjectTier\n"
            "from dashrun.wire.protocol import crc32c\n"
            "tier = ObjectTier(sys.argv[1], key=bytes.fromhex(sys.argv[2]))\n"
            "with tier.open('job-b', 7, 1) as view:\n"
            "    crc = crc32c(view)\n"
            "print(json.dumps({'checkpoints': sorted([i.job, i.step] for i in tier.scan()),\n"
            "                  'specs': {j: s.to_body() for j, s in tier.specs().items()}, 'crc': crc}))\n")
    out = subprocess.run([sys.executable, "-c", code, url, KEY.hex()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen == {"checkpoints": [["job-a", 1], ["job-a", 2], ["job-b", 7]],
                    "specs": {"job-a": spec.to_body()}, "crc": expected_crc}

    other = ObjectTier(s3_bucket.url("shared/other"), key=KEY)  # another prefix is another store
    assert other.scan() == [] and other.specs() == {}
    tier.delete_spec("job-a")
    assert ObjectTier(url, key=KEY).specs() == {}


def test_the_layout_is_exactly_as_documented(s3_bucket, tmp_path):
    tier = ObjectTier(s3_bucket.url("team/run-7/"), key=KEY)
    info, data = make_checkpoint(job="job-a", step=12, world=2)
    tier.put(info, views(data))
    spec = JobSpec(("train.py",), "/work", "node-1", 1.7e9)
    tier.put_spec(spec, "job-a")
    base = "team/run-7/dashrun-v1/jobs/job-a"
    assert s3_bucket.keys() == [f"{base}/0000000000000012/MANIFEST.json", f"{base}/0000000000000012/rank-00000.bin",
                                f"{base}/0000000000000012/rank-00001.bin", f"{base}/SPEC.json"]

    def get(key):
        return s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)

    manifest = json.loads(get(f"{base}/0000000000000012/MANIFEST.json")["Body"].read())
    mac = manifest.pop("mac")
    assert manifest == {"format": "dashrun-checkpoint", "version": 1, "checkpoint": info.to_body(),
                        "sha256": [hashlib.sha256(d).hexdigest() for d in data]}
    assert mac == hmac.new(KEY, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode(),
                           hashlib.sha256).hexdigest()
    disk = DiskTier(tmp_path / "disk")  # the disk tier's manifest, signed
    disk.put(info, views(data))
    del manifest["sha256"]
    assert json.loads((disk.step_dir("job-a", 12) / "MANIFEST.json").read_bytes()) == manifest
    shard = get(f"{base}/0000000000000012/rank-00001.bin")
    assert shard["Body"].read() == data[1]
    assert shard["Metadata"] == {"dashrun-crc32c": f"{info.shards[1].crc:08x}"}
    assert json.loads(get(f"{base}/SPEC.json")["Body"].read()) == spec.to_body()

    at_root = ObjectTier(f"s3://{s3_bucket.name}", key=KEY)
    assert at_root.root == "dashrun-v1" and at_root.scan() == []
    at_root.put(info, views(data))
    assert "dashrun-v1/jobs/job-a/0000000000000012/MANIFEST.json" in s3_bucket.keys()


def test_delete_withdraws_the_manifest_before_the_shards(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), key=KEY)
    info, data = make_checkpoint()
    tier.put(info, views(data))
    tier.client = client = Scripted(tier.client)
    tier.delete(info.job, info.step)
    deletes = client.named("delete_object", "delete_objects")
    assert deletes[0] == ("delete_object", f"{tier.step_key(info.job, info.step)}/MANIFEST.json", None)
    assert [c[0] for c in deletes[1:]] == ["delete_objects"]
    assert s3_bucket.keys() == []


def test_scan_report_names_what_it_skips_and_changes_nothing(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), key=KEY)
    for step in range(1, 6):
        info, data = make_checkpoint(step=step)
        tier.put(info, views(data))
    client, bucket = s3_bucket.client, s3_bucket.name
    client.delete_object(Bucket=bucket, Key=f"{tier.step_key('job-a', 2)}/MANIFEST.json")
    client.delete_object(Bucket=bucket, Key=tier.shard_key("job-a", 3, 2))
    client.put_object(Bucket=bucket, Key=f"{tier.step_key('job-a', 4)}/MANIFEST.json", Body=b"{not json")
    client.put_object(Bucket=bucket, Key=tier.shard_key("job-a", 5, 0), Body=b"short")
    client.put_object(Bucket=bucket, Key=f"{tier.job_key('job-a')}/notes.txt", Body=b"hello")
    pending = tier.shard_key("job-a", 6, 0)
    client.create_multipart_upload(Bucket=bucket, Key=pending)
    before = s3_bucket.keys()

    found, problems = ObjectTier(s3_bucket.url(), key=KEY).scan_report()
    assert [i.step for i in found] == [1]
    text = "\n".join(problems)
    assert "0000000000000002/: incomplete (MANIFEST.json missing)" in text
    assert "0000000000000003/: incomplete (rank-00002.bin missing)" in text
    assert "0000000000000004/: corrupt" in text
    assert "0000000000000005/: corrupt (rank-00000.bin of the wrong size)" in text
    assert "notes.txt: not part of the layout" in text
    assert f"incomplete multipart upload of s3://{bucket}/{pending}" in text
    assert s3_bucket.keys() == before

    assert tier.abort_incomplete_uploads() == [pending]
    assert s3_bucket.uploads() == []


@pytest.mark.slow
def test_a_store_that_never_answers_fails_the_call_instead_of_hanging(monkeypatch, tmp_path):
    with socket.socket() as silent:  # the kernel completes connections to it; nobody ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        use_endpoint(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}", tmp_path)
        tier = ObjectTier("s3://dash-nowhere/x", attempts=2, backoff=0.05, request_attempts=1,
                          connect_timeout=0.5, read_timeout=0.5, key=KEY)
        info, data = make_checkpoint()
        with pytest.raises(UnavailableError, match="dash-nowhere") as scan:
            tier.scan()
        with pytest.raises(UnavailableError) as put:
            tier.put(info, views(data))
        with pytest.raises(UnavailableError) as opened:
            with tier.open(info.job, info.step, 0):
                pass
        # Each ended by its own read timeout (read_timeout=), not by a hang the test's timeout would cut short.
        for failed in (scan, put, opened):
            assert "Read timeout" in str(failed.value), failed.value


def test_bytes_that_do_not_match_their_crc_are_refused_before_upload(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), key=KEY)
    info, data = make_checkpoint()
    data[1] = bytes([data[1][0] ^ 1]) + data[1][1:]
    with pytest.raises(ChecksumError, match="rank 1"):
        tier.put(info, views(data))
    assert s3_bucket.keys() == []


def test_a_bad_url_is_a_usage_error():
    for url in ("bucket/prefix", "s3://", "s3:///prefix"):
        with pytest.raises(UsageError):
            ObjectTier(url, key=KEY)


def _manifest(s3_bucket, tier, job, step) -> tuple[str, dict]:
    key = f"{tier.step_key(job, step)}/MANIFEST.json"
    return key, json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())


def test_a_manifest_edited_unsigned_or_signed_under_another_key_is_refused(s3_bucket):
    """What the bucket says about a checkpoint counts only under the cluster's key, which the bucket does not hold."""
    tier = ObjectTier(s3_bucket.url(), key=KEY)
    for step in (1, 2, 3, 4):
        info, data = make_checkpoint(step=step)
        tier.put(info, views(data))
    put = functools.partial(s3_bucket.client.put_object, Bucket=s3_bucket.name)
    key, edited = _manifest(s3_bucket, tier, "job-a", 2)
    edited["checkpoint"]["shards"][1]["crc"] ^= 1  # with its shard's bytes changed to match, say
    put(Key=key, Body=json.dumps(edited).encode())
    key, old = _manifest(s3_bucket, tier, "job-a", 3)
    del old["mac"], old["sha256"]  # as a dashrun before signed manifests wrote it
    put(Key=key, Body=json.dumps(old).encode())
    planted, planted_data = make_checkpoint(step=4)  # by someone with write access to the bucket, not the token
    ObjectTier(s3_bucket.url(), key=manifest_key(b"not this cluster's token")).put(planted, views(planted_data))

    fresh = ObjectTier(s3_bucket.url(), key=KEY)
    found, problems = fresh.scan_report()
    assert [i.step for i in found] == [1]
    assert len(problems) == 3 and all(p.startswith("refused ") for p in problems), problems
    text = "\n".join(problems)
    assert "0000000000000002/MANIFEST.json does not carry a valid MAC" in text
    assert "0000000000000003/MANIFEST.json is not signed" in text and "hint:" in text
    assert "0000000000000004/MANIFEST.json does not carry a valid MAC" in text
    for step in (2, 3, 4):
        with pytest.raises(SignatureError):
            fresh.read_manifest("job-a", step)
        with pytest.raises(SignatureError), fresh.open("job-a", step, 0):
            pass
    assert fresh.read_manifest("job-a", 2, signed=False).step == 2  # to delete by, nothing more
    # A signed manifest copied to another step's key is not that step's.
    put(Key=f"{tier.step_key('job-a', 5)}/MANIFEST.json", Body=json.dumps(_manifest(s3_bucket, tier, "job-a", 1)[1]))
    with pytest.raises(ChecksumError, match="describes another checkpoint"):
        fresh.read_manifest("job-a", 5)


def _same_crc32c(data: bytes) -> bytes:
    """Other bytes of the same length and CRC-32C as ``data``: CRC is linear, so no secret is needed to forge it."""
    zero = crc32c(bytes(len(data)))
    columns = []  # (the CRC change of flipping bit i, the set of bits flipped), reduced to a basis
    for bit in range(33):  # 33 vectors in a 32-dimensional space: some of them add up to nothing
        flipped = bytearray(len(data))
        flipped[bit // 8] ^= 1 << (bit % 8)
        change, bits = crc32c(bytes(flipped)) ^ zero, {bit}
        for basis_change, basis_bits in columns:
            if change ^ basis_change < change:
                change, bits = change ^ basis_change, bits ^ basis_bits
        if change == 0:
            forged = bytearray(data)
            for b in bits:
                forged[b // 8] ^= 1 << (b % 8)
            assert forged != data and crc32c(bytes(forged)) == crc32c(data)
            return bytes(forged)
        columns.append((change, bits))
        columns.sort(reverse=True)
    raise AssertionError("unreachable: 33 vectors in 32 dimensions are dependent")


def test_a_shard_edited_in_the_bucket_to_the_same_crc_is_refused_when_read(s3_bucket):
    tier = ObjectTier(s3_bucket.url(), key=KEY)
    info, data = make_checkpoint(step=7)
    tier.put(info, views(data))
    forged = _same_crc32c(data[1])
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=tier.shard_key("job-a", 7, 1), Body=forged)
    for reader in (tier, ObjectTier(s3_bucket.url(), key=KEY)):  # digests it remembers, and read from the manifest
        (listed,) = reader.scan()  # the size and the signed CRC both check out: only the digest tells
        with pytest.raises(SignatureError, match="SHA-256 of its signed manifest"):
            reader.read_into("job-a", 7, 1, memoryview(bytearray(len(forged))), shard=listed.shards[1])
        with reader.open("job-a", 7, 0) as view:
            assert bytes(view) == data[0]
