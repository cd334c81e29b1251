"""The disk tier: one directory per checkpoint, committed by renaming it into place.

Durability is ``fsync always``: a checkpoint it lists has been fsynced
(files, manifest, directories) before it was renamed into place, so a crash
loses at most the checkpoint being written. A new attempt at a step already
on disk is swapped in with one ``renameat2(RENAME_EXCHANGE)``, so the step's
directory always exists complete; where the file system has no such call, the
old copy is moved aside (``.replaced-<step>-*``) and the new one renamed into
place, and a scan after a crash in between puts the complete copy back in
place (the new attempt's if it is complete, else the old one). A removal
(:meth:`DiskTier.delete`) is fsynced, and the data dir's deletions are
recorded (:attr:`DiskTier.tombstones`, :mod:`dashrun.memd.store.tombstones`)
before they are carried out, so that the catalogue's start never loads a
deleted step a crash brought back. Bytes are checked against their CRC-32C as
they are written (a copy whose bytes changed in RAM since they arrived is
never renamed into place) and as they are read; a copy that fails then is
moved under ``quarantine/``, never deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

from dashrun.errors import ChecksumError, NotFoundError, ProtocolError
from dashrun.memd.store.tiers.base import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, SPEC, SourceChanged, Tier
from dashrun.memd.store.tombstones import TOMBSTONES, Tombstones
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.faults import crash_point
from dashrun.util.files import discard_tree, fsync_dir, unmap, write_atomic, write_new
from dashrun.wire.messages import CheckpointInfo, JobSpec, ShardHeader
from dashrun.wire.protocol import crc32c, valid_job_id

__all__ = ["DiskTier", "QUARANTINE", "REPLACED", "exchange", "file_crc"]

log = logging.getLogger(__name__)

#: Directory under the data dir where copies that fail their checksum are moved.
QUARANTINE = "quarantine"
_CHUNK = 8 << 20
#: Seconds a shard file found right is not read whole again while it is unchanged (same inode, size, mtime).
RECHECK_AFTER = 30.0
#: Prefix of a step's directory moved aside while a new attempt replaces it without RENAME_EXCHANGE.
REPLACED = ".replaced-"
#: renameat2(2) flag: swap two paths atomically (Linux 3.15; not every file system has it).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(view):
            crc = crc32c(view[:n], crc)
    return crc


def _write_shard(path: Path, data: memoryview, shard: ShardHeader) -> None:
    """Write a shard's file, checking the bytes as they are written against the shard's CRC-32C from when
    it arrived: RAM that changed since (a bit flipped) raises SourceChanged, and the caller discards the copy."""
    crc = 0

    def written(piece: memoryview) -> None:
        nonlocal crc
        crc = crc32c(piece, crc)

    write_new(path, data, bypass_cache=True, written_piece=written)
    if crc != shard.crc:
        raise SourceChanged(f"{shard.job} step {shard.step} rank {shard.rank}'s bytes have changed in RAM since "
                            "they arrived")


def _fd_crc(fd: int, offset: int, end: int, crc: int = 0) -> int:
    """CRC-32C of a file's bytes ``offset:end`` continuing ``crc``, read with pread: an I/O error is an
    OSError here, where through a mapping it would be a SIGBUS."""
    buf = memoryview(bytearray(min(_CHUNK, max(end - offset, 1))))
    while offset < end:
        n = os.preadv(fd, [buf[:min(len(buf), end - offset)]], offset)
        if n == 0:
            break
        crc = crc32c(buf[:n], crc)
        offset += n
    return crc


def _renameat2():
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_RENAMEAT2 = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where the kernel or the file system cannot (the caller falls back)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    # EPERM: a seccomp filter that does not know the call; a real permission error recurs in the fallback.
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


class DiskTier(Tier):
    """Checkpoints under ``root/jobs/<job>/<step>/``: one file per shard and a manifest.

    A checkpoint is written into a hidden temporary directory — shard files,
    then the manifest, each fsynced — and renamed into place, so a step
    directory exists only complete. The manifest carries every shard's size
    and CRC-32C; :meth:`scan` reads manifests and file sizes only and reports
    (never loads) anything partial; the bytes are checked when read
    (:meth:`open` with the shard's header, :meth:`check`). A copy whose bytes
    fail goes to ``root/quarantine/<job>/<step>-<hex>`` (:meth:`quarantine`);
    :attr:`quarantined` counts them per job. :attr:`tombstones` are the data dir's deletions not every tier
    has caught up with; the catalogue records each before it deletes anything, and applies them to a scan.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.jobs = self.root / "jobs"
        self.jobs.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir = self.root / QUARANTINE
        #: job -> copies of it in quarantine (they stay until an operator removes them)
        self.quarantined: dict[str, int] = {}
        #: (job, step, rank) -> (the file's identity, when its bytes were last found right or last read)
        self._checked: dict[tuple[str, int, int], tuple[tuple[int, int, int, int], float]] = {}
        #: (job, step, rank) -> reads of it open now: a shard open for reading stays checked while it is
        self._open: dict[tuple[str, int, int], int] = {}
        #: (job, step, rank) -> the check of it under way, which reads that come meanwhile wait for
        self._checking: dict[tuple[str, int, int], threading.Event] = {}
        self._lock = threading.Lock()  # guards the three above
        self.tombstones = Tombstones(self.root / TOMBSTONES)
        self.tombstones.purged_by(self.name)
        if self.quarantine_dir.is_dir():
            for job_dir in self.quarantine_dir.iterdir():
                if job_dir.is_dir() and valid_job_id(job_dir.name):
                    self.quarantined[job_dir.name] = sum(1 for _ in job_dir.iterdir())

    def _job_dir(self, job: str) -> Path:
        if not valid_job_id(job):
            raise NotFoundError(f"invalid job id {job!r}")
        return self.jobs / job

    def step_dir(self, job: str, step: int) -> Path:
        return self._job_dir(job) / f"{step:016d}"

    def put(self, info: CheckpointInfo, shards: Sequence[memoryview], *,
            guard: Callable[[], bool] | None = None) -> bool:
        """Write a checkpoint and rename it into place. ``guard``, if given, is called right before the rename:
        if it returns False the copy is discarded and put returns False. (The caller may take a lock in it, to
        release after put returns, so that nothing changes its mind in between.)"""
        job_dir = self._job_dir(info.job)
        if not job_dir.exists():
            job_dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.jobs)
        tmp = job_dir / f".tmp-{info.step:016d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for shard, data in zip(info.shards, shards, strict=True):
                _write_shard(tmp / f"rank-{shard.rank:05d}.bin", data[:shard.nbytes], shard)
                crash_point("disk.mid_write", job=info.job, step=info.step)
            manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": info.to_body()}
            write_new(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            fsync_dir(tmp)
            crash_point("disk.before_rename", job=info.job, step=info.step)
            if guard is not None and not guard():
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            final = self.step_dir(info.job, info.step)
            if final.exists():  # a newer attempt at the same step replaces the old one
                if exchange(tmp, final):  # the old attempt now sits at tmp, removed below
                    crash_point("disk.mid_replace", job=info.job, step=info.step)
                else:  # a crash between these renames leaves no step directory: the scan puts a copy back
                    aside = job_dir / f"{REPLACED}{info.step:016d}-{uuid.uuid4().hex[:8]}"
                    os.rename(final, aside)
                    crash_point("disk.mid_replace", job=info.job, step=info.step)
                    os.rename(tmp, final)
                    tmp = aside
                fsync_dir(job_dir)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.rename(tmp, final)
                fsync_dir(job_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True

    def _open_shard(self, job: str, step: int, rank: int) -> int:
        path = self.step_dir(job, step) / f"rank-{rank:05d}.bin"
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"{job} step {step} rank {rank} is not on disk") from None

    @staticmethod
    def _check_fd(fd: int, shard: ShardHeader, offset: int = 0, crc: int = 0, most: int | None = None
                  ) -> tuple[int, int]:
        where = f"{shard.job} step {shard.step} rank {shard.rank} on disk"
        if os.fstat(fd).st_size != shard.nbytes:
            raise ChecksumError(f"{where} has the wrong size")
        end = shard.nbytes if most is None else min(shard.nbytes, offset + most)
        try:
            crc = _fd_crc(fd, offset, end, crc)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            raise ChecksumError(f"{where} is unreadable ({e.strerror})") from None
        if end == shard.nbytes and crc != shard.crc:
            raise ChecksumError(f"{where} fails its checksum")
        return end, crc

    def check(self, shard: ShardHeader, *, offset: int = 0, crc: int = 0, most: int | None = None
              ) -> tuple[int, int]:
        """Read one shard file: ChecksumError if its size or CRC-32C is not the header's (or it is
        unreadable), NotFoundError if it is gone. In parts: read at most ``most`` bytes from ``offset``,
        continuing ``crc`` (that of the bytes before); returns (where it stopped, the CRC up to there)."""
        fd = self._open_shard(shard.job, shard.step, shard.rank)
        try:
            return self._check_fd(fd, shard, offset, crc, most)
        finally:
            # A check of everything on disk must not crowd dash-memd's RAM buffers out of the page cache.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    @contextlib.contextmanager
    def open(self, job: str, step: int, rank: int, shard: ShardHeader | None = None) -> Iterator[memoryview]:
        """One shard's bytes, mapped. With its ``shard`` header, the bytes are checked first, once per read
        session: not again while a read of the same file is open, nor for RECHECK_AFTER seconds after the last
        one ends; reads that come while it is checked wait for that check (see :meth:`check`)."""
        fd = self._open_shard(job, step, rank)
        key = (job, step, rank)
        try:
            if shard is not None:
                self._check_once(fd, key, shard)
            with self._lock:
                self._open[key] = self._open.get(key, 0) + 1
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
                with self._lock:
                    self._open[key] -= 1
                    if not self._open[key]:
                        del self._open[key]
                        checked = self._checked.get(key)
                        if checked is not None:  # the session ends: the next check is due RECHECK_AFTER from now
                            self._checked[key] = (checked[0], time.monotonic())
        finally:
            os.close(fd)

    @staticmethod
    def _identity(fd: int) -> tuple[int, int, int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _check_once(self, fd: int, key: tuple[str, int, int], shard: ShardHeader) -> None:
        """Check the file's bytes unless this very file (same inode, size, mtime) is open for another read or
        was found right less than RECHECK_AFTER seconds ago; a check already under way is waited for, not
        made twice. A restore reads one shard in many byte ranges over several streams: one check covers them
        all, however long it takes."""
        identity = self._identity(fd)
        while True:
            with self._lock:
                checked = self._checked.get(key)
                if checked is not None and checked[0] == identity and (
                        self._open.get(key) or time.monotonic() - checked[1] < RECHECK_AFTER):
                    return
                flight = self._checking.get(key)
                if flight is None:
                    flight = self._checking[key] = threading.Event()
                    break
            flight.wait()  # then look again: found right, or this read checks (the other's check failed)
        try:
            self._check_fd(fd, shard)  # read through the page cache: the mapping then finds the pages there
            with self._lock:
                now = time.monotonic()
                if len(self._checked) > 1024:  # forget what a new check would be due for anyway
                    self._checked = {k: v for k, v in self._checked.items()
                                     if k in self._open or now - v[1] < RECHECK_AFTER}
                self._checked[key] = (identity, now)
        finally:
            with self._lock:
                del self._checking[key]
            flight.set()

    def quarantine(self, job: str, step: int) -> Path | None:
        """Move a step's directory under ``quarantine/`` (not fsynced: if the move is lost in a crash, the copy
        is found bad again); returns where it went, None if it was not there."""
        target = self.quarantine_dir / job / f"{step:016d}-{uuid.uuid4().hex[:8]}"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self.step_dir(job, step), target)
        except FileNotFoundError:
            return None
        self.quarantined[job] = self.quarantined.get(job, 0) + 1
        return target

    def delete(self, job: str, step: int) -> None:
        """Remove a step's directory, durably once this returns (OSError if not)."""
        discard_tree(self.step_dir(job, step))

    def put_spec(self, spec: JobSpec, job: str) -> None:
        job_dir = self._job_dir(job)
        job_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(job_dir / SPEC, json.dumps(spec.to_body(), indent=1))

    def delete_spec(self, job: str) -> None:
        """Remove a job's launch spec, durably once this returns (OSError if not)."""
        job_dir = self._job_dir(job)
        try:
            (job_dir / SPEC).unlink()
        except FileNotFoundError:
            return
        fsync_dir(job_dir)  # until then a crash can bring the spec back, and resume the job deleted

    def specs(self) -> dict[str, JobSpec]:
        """Every job's launch spec on disk; unreadable ones are skipped with a warning."""
        found = {}
        for path in self.jobs.glob(f"*/{SPEC}"):
            if not valid_job_id(path.parent.name):
                continue
            try:
                found[path.parent.name] = JobSpec.from_body(loads_bounded(path.read_bytes()))
            except (ValueError, ProtocolError) as e:
                log.warning("disk tier: ignored %s: %s", path, e)
        return found

    def read_manifest(self, step_dir: Path) -> CheckpointInfo:
        raw = loads_bounded((step_dir / MANIFEST).read_bytes())
        if raw.get("format") != MANIFEST_FORMAT or raw.get("version") != MANIFEST_VERSION:
            raise ValueError("unknown manifest format")
        return CheckpointInfo.from_body(raw["checkpoint"])

    def verify(self, step_dir: Path, info: CheckpointInfo, *, read: bool = True) -> None:
        """ChecksumError unless every shard file has its size and (with ``read``) its CRC-32C."""
        for shard in info.shards:
            path = step_dir / f"rank-{shard.rank:05d}.bin"
            if path.stat().st_size != shard.nbytes:
                raise ChecksumError(f"{path.name} has the wrong size")
            if read and file_crc(path) != shard.crc:
                raise ChecksumError(f"{path.name} fails its checksum")

    def _complete(self, step_dir: Path, job: str, step: int) -> CheckpointInfo:
        """The checkpoint in ``step_dir`` if it is complete (its manifest, of ``job`` step ``step``, and every
        shard file of its size); raises as :meth:`scan_report` reports."""
        info = self.read_manifest(step_dir)
        if info.job != job or info.step != step:
            raise ValueError("manifest describes another checkpoint")
        self.verify(step_dir, info, read=False)
        return info

    def _finish_replacements(self, job_dir: Path, problems: list[str]) -> None:
        """Where a replacement without RENAME_EXCHANGE was interrupted between its renames, the step has no
        directory, its old copy is at ``.replaced-<step>-*`` and the new one at ``.tmp-<step>-*``: put the new
        copy in place if it is complete (the newest, if several are), else the old one. The other is left
        for the scan to remove."""
        for aside in sorted(job_dir.glob(f"{REPLACED}*")):
            name = aside.name[len(REPLACED):].partition("-")[0]
            final = job_dir / name
            if not name.isdigit() or final.exists():
                continue  # the replacement got as far as its second rename
            newest: tuple[float, Path] | None = None
            for copy in sorted(job_dir.glob(f".tmp-{name}-*")):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ChecksumError, ProtocolError):
                    committed_at = self._complete(copy, job_dir.name, int(name)).committed_at
                    if newest is None or committed_at > newest[0]:
                        newest = (committed_at, copy)
            chosen = newest[1] if newest is not None else aside
            os.rename(chosen, final)
            fsync_dir(job_dir)
            problems.append(f"recovered {final} from {chosen.name}: its replacement by a new attempt was interrupted")

    def drop_deleted(self, found: list[CheckpointInfo]) -> tuple[list[CheckpointInfo], list[str]]:
        """Of the checkpoints a scan found, remove again those a tombstone covers (a removal a crash undid, or
        one that failed); returns the others, and what was removed or could not be. The disk has caught up
        with each tombstone whose checkpoints are all gone (:meth:`Tombstones.purged`)."""
        kept, problems, behind = [], [], set()
        for info in found:
            tombstone = self.tombstones.covering(info)
            if tombstone is None:
                kept.append(info)
                continue
            try:
                self.delete(info.job, info.step)
            except OSError as e:
                behind.add(tombstone)
                problems.append(f"ignored {info.job} step {info.step}: deleted, and it cannot be removed "
                                f"({e.strerror or e})")
            else:
                problems.append(f"removed {info.job} step {info.step}: deleted before dash-memd stopped")
        for tombstone in self.tombstones.records():
            if tombstone not in behind:
                self.tombstones.purged(tombstone, self.name)
        return kept, problems

    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        """(complete checkpoints, what was skipped and why). Removes leftovers of interrupted writes, after
        putting back in place a step's copy that an interrupted replacement left aside.

        Reads manifests and file sizes only, so a start does not wait for every shard to be read: damage of
        the same size shows when the bytes are read (:meth:`check`). Deletions are not applied here: see
        :meth:`drop_deleted`.
        """
        found: list[CheckpointInfo] = []
        problems: list[str] = []
        for job_dir in sorted(p for p in self.jobs.iterdir() if p.is_dir()):
            if not valid_job_id(job_dir.name):
                problems.append(f"ignored {job_dir}: not a job directory")
                continue
            self._finish_replacements(job_dir, problems)
            for step_dir in sorted(job_dir.iterdir()):
                if step_dir.name == SPEC or step_dir.name.startswith(f".{SPEC}."):
                    continue
                if step_dir.name.startswith((".tmp-", ".trash-", REPLACED)):
                    problems.append(f"removed {step_dir}: left by an interrupted write")
                    shutil.rmtree(step_dir, ignore_errors=True)
                    continue
                if not (step_dir.is_dir() and step_dir.name.isdigit()):
                    problems.append(f"ignored {step_dir}: not a checkpoint directory")
                    continue
                try:
                    info = self._complete(step_dir, job_dir.name, int(step_dir.name))
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
