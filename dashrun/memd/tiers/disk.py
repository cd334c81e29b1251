"""The disk tier: one directory per checkpoint, committed by renaming it into place.

Durability is ``fsync always``: a checkpoint it lists has been fsynced
(files, manifest, directories) before it was renamed into place, so a crash
loses at most the checkpoint being written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Sequence

from dashrun.errors import ChecksumError, NotFoundError, ProtocolError
from dashrun.memd.tiers.base import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, SPEC, Tier
from dashrun.util.faults import crash_point
from dashrun.util.files import fsync_dir, unmap, write_atomic, write_new
from dashrun.wire.messages import CheckpointInfo, JobSpec
from dashrun.wire.protocol import crc32c, valid_job_id

__all__ = ["DiskTier", "file_crc"]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


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
