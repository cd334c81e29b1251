"""The disk writer: committed checkpoints go from RAM to the disk tier, in commit order, one at a time.

A checkpoint is written from its RAM buffers, pinned meanwhile. Once on disk
it advances to ON_DISK, the job's older disk and RAM copies are trimmed, and
(with an object tier) it is queued for upload. A checkpoint replaced or
superseded before its turn is skipped. While receives wait for RAM (the
disk is slower than the checkpoints come), so is one whose job committed a
newer checkpoint meanwhile: the writer then writes each job's newest, whose
write lets the RAM of every older one go, instead of falling further behind
on the older ones while the nodes wait. A failed write leaves the checkpoint
in RAM and the previous one on disk valid; the failure is logged once and
shown on the job until a write of that job works again. The bytes are
checked against their checksums as they are written: a checkpoint whose RAM
copy changed since it arrived is never put on disk: it leaves the catalogue,
and the job's checkpoints on disk stay as they were (none is trimmed for it).

Deletions (``dashrun rm``, ``gc``) and writes never cross: a step's
directory goes into place, or is removed, only with :attr:`DiskWriter.lock`
held, and a write checks under it, right before its rename, that its
checkpoint is still wanted. A checkpoint deleted while it was being written
is never renamed into place; one deleted after is on disk by then, and its
deletion removes it. So nothing a deletion took comes back at the next start.
"""

from __future__ import annotations

import logging
import queue
import threading

from dashrun.memd.entry import Entry, State
from dashrun.memd.ledger import Ledger
from dashrun.memd.retention import Retention
from dashrun.memd.tiers import DiskTier
from dashrun.memd.tiers.base import SourceChanged
from dashrun.memd.uploader import Uploader
from dashrun.util.problems import ProblemLog

__all__ = ["DiskWriter"]

log = logging.getLogger(__name__)


class DiskWriter:
    """Writes what :meth:`submit` hands it; :meth:`persist_next` runs on dash-memd's disk-writer thread."""

    def __init__(self, ledger: Ledger, disk: DiskTier, retention: Retention, uploader: Uploader | None = None):
        self.ledger = ledger
        self.disk = disk
        self.retention = retention
        self.uploader = uploader
        self.queue: queue.Queue[Entry] = queue.Queue()
        self.failures: dict[str, str] = {}   # job -> why its last disk write failed
        self.problems = ProblemLog(log)
        #: Held while a step directory goes into place or is removed; taken before the ledger's lock.
        self.lock = threading.Lock()

    def submit(self, entry: Entry) -> None:
        """Queue a just-committed checkpoint for the disk."""
        self.queue.put(entry)

    def pending(self) -> int:
        return self.queue.qsize()

    def failure(self, job: str) -> str | None:
        """Why the last disk write of ``job`` failed, if none has worked since."""
        return self.failures.get(job)

    def forget_job(self, job: str) -> None:
        """Under the ledger's lock: ``job`` is deleted."""
        self.failures.pop(job, None)
        self.problems.forget(job)

    def persist_next(self, timeout: float) -> bool:
        """Write the next committed checkpoint to disk. False if none arrived within ``timeout``."""
        try:
            entry = self.queue.get(timeout=timeout)
        except queue.Empty:
            return False
        ledger = self.ledger
        with ledger.cond:
            if entry.dropped or "ram" not in entry.tiers or self.retention.safe_without_ram(entry):
                return True  # deleted, replaced, or superseded by a newer checkpoint already on disk
            if ledger.room_waiters and self._newer_waiting(entry):
                return True  # the newer one's write makes this one safe too: one write frees both from RAM
            entry.readers += 1
            views = [memoryview(entry.buffers[r])[:entry.shards[r].nbytes] for r in range(entry.world)]
        locked = False

        def still_wanted() -> bool:  # right before the rename; the lock is held until the books say "on disk"
            nonlocal locked
            self.lock.acquire()
            locked = True
            with ledger.cond:
                return not entry.dropped

        written = works = False
        doomed: list[Entry] = []
        next_shards: list[int] = []
        try:
            try:
                written = self.disk.put(entry.info, views, guard=still_wanted)
            except SourceChanged as e:  # its RAM copy changed since it arrived: no tier holds it right any more
                with ledger.cond:
                    then = ledger.lose_copy(entry, "ram") if not entry.dropped and "ram" in entry.tiers else None
                if then is not None:
                    log.error("%s step %d: not written to disk: %s; %s", entry.job, entry.step, e, then)
            except OSError as e:
                reason = e.strerror or str(e)
                self.problems.problem(entry.job, reason, "%s step %d: disk write failed (%s); it stays in RAM, the "
                                      "previous checkpoint on disk stays valid", entry.job, entry.step, reason,
                                      level=logging.ERROR)
                with ledger.cond:
                    self.failures[entry.job] = reason
            finally:
                for view in views:
                    view.release()
                with ledger.cond:
                    entry.readers -= 1
                    works = written and not entry.dropped
                    if works:
                        next_shards = [shard.nbytes for shard in entry.info.shards]
                        self.failures.pop(entry.job, None)
                        entry.tiers.add("disk")
                        entry.advance(State.ON_DISK)
                        doomed = self.retention.trim_disk(entry.job)
                        self.retention.trim_ram(entry.job)
                        if self.uploader is not None:
                            self.uploader.queue_upload(entry)
                    else:  # dropped, or its RAM copy found bad, while it was written
                        ledger.release_unwanted_ram(entry)
                    ledger.cond.notify_all()
            if written and not works:  # a later attempt at the step replaced it while it was being written
                self.disk.delete(entry.job, entry.step)
            for old in doomed:
                self.disk.delete(old.job, old.step)
                log.info("%s step %d: deleted from disk (keeping the newest %d)", old.job, old.step,
                         self.retention.keep_disk)
        finally:
            if locked:
                self.lock.release()
        if works:
            self.problems.ok(entry.job, "%s: disk writes work again", entry.job)
        # The job's next checkpoint will have shards of about these sizes: have its buffers touched by then.
        self.ledger.ram.prewarm(next_shards)
        return True

    def _newer_waiting(self, entry: Entry) -> bool:
        """Whether a newer committed checkpoint of the job waits for the disk behind ``entry`` (the disk is behind
        the job's checkpoints)."""
        return any(step > entry.step and other.state == State.COMMITTED and not other.dropped
                   for step, other in self.ledger.committed.get(entry.job, {}).items())

    def delete_steps(self, job: str, below: int | None = None) -> None:
        """With :attr:`lock` held: remove every step directory of ``job`` (below step ``below`` if given),
        whether or not the catalogue knows it (a replaced attempt's copy, say)."""
        try:
            names = [p.name for p in self.disk.step_dir(job, 0).parent.iterdir()]
        except FileNotFoundError:
            return
        for step in sorted(int(name) for name in names if name.isdigit()):
            if below is None or step < below:
                self.disk.delete(job, step)
