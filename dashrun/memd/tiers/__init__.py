"""Where dash-memd keeps committed checkpoints: one small interface, one class per tier.

Every tier stores whole committed checkpoints (all shards of one step of one
job), hands out one shard's bytes for reading, deletes, and lists what it
holds. A checkpoint becomes visible in a tier only once it is complete and
verified there. The conformance suite in ``tests/test_tiers.py`` runs the same
tests against each tier.

Durability of the disk tier is ``fsync always``: a checkpoint it lists has
been fsynced (files, manifest, directories) before it was renamed into
place, so a crash loses at most the checkpoint being written.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import errno
import json
import logging
import mmap
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Iterator, Sequence

from dashrun.errors import ChecksumError, NoSpaceError, NotFoundError, ProtocolError
from dashrun.util.faults import crash_point
from dashrun.util.files import fsync_dir, populated, unmap, write_atomic, write_new
from dashrun.util.units import format_size
from dashrun.wire.messages import CheckpointInfo, JobSpec
from dashrun.wire.protocol import crc32c, valid_job_id

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
SPEC = "SPEC.json"
MANIFEST_FORMAT = "dashrun-checkpoint"
MANIFEST_VERSION = 1
_CHUNK = 8 << 20


class Tier(abc.ABC):
    """A place that holds committed checkpoints."""

    name: str

    @abc.abstractmethod
    def put(self, info: CheckpointInfo, shards: Sequence[memoryview]) -> None:
        """Store a committed checkpoint; ``shards[r]`` is rank r's bytes, whose CRC is in ``info``."""

    @abc.abstractmethod
    def open(self, job: str, step: int, rank: int) -> contextlib.AbstractContextManager[memoryview]:
        """One shard's bytes, readable while the context lasts. Raises NotFoundError."""

    @abc.abstractmethod
    def delete(self, job: str, step: int) -> None:
        """Forget a checkpoint; a no-op if the tier does not hold it."""

    @abc.abstractmethod
    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        """(every complete, verified checkpoint the tier holds; what was skipped, and why)."""

    def scan(self) -> list[CheckpointInfo]:
        """Every complete, verified checkpoint the tier holds; what was skipped is logged."""
        found, problems = self.scan_report()
        for problem in problems:
            log.warning("%s tier: %s", self.name, problem)
        return found


# --- RAM -------------------------------------------------------------------------


class RamTier(Tier):
    """Shards in anonymous memory, within a byte limit, with buffers reused.

    Freed buffers stay mapped in a pool keyed by size class: a job's shards
    have nearly the same size every save (a layout description grows by a
    digit now and then), and touching fresh pages costs far more than reusing
    touched ones. Sizes round up to 1/32 of their power of two (at most ~6 %
    slack). The pool gives buffers of other classes back to the OS when the
    limit would otherwise be exceeded.
    """

    name = "ram"

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._in_use = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._held: dict[tuple[str, int], tuple[CheckpointInfo, list[mmap.mmap]]] = {}

    @property
    def used(self) -> int:
        return self._in_use

    @staticmethod
    def size_class(nbytes: int) -> int:
        granule = max(4096, 1 << max(0, nbytes.bit_length() - 5))
        return max(granule, -(-nbytes // granule) * granule)

    def reserve(self, nbytes: int) -> mmap.mmap | None:
        """A buffer of at least ``nbytes`` (its size class), or None if the limit does not allow it now."""
        size = self.size_class(nbytes)
        with self._lock:
            pooled = self._free.get(size)
            if pooled:
                buf = pooled.pop()
                self._free_bytes -= size
            else:
                if self._in_use + size > self.limit:
                    return None
                # Give pooled buffers of other sizes back until the new one fits.
                while self._in_use + self._free_bytes + size > self.limit and self._free_bytes:
                    other = next(s for s, bufs in self._free.items() if bufs)
                    self._free[other].pop().close()
                    self._free_bytes -= other
                buf = mmap.mmap(-1, size)
            self._in_use += size
            return buf

    def prewarm(self, sizes: Sequence[int]) -> int:
        """Put a touched buffer in the pool for each of ``sizes`` (shards expected next), as far as the limit
        allows; returns how many it made.

        A receive into fresh pages faults on every page while the socket waits, several times slower than
        the stream itself on some VMs; pages touched here, ahead of the next checkpoint and outside any lock,
        cost that checkpoint nothing. Pooled buffers never stand in a receive's way: reserve() gives them back.
        """
        wanted = collections.Counter(self.size_class(nbytes) for nbytes in sizes)
        made = 0
        for size, count in wanted.items():
            while True:
                with self._lock:
                    if len(self._free.get(size, ())) >= count or self._in_use + self._free_bytes + size > self.limit:
                        break
                try:
                    buf = populated(size)
                except OSError as e:
                    log.warning("RAM tier: cannot prepare a %d-byte buffer ahead of need: %s", size, e)
                    return made
                with self._lock:
                    if self._in_use + self._free_bytes + size > self.limit:  # a receive took the room meanwhile
                        buf.close()
                        return made
                    self._free.setdefault(size, []).append(buf)
                    self._free_bytes += size
                made += 1
                log.info("RAM tier: a %s buffer touched ahead of the next checkpoint", format_size(size))
        return made

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._in_use -= len(buf)
            self._free.setdefault(len(buf), []).append(buf)
            self._free_bytes += len(buf)

    def adopt(self, info: CheckpointInfo, buffers: list[mmap.mmap]) -> None:
        """Take ownership of buffers already filled (and verified) by the receive path."""
        with self._lock:
            self._held[(info.job, info.step)] = (info, buffers)

    def detach(self, job: str, step: int, buffers) -> list[mmap.mmap]:
        """Stop holding ``buffers`` as (job, step) — only if they are what is held there — and return them.

        The caller releases them; identity matters because a newer attempt at
        the same step may already be held under the same key.
        """
        buffers = list(buffers)
        with self._lock:
            held = self._held.get((job, step))
            if held is not None and len(held[1]) == len(buffers) and all(a is b for a, b in zip(held[1], buffers)):
                del self._held[(job, step)]
        return buffers

    def holds(self, job: str, step: int) -> bool:
        return (job, step) in self._held

    def put(self, info: CheckpointInfo, shards: Sequence[memoryview]) -> None:
        buffers = []
        try:
            for shard, data in zip(info.shards, shards):
                buf = self.reserve(shard.nbytes)
                if buf is None:
                    raise NoSpaceError(f"RAM tier full ({self.limit} bytes)")
                buffers.append(buf)
                with memoryview(buf) as view:
                    view[:shard.nbytes] = data
        except BaseException:
            for buf in buffers:
                self.release(buf)
            raise
        self.adopt(info, buffers)

    @contextlib.contextmanager
    def open(self, job: str, step: int, rank: int) -> Iterator[memoryview]:
        held = self._held.get((job, step))
        if held is None or not 0 <= rank < len(held[1]):
            raise NotFoundError(f"{job} step {step} rank {rank} is not in RAM")
        info, buffers = held
        with memoryview(buffers[rank]) as view:
            yield view[:info.shards[rank].nbytes]

    def delete(self, job: str, step: int) -> None:
        with self._lock:
            held = self._held.pop((job, step), None)
        if held:
            for buf in held[1]:
                self.release(buf)

    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        return [info for info, _ in list(self._held.values())], []


# --- disk --------------------------------------------------------------------------


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(view):
            crc = crc32c(view[:n], crc)
    return crc


class DiskTier(Tier):
    """Checkpoints under ``root/jobs/<job>/<step>/``: one file per shard and a manifest.

    A checkpoint is written into a hidden temporary directory — shard files,
    then the manifest, each fsynced — and renamed into place, so a step
    directory exists only complete. The manifest carries every shard's size
    and CRC-32C; :meth:`scan` trusts manifests, re-verifies the shards they
    name, and reports (never loads) anything partial or corrupt.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.jobs = self.root / "jobs"
        self.jobs.mkdir(parents=True, exist_ok=True)

    def _job_dir(self, job: str) -> Path:
        if not valid_job_id(job):
            raise NotFoundError(f"invalid job id {job!r}")
        return self.jobs / job

    def step_dir(self, job: str, step: int) -> Path:
        return self._job_dir(job) / f"{step:016d}"

    def put(self, info: CheckpointInfo, shards: Sequence[memoryview]) -> None:
        job_dir = self._job_dir(info.job)
        if not job_dir.exists():
            job_dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.jobs)
        tmp = job_dir / f".tmp-{info.step:016d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for shard, data in zip(info.shards, shards, strict=True):
                write_new(tmp / f"rank-{shard.rank:05d}.bin", data[:shard.nbytes], bypass_cache=True)
                crash_point("disk.mid_write", job=info.job, step=info.step)
            manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": info.to_body()}
            write_new(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            fsync_dir(tmp)
            crash_point("disk.before_rename", job=info.job, step=info.step)
            final = self.step_dir(info.job, info.step)
            if final.exists():  # a newer attempt at the same step replaces the old one
                trash = job_dir / f".trash-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
                os.rename(tmp, final)
                fsync_dir(job_dir)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
                fsync_dir(job_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @contextlib.contextmanager
    def open(self, job: str, step: int, rank: int) -> Iterator[memoryview]:
        path = self.step_dir(job, step) / f"rank-{rank:05d}.bin"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"{job} step {step} rank {rank} is not on disk") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                yield memoryview(b"")
                return
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()
                unmap(mapped)
        finally:
            os.close(fd)

    def delete(self, job: str, step: int) -> None:
        final = self.step_dir(job, step)
        trash = final.parent / f".trash-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def put_spec(self, spec: JobSpec, job: str) -> None:
        job_dir = self._job_dir(job)
        job_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(job_dir / SPEC, json.dumps(spec.to_body(), indent=1))

    def delete_spec(self, job: str) -> None:
        (self._job_dir(job) / SPEC).unlink(missing_ok=True)

    def specs(self) -> dict[str, JobSpec]:
        """Every job's launch spec on disk; unreadable ones are skipped with a warning."""
        found = {}
        for path in self.jobs.glob(f"*/{SPEC}"):
            if not valid_job_id(path.parent.name):
                continue
            try:
                found[path.parent.name] = JobSpec.from_body(json.loads(path.read_text()))
            except (ValueError, ProtocolError) as e:
                log.warning("disk tier: ignored %s: %s", path, e)
        return found

    def read_manifest(self, step_dir: Path) -> CheckpointInfo:
        raw = json.loads((step_dir / MANIFEST).read_text())
        if raw.get("format") != MANIFEST_FORMAT or raw.get("version") != MANIFEST_VERSION:
            raise ValueError("unknown manifest format")
        return CheckpointInfo.from_body(raw["checkpoint"])

    def verify(self, step_dir: Path, info: CheckpointInfo) -> None:
        for shard in info.shards:
            path = step_dir / f"rank-{shard.rank:05d}.bin"
            if path.stat().st_size != shard.nbytes:
                raise ChecksumError(f"{path.name} has the wrong size")
            if file_crc(path) != shard.crc:
                raise ChecksumError(f"{path.name} fails its checksum")

    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        """(verified checkpoints, what was skipped and why). Removes leftovers of interrupted writes."""
        found: list[CheckpointInfo] = []
        problems: list[str] = []
        for job_dir in sorted(p for p in self.jobs.iterdir() if p.is_dir()):
            if not valid_job_id(job_dir.name):
                problems.append(f"ignored {job_dir}: not a job directory")
                continue
            for step_dir in sorted(job_dir.iterdir()):
                if step_dir.name == SPEC or step_dir.name.startswith(f".{SPEC}."):
                    continue
                if step_dir.name.startswith((".tmp-", ".trash-")):
                    problems.append(f"removed {step_dir}: left by an interrupted write")
                    shutil.rmtree(step_dir, ignore_errors=True)
                    continue
                if not (step_dir.is_dir() and step_dir.name.isdigit()):
                    problems.append(f"ignored {step_dir}: not a checkpoint directory")
                    continue
                try:
                    info = self.read_manifest(step_dir)
                    if info.job != job_dir.name or info.step != int(step_dir.name):
                        raise ValueError("manifest describes another checkpoint")
                    self.verify(step_dir, info)
                except FileNotFoundError as e:
                    problems.append(f"ignored {step_dir}: incomplete ({Path(e.filename or '').name} missing)")
                except (ValueError, KeyError, TypeError, ChecksumError, ProtocolError) as e:
                    problems.append(f"ignored {step_dir}: corrupt ({e})")
                except OSError as e:
                    if e.errno == errno.EIO:
                        problems.append(f"ignored {step_dir}: unreadable ({e.strerror})")
                    else:
                        raise
                else:
                    found.append(info)
        return found, problems
