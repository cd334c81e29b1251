"""Disk copies checked against their CRC-32C: every read, and after a start in the background.

dash-memd starts serving as soon as it has listed its disk from the
manifests and the files' sizes; :meth:`DiskVerifier.next` then reads every
shard file it listed, each job's newest checkpoint first (run between the
disk writer's writes, so the two never compete for the disk). A read of a
disk copy checks its bytes before they are sent, whether or not that pass
got to them yet.

A copy whose bytes fail (or that is gone) leaves the disk tier:
:meth:`DiskVerifier.failed` moves its directory under the data dir's
``quarantine/`` (never deleting it), logs it and counts it on its job. The
checkpoint is then read from the bucket if the bucket holds it; otherwise
it leaves the catalogue, so the next request for the job's newest
checkpoint gets the one before it.
"""

from __future__ import annotations

import collections
import logging
import threading

from dashrun.errors import ChecksumError, DashError, NotFoundError
from dashrun.memd.store.entry import Entry
from dashrun.memd.store.ledger import Ledger
from dashrun.memd.store.tiers import DiskTier

__all__ = ["DiskVerifier"]

log = logging.getLogger(__name__)


class DiskVerifier:
    """The shard files listed at start and not read yet; what to do with a disk copy that fails."""

    #: Most bytes one call of :meth:`next` reads: a write waiting for the disk waits at most this long.
    part = 64 << 20

    def __init__(self, ledger: Ledger, disk: DiskTier, disk_lock: threading.Lock):
        self.ledger = ledger
        self.disk = disk
        #: The disk writer's lock (taken before the ledger's): no rename or deletion crosses a quarantine.
        self.disk_lock = disk_lock
        #: (entry, rank, bytes of the shard checked so far, their CRC-32C)
        self.pending: collections.deque[tuple[Entry, int, int, int]] = collections.deque()

    def listed(self, entries: list[Entry]) -> None:
        """Under the ledger's lock: check these (just listed from disk) in the background, every job's newest
        checkpoint first, then every job's second newest, and so on."""
        by_job: dict[str, list[Entry]] = {}
        for entry in entries:
            by_job.setdefault(entry.job, []).append(entry)
        age = {id(e): n for job in by_job.values() for n, e in enumerate(sorted(job, key=lambda e: -e.step))}
        for entry in sorted(entries, key=lambda e: (age[id(e)], -e.info.committed_at)):
            self.pending.extend((entry, rank, 0, 0) for rank in range(entry.world))

    def unverified(self) -> int:
        """Shard files listed at start that are not checked yet."""
        with self.ledger.cond:
            return len(self.pending)

    def next(self) -> bool:
        """Read the next part (:attr:`part`) of the shard files listed at start and not checked yet; False if
        none is left. Only one thread calls it (the disk writer's)."""
        with self.ledger.cond:
            while self.pending:
                entry, rank, offset, crc = self.pending[0]
                if not entry.dropped and "disk" in entry.tiers:
                    shard = entry.shards[rank]
                    break
                self.pending.popleft()  # deleted or replaced meanwhile
            else:
                return False
        done = True
        try:
            offset, crc = self.disk.check(shard, offset=offset, crc=crc, most=self.part)
            done = offset == shard.nbytes
        except (ChecksumError, NotFoundError) as e:
            self.failed(entry, e)
        except OSError as e:  # not the copy's fault (out of descriptors, say): a read will check it
            log.warning("%s step %d: could not check its disk copy (%s)", entry.job, entry.step, e.strerror or e)
        except Exception:  # runs on the disk writer's thread: a bug must not stop disk writes
            log.exception("%s step %d: checking its disk copy failed", entry.job, entry.step)
        with self.ledger.cond:
            if done:
                self.pending.popleft()
            else:
                self.pending[0] = (entry, rank, offset, crc)
        return True

    def failed(self, entry: Entry, error: DashError) -> None:
        """A disk copy of ``entry`` failed its check: quarantine it; the checkpoint keeps its other tiers or
        leaves the catalogue. A no-op if the copy already left the disk tier (retention, a newer attempt)."""
        cond = self.ledger.cond
        with self.disk_lock, cond:
            if entry.dropped or "disk" not in entry.tiers:
                return
            entry.tiers.discard("disk")
            try:
                # Moved with the lock held: a newer attempt at the step commits, and so writes its own copy,
                # only after this copy is out of the way.
                moved = self.disk.quarantine(entry.job, entry.step)
            except OSError as e:
                moved, why = None, f"not moved: {e.strerror or e}"
            else:
                why = f"moved to {moved}" if moved else "its directory is gone"
            then = self.ledger.lose_copy(entry, "disk")
        log.error("%s step %d: the disk copy is bad (%s); %s; %s", entry.job, entry.step, error, why, then)
