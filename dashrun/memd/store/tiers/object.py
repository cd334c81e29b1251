"""The object-storage tier: committed checkpoints in an S3 bucket, in a layout anyone can read.

Layout under ``s3://<bucket>/<prefix>`` (the layout version is part of every
key, so a later layout can live beside this one)::

    <prefix>/dashrun-v1/jobs/<job>/SPEC.json                          the job's launch spec (JobSpec body)
    <prefix>/dashrun-v1/jobs/<job>/MEMBERSHIP.json                    its membership record, signed (generation,
                                                                      events, run history: what `dashrun report` reads)
    <prefix>/dashrun-v1/jobs/<job>/<step:016d>/rank-<rank:05d>.bin    rank's shard: its raw bytes
    <prefix>/dashrun-v1/jobs/<job>/<step:016d>/MANIFEST.json          written last: the commit

``MANIFEST.json`` has the disk tier's format, ``{"format": "dashrun-checkpoint",
"version": 1, "checkpoint": <CheckpointInfo body>}``, which gives every
shard's size and CRC-32C, signed (:mod:`.signing`): each shard's SHA-256 and
a MAC under a key derived from the cluster's token, which the bucket does not
hold. Every object also carries its own CRC-32C as user
metadata ``x-amz-meta-dashrun-crc32c`` (8 hex digits) and, unless
``server_checksums=False``, as S3's additional checksum (CRC32C, whole object),
which S3 checks against the bytes it received.

Contracts:

- A checkpoint exists in this tier if and only if its manifest exists.
  :meth:`ObjectTier.put` uploads every shard (multipart with parallel parts
  for large ones) and checks each with a HEAD (size, CRC metadata, and S3's
  CRC-32C where the store reports one); one listing then shows them all
  still there, and only then is the manifest written. A failure aborts the
  multipart upload in progress, leaves no manifest, and removes what it
  uploaded if the store lets it; a crash may leave shard objects or an
  incomplete multipart upload, never a manifest (a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload``, or
  :meth:`ObjectTier.abort_incomplete_uploads`, cleans up the latter).
- A new attempt at a step first withdraws the old attempt's manifest: unlike
  the disk tier's atomic rename, the old attempt is gone from this tier once
  ``put`` begins.
- :meth:`ObjectTier.delete` removes the manifest first, then the shards.
- :meth:`ObjectTier.scan` trusts only manifests whose MAC checks out under
  the tier's ``key`` (an unsigned, edited or planted one is refused, and
  reported as such), and checks, from the listing, that every shard they name
  exists with its size; it downloads no shard data. Bytes are verified when
  read: :meth:`ObjectTier.open` and :meth:`ObjectTier.read_into` recompute the
  CRC-32C and the SHA-256 the signed manifest gives, and raise ChecksumError
  (SignatureError for the digest) on a mismatch.
- Errors: NotFoundError for what is not there, ChecksumError for bytes that
  do not match, UnavailableError for a store that cannot be reached or
  refuses, after retries.

Credentials, region and endpoint come from the standard AWS chain
(environment, ``~/.aws`` files, instance role); ``AWS_ENDPOINT_URL`` points at
an S3-compatible store. botocore retries every request (standard mode:
connection errors, 5xx, throttling, with backoff); on top of that this tier
retries a whole shard upload or download, so a multipart upload lost by the
store is started afresh (:func:`dashrun.util.retry.retry`). Connect and read
timeouts bound every request, so a dead store fails a call instead of hanging
it. :mod:`.s3` sets up the client and says which errors are worth a retry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
from typing import Callable, Iterator, Sequence, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, IncompleteReadError

from dashrun.errors import ChecksumError, NotFoundError, ProtocolError, SignatureError, UnavailableError, UsageError
from dashrun.memd.store.tiers import s3, signing
from dashrun.memd.store.tiers.base import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, SPEC, SourceChanged, Tier
from dashrun.memd.store.tiers.jobobjects import RECORD, JobObjects
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.retry import Backoff, retry
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.protocol import crc32c, valid_job_id

__all__ = ["CRC_METADATA", "LAYOUT", "LONGEST_PAUSE", "MAX_SMALL_OBJECT", "RECORD", "ObjectTier"]

log = logging.getLogger(__name__)

LAYOUT = "dashrun-v1"
#: User metadata key (``x-amz-meta-dashrun-crc32c``): the object's CRC-32C as 8 hex digits.
CRC_METADATA = "dashrun-crc32c"
#: Longest pause between tries of a whole shard transfer, in seconds.
LONGEST_PAUSE = 30.0
#: Largest manifest, spec or record downloaded (a bucket is not trusted with this process's memory).
MAX_SMALL_OBJECT = 32 << 20

T = TypeVar("T")


class ObjectTier(JobObjects, Tier):
    """Committed checkpoints in ``s3://bucket/prefix``; see the module docstring for the layout.

    ``part_size`` and ``threshold``: shards of ``threshold`` bytes or more go
    up (and come down) in parts of ``part_size``, ``workers`` at a time.
    ``attempts`` and ``backoff``: tries of a whole shard transfer and the first
    pause between them (doubling). ``request_attempts`` (botocore's
    ``total_max_attempts``, first try included), ``connect_timeout`` and
    ``read_timeout`` (seconds) apply to each request. ``server_checksums=False``
    sends no S3 additional checksums, for stores that reject them; the
    CRC-32C check on read stays. ``key`` signs the manifests it writes and
    checks those it reads (:func:`.signing.manifest_key` of the cluster's token).
    """

    name = "object"

    def __init__(self, url: str, *, part_size: int = 64 << 20, threshold: int = 64 << 20, workers: int = 8,
                 attempts: int = 4, backoff: float = 1.0, request_attempts: int = 5, connect_timeout: float = 10.0,
                 read_timeout: float = 60.0, server_checksums: bool = True, key: bytes):
        if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
            raise UsageError(f"object store {url!r} is not of the form s3://bucket/prefix")
        if part_size < s3.MIN_PART or threshold < 1 or workers < 1 or attempts < 1:
            raise UsageError(f"part size must be at least {s3.MIN_PART} bytes; threshold, workers, attempts at least 1")
        if backoff <= 0:
            raise UsageError("the backoff between tries must be positive")
        self.bucket, _, prefix = url[5:].partition("/")
        self.prefix = prefix.strip("/")
        self.root = f"{self.prefix}/{LAYOUT}" if self.prefix else LAYOUT
        self.url = f"s3://{self.bucket}/{self.prefix}"
        self.part_size, self.threshold, self.workers = part_size, threshold, workers
        self.attempts, self.backoff, self.server_checksums = attempts, backoff, server_checksums
        if not isinstance(key, bytes) or len(key) < 16:
            raise UsageError("the object tier needs the manifest key (signing.manifest_key of the cluster's token)")
        self._key = key
        # Each shard's SHA-256 from a signed manifest this tier wrote or verified, by (job, step, rank, nbytes,
        # crc): a read given the shard's header (from the listing) needs no second download of the manifest.
        self._digests: dict[tuple[str, int, int, int, int], bytes] = {}
        self._digests_lock = threading.Lock()
        #: The boto3 S3 client (thread-safe); every request of this tier goes through it.
        self.client = s3.make_client(connect_timeout=connect_timeout, read_timeout=read_timeout,
                                  request_attempts=request_attempts, connections=workers + 4)

    def close(self) -> None:
        self.client.close()

    # --- keys ----------------------------------------------------------------------------

    def job_key(self, job: str) -> str:
        if not valid_job_id(job):
            raise NotFoundError(f"invalid job id {job!r}")
        return f"{self.root}/jobs/{job}"

    def step_key(self, job: str, step: int) -> str:
        return f"{self.job_key(job)}/{step:016d}"

    def shard_key(self, job: str, step: int, rank: int) -> str:
        return f"{self.step_key(job, step)}/rank-{rank:05d}.bin"

    # --- writing ---------------------------------------------------------------------------

    def put(self, info: CheckpointInfo, shards: Sequence[memoryview]) -> None:
        if len(shards) != info.world:
            raise ValueError(f"{info.world} shards expected, {len(shards)} given")
        views = [memoryview(data).cast("B")[:shard.nbytes] for shard, data in zip(info.shards, shards)]
        for shard, view in zip(info.shards, views):  # the manifest must tell the truth about what goes up
            if len(view) != shard.nbytes or crc32c(view) != shard.crc:
                raise SourceChanged(f"{info.job} step {info.step} rank {shard.rank}: bytes do not match their CRC")
        # Of the bytes just checked: the signed digest vouches for nothing the CRC did not.
        digests = [hashlib.sha256(view).digest() for view in views]
        step_key = self.step_key(info.job, info.step)
        manifest_key = f"{step_key}/{MANIFEST}"
        started = time.monotonic()
        self._retry(f"withdraw {manifest_key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=manifest_key))
        try:
            for shard, view in zip(info.shards, views):
                key = self.shard_key(info.job, info.step, shard.rank)
                self._retry(f"upload {key}", functools.partial(self._upload, key, view, shard.crc))
            # One listing shows every shard is still there before the manifest says so.
            held = self._retry(f"list {step_key}/", lambda: {o["Key"]: o["Size"] for o in self._list(f"{step_key}/")})
            lost = [s.rank for s in info.shards if held.get(self.shard_key(info.job, info.step, s.rank)) != s.nbytes]
            if lost:
                raise UnavailableError(f"object store s3://{self.bucket}: shards of ranks {lost} of {info.job} step "
                                       f"{info.step} vanished before the commit")
            manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": info.to_body()}
            body = json.dumps(signing.sign(manifest, digests, self._key), indent=1, sort_keys=True).encode()
            self._remember(info, digests)
            self._retry(f"upload {manifest_key}", functools.partial(self._upload, manifest_key, memoryview(body)))
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: a store that is down keeps the orphans
                self._delete_step(step_key, retrying=False)
            raise
        log.debug("object tier: %s step %d uploaded (%d bytes in %.1fs)", info.job, info.step, info.nbytes,
                  time.monotonic() - started)

    def _upload(self, key: str, view: memoryview, crc: int | None = None) -> None:
        """One object, then a HEAD that shows the store holds exactly it."""
        crc = crc32c(view) if crc is None else crc
        if len(view) < self.threshold:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=s3.ViewReader(view),
                                   Metadata={CRC_METADATA: f"{crc:08x}"}, **self._checksum(crc))
        else:
            self._upload_multipart(key, view, crc)
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key,
                                           **({"ChecksumMode": "ENABLED"} if self.server_checksums else {}))
        except ClientError as e:
            if s3.error_code(e) not in s3.NOT_FOUND_CODES:
                raise
            raise s3.StoredMismatch(f"s3://{self.bucket}/{key} vanished right after its upload") from None
        stored = head.get("ChecksumCRC32C")
        if (head["ContentLength"] != len(view) or head.get("Metadata", {}).get(CRC_METADATA) != f"{crc:08x}"
                or (stored and "-" not in stored and stored != s3.b64(crc))):
            raise s3.StoredMismatch(f"s3://{self.bucket}/{key} holds other bytes than were uploaded")

    def _upload_multipart(self, key: str, view: memoryview, crc: int) -> None:
        part = max(self.part_size, -(-len(view) // s3.MAX_PARTS))
        whole = {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"} if self.server_checksums else {}
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                        Metadata={CRC_METADATA: f"{crc:08x}"}, **whole)["UploadId"]

        def send(number: int, chunk: memoryview) -> dict:
            checksum = self._checksum(crc32c(chunk))
            reply = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                            Body=s3.ViewReader(chunk), **checksum)
            checksum.pop("ChecksumAlgorithm", None)
            return {"PartNumber": number, "ETag": reply["ETag"], **checksum}

        try:
            parts = s3.run_all(self.workers, [functools.partial(send, number, view[start:start + part])
                                              for number, start in enumerate(range(0, len(view), part), 1)])
            done = {"ChecksumCRC32C": s3.b64(crc), "ChecksumType": "FULL_OBJECT"} if self.server_checksums else {}
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts}, **done)
        except BaseException:
            with contextlib.suppress(BotoCoreError, ClientError):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _checksum(self, crc: int) -> dict:
        # Given the value, botocore sends it as is: S3 checks it, and no awscrt is needed for CRC32C.
        return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": s3.b64(crc)} if self.server_checksums else {}

    # --- deleting ----------------------------------------------------------------------------

    def delete(self, job: str, step: int) -> None:
        self._delete_step(self.step_key(job, step))
        with self._digests_lock:
            for known in [k for k in self._digests if k[:2] == (job, step)]:
                del self._digests[known]

    def _remember(self, info: CheckpointInfo, digests: Sequence[bytes]) -> None:
        with self._digests_lock:
            for shard, digest in zip(info.shards, digests):
                self._digests[(info.job, info.step, shard.rank, shard.nbytes, shard.crc)] = digest

    def _digest(self, job: str, step: int, shard: ShardHeader) -> bytes:
        """The signed SHA-256 of ``shard`` (a header from this tier's listing); the manifest is read again if
        this tier has not seen it, and must still describe the same shard."""
        known = (job, step, shard.rank, shard.nbytes, shard.crc)
        with self._digests_lock:
            digest = self._digests.get(known)
        if digest is None:
            info = self.read_manifest(job, step)
            if not 0 <= shard.rank < info.world or info.shards[shard.rank] != shard:
                raise ChecksumError(f"{job} step {step}: the bucket's manifest changed since it was listed")
            with self._digests_lock:
                digest = self._digests[known]
        return digest

    def _delete_step(self, step_key: str, retrying: bool = True) -> None:
        call = self._retry if retrying else (lambda what, fn: fn())
        manifest_key = f"{step_key}/{MANIFEST}"
        # The manifest goes first: from then on the checkpoint is invisible, however far the rest gets.
        call(f"delete {manifest_key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=manifest_key))
        keys = call(f"list {step_key}/", lambda: [o["Key"] for o in self._list(f"{step_key}/")])
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            reply = call(f"delete {step_key}/", lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise UnavailableError(f"object store: could not delete {first.get('Key')}: {first.get('Code')}")

    def abort_incomplete_uploads(self) -> list[str]:
        """Abort every unfinished multipart upload under this tier's keys; the keys they were for.

        Only while no ``put`` runs on this prefix (dash-memd calls it when it starts).
        """
        aborted = []
        for upload in self._incomplete_uploads():
            self._retry(f"abort upload of {upload['Key']}", lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]))
            aborted.append(upload["Key"])
        return aborted

    # --- reading -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def open(self, job: str, step: int, rank: int) -> Iterator[memoryview]:
        """Download one shard into memory, verified against the manifest's CRC-32C."""
        shard = self._shard(job, step, rank)
        buf = bytearray(shard.nbytes)
        with memoryview(buf) as view:
            self.read_into(job, step, rank, view, shard=shard)
            yield view

    def read_into(self, job: str, step: int, rank: int, view: memoryview,
                  shard: ShardHeader | None = None) -> ShardHeader:
        """Download one shard into ``view[:nbytes]`` and verify it; returns its header from the manifest.

        ``shard`` skips reading the manifest when the caller already has it
        (from :meth:`scan`). Raises NotFoundError, ChecksumError, UnavailableError.
        """
        shard = shard or self._shard(job, step, rank)
        digest = self._digest(job, step, shard)
        target = memoryview(view).cast("B")
        if len(target) < shard.nbytes:
            raise ValueError(f"buffer of {len(target)} bytes for a shard of {shard.nbytes}")
        target = target[:shard.nbytes]
        key = self.shard_key(job, step, rank)
        self._retry(f"download {key}", functools.partial(self._download, key, target))
        if crc32c(target) != shard.crc:
            raise ChecksumError(f"s3://{self.bucket}/{key} fails its checksum")
        if hashlib.sha256(target).digest() != digest:  # a CRC-32C anyone can match; a SHA-256 under the MAC not
            raise SignatureError(f"s3://{self.bucket}/{key} does not match the SHA-256 of its signed manifest: "
                                 "changed in the bucket; not served")
        return shard

    def _download(self, key: str, target: memoryview) -> None:
        if len(target) < self.threshold:
            self._get(key, target, len(target))
        else:
            s3.run_all(self.workers, [functools.partial(self._get, key, target[start:start + self.part_size],
                                                        len(target), start)
                                      for start in range(0, len(target), self.part_size)])

    def _get(self, key: str, dest: memoryview, total: int, start: int | None = None) -> None:
        """Object ``key`` of ``total`` bytes into ``dest``: all of it, or ``len(dest)`` bytes from ``start``."""
        try:
            if start is None:
                reply = self.client.get_object(Bucket=self.bucket, Key=key)
                size = reply["ContentLength"]
            else:
                reply = self.client.get_object(Bucket=self.bucket, Key=key,
                                               Range=f"bytes={start}-{start + len(dest) - 1}")
                size = int(reply["ContentRange"].rsplit("/", 1)[1])
        except ClientError as e:
            if s3.error_code(e) == "InvalidRange":  # the object is shorter than the manifest says
                raise ChecksumError(f"s3://{self.bucket}/{key} has the wrong size") from None
            raise
        with contextlib.closing(reply["Body"]) as body:
            if size != total or reply["ContentLength"] != len(dest):
                raise ChecksumError(f"s3://{self.bucket}/{key} has the wrong size")
            got = 0
            while got < len(dest):
                n = body.readinto(dest[got:got + s3.READ_CHUNK])
                if not n:
                    raise IncompleteReadError(actual_bytes=got, expected_bytes=len(dest))
                got += n

    def _shard(self, job: str, step: int, rank: int) -> ShardHeader:
        info = self.read_manifest(job, step)
        if not 0 <= rank < info.world:
            raise NotFoundError(f"{job} step {step} has no rank {rank}")
        return info.shards[rank]

    def read_manifest(self, job: str, step: int, *, signed: bool = True) -> CheckpointInfo:
        """The manifest of ``job`` step ``step``; SignatureError unless its MAC checks out (``signed=False``:
        not checked, for deleting only, which someone with write access to the bucket could do anyway)."""
        key = f"{self.step_key(job, step)}/{MANIFEST}"
        try:
            raw = loads_bounded(self._retry(f"download {key}", functools.partial(self._get_small, key)))
            if raw.get("format") != MANIFEST_FORMAT or raw.get("version") != MANIFEST_VERSION:
                raise ValueError("unknown manifest format")
            info = CheckpointInfo.from_body(raw["checkpoint"])
            if signed:  # after parsing: a digest list is checked against the world the manifest gives
                self._remember(info, signing.verify(raw, self._key, f"s3://{self.bucket}/{key}", info.world))
        except NotFoundError:
            raise NotFoundError(f"{job} step {step} is not in the object store") from None
        except (ValueError, KeyError, TypeError, AttributeError, ProtocolError) as e:
            raise ChecksumError(f"s3://{self.bucket}/{key} is corrupt ({e})") from None
        if info.job != job or info.step != step:
            raise ChecksumError(f"s3://{self.bucket}/{key} describes another checkpoint")
        return info

    def _get_small(self, key: str) -> bytes:
        with contextlib.closing(self.client.get_object(Bucket=self.bucket, Key=key)["Body"]) as body:
            data = body.read(MAX_SMALL_OBJECT + 1)
        if len(data) > MAX_SMALL_OBJECT:  # ValueError: the callers' "corrupt", not worth a retry
            raise ValueError(f"larger than {MAX_SMALL_OBJECT} bytes")
        return data

    def steps(self, job: str) -> list[int]:
        """The steps of ``job`` with any object in the store (a manifest or not), in order."""
        names = self._subdirs(f"{self.job_key(job)}/")
        return sorted(int(name) for name in names if len(name) == 16 and name.isdigit())

    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        """(complete checkpoints, what was skipped and why); changes nothing in the store."""
        prefix = f"{self.root}/jobs/"
        objects = self._retry(f"list {prefix}", lambda: {o["Key"]: o["Size"] for o in self._list(prefix)})
        steps: dict[tuple[str, str], dict[str, int]] = {}
        problems: list[str] = []
        for key, size in objects.items():
            parts = key[len(prefix):].split("/")
            if len(parts) == 2 and parts[1] in (SPEC, RECORD):
                continue
            if len(parts) != 3:
                problems.append(f"ignored s3://{self.bucket}/{key}: not part of the layout")
                continue
            steps.setdefault((parts[0], parts[1]), {})[parts[2]] = size
        found: list[CheckpointInfo] = []
        for (job, name), files in sorted(steps.items()):
            where = f"s3://{self.bucket}/{prefix}{job}/{name}/"
            if not (valid_job_id(job) and len(name) == 16 and name.isdigit()):
                problems.append(f"ignored {where}: not a checkpoint")
                continue
            if MANIFEST not in files:
                problems.append(f"ignored {where}: incomplete ({MANIFEST} missing)")
                continue
            try:
                info = self.read_manifest(job, int(name))
            except NotFoundError:
                continue  # deleted since the listing
            except SignatureError as e:
                problems.append(f"refused {where}: {e}")
                continue
            except ChecksumError as e:
                problems.append(f"ignored {where}: corrupt ({e})")
                continue
            names = [f"rank-{s.rank:05d}.bin" for s in info.shards]
            missing = [n for n in names if n not in files]
            wrong = [n for n, s in zip(names, info.shards) if files.get(n, s.nbytes) != s.nbytes]
            if missing:
                problems.append(f"ignored {where}: incomplete ({', '.join(missing)} missing)")
            elif wrong:
                problems.append(f"ignored {where}: corrupt ({', '.join(wrong)} of the wrong size)")
            else:
                found.append(info)
        try:
            for upload in self._incomplete_uploads():
                problems.append(f"incomplete multipart upload of s3://{self.bucket}/{upload['Key']} "
                                f"since {upload.get('Initiated')}")
        except UnavailableError as e:  # e.g. no s3:ListBucketMultipartUploads permission
            problems.append(f"could not list incomplete multipart uploads: {e}")
        return found, problems

    # --- plumbing ------------------------------------------------------------------------------

    def _subdirs(self, prefix: str) -> list[str]:
        """The names of the "directories" right under ``prefix`` (which ends in /)."""
        def names() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                          Delimiter="/")
            return [p["Prefix"][len(prefix):-1] for page in pages for p in page.get("CommonPrefixes", [])]

        return self._retry(f"list {prefix}", names)

    def _list(self, prefix: str) -> Iterator[dict]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def _incomplete_uploads(self) -> list[dict]:
        def listing():
            return [u for page in self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=f"{self.root}/") for u in page.get("Uploads", [])
                if u["Key"].startswith(f"{self.root}/")]
        return self._retry("list multipart uploads", listing)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried again after transient failures; store errors come out as DashErrors."""
        def warn(e: BaseException, pause: float) -> None:
            log.warning("object tier: %s failed (%s); retrying in %.1fs", what, e, pause)

        try:
            return retry(fn, on=Exception, backoff=Backoff(min(self.backoff, LONGEST_PAUSE), LONGEST_PAUSE),
                         attempts=self.attempts, giving_up=lambda e: not s3.transient(e), on_retry=warn)
        except ClientError as e:
            if s3.error_code(e) in s3.NOT_FOUND_CODES:
                raise NotFoundError(f"s3://{self.bucket}: {what}: not found") from e
            raise UnavailableError(f"object store s3://{self.bucket}: {what} failed: {e}",
                                   hint="check the endpoint, the bucket and the credentials") from e
        except BotoCoreError as e:
            raise UnavailableError(f"object store s3://{self.bucket}: {what} failed: {e}",
                                   hint="check the endpoint, the bucket and the credentials") from e
