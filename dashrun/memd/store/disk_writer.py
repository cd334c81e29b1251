"""The disk writer: committed checkpoints go from RAM to the disk tier, in commit order, one at a time.

A checkpoint is written from its RAM buffers, pinned meanwhile. Once on disk
it advances to ON_DISK, the job's older disk and RAM copies are trimmed, and
(with an object tier) it is queued for upload. A checkpoint replaced or
superseded before its turn is skipped. While receives wait for RAM (the
disk is slower than the checkpoints come), so is one whose job committed a
newer checkpoint meanwhile: the writer then writes each job's newest, whose
write lets the RAM of every older one go, instead of falling further behind
on the older ones while the nodes wait. A failed write leaves the checkpoint
in RAM and the previous one on disk valid; the failure is logged once,
counted and shown on the job until a write of that job works again, and the
write is tried again, with a pause that doubles, for as long as it is the
job's newest checkpoint not on disk (a newer one's write makes it safe
too). No error ends the writer: one it did not foresee is logged and
handled as a failed write. A step directory that could not be removed is
removed again later, while the catalogue holds no checkpoint of that step. The bytes are
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
import time
from typing import Callable

from dashrun.memd.store.entry import Entry, State
from dashrun.memd.store.ledger import Ledger
from dashrun.memd.store.retention import Retention
from dashrun.memd.store.tiers import DiskTier
from dashrun.memd.store.tiers.base import SourceChanged
from dashrun.memd.store.uploader import Uploader
from dashrun.util.problems import ProblemLog
from dashrun.util.retry import Backoff

__all__ = ["RETRY_FIRST", "RETRY_LONGEST", "DiskWriter"]

log = logging.getLogger(__name__)

#: The pause before a failed disk write is tried again; it doubles after each failure, up to RETRY_LONGEST.
RETRY_FIRST = 0.5
RETRY_LONGEST = 10.0


class DiskWriter:
    """Writes what :meth:`submit` hands it; :meth:`persist_next` runs on dash-memd's disk-writer thread."""

    def __init__(self, ledger: Ledger, disk: DiskTier, retention: Retention, uploader: Uploader | None = None):
        self.ledger = ledger
        self.disk = disk
        self.retention = retention
        self.uploader = uploader
        self.queue: queue.Queue[Entry] = queue.Queue()
        self.failures: dict[str, str] = {}   # job -> why its last disk write failed
        self.failure_counts: dict[str, int] = {}  # job -> disk writes and deletions that failed since the start
        #: job -> (when, checkpoint): the job's newest checkpoint not on disk, whose write failed, tried again then
        self.retries: dict[str, tuple[float, Entry]] = {}
        self.backoffs: dict[str, Backoff] = {}
        #: Step directories whose removal failed: (job, step), removed again before the next write.
        self.undeleted: set[tuple[str, int]] = set()
        #: Run before each write (the catalogue lets go of the bucket's downloads no read wants any more).
        self.between_writes: Callable[[], None] = lambda: None
        self.problems = ProblemLog(log)
        #: Held while a step directory goes into place or is removed; taken before the ledger's lock.
        self.lock = threading.Lock()

    def submit(self, entry: Entry) -> None:
        """Queue a just-committed checkpoint for the disk."""
        self.queue.put(entry)

    def unwritten(self) -> list[Entry]:
        """Every committed checkpoint held in RAM alone whose loss would lose steps (no newer checkpoint of its
        job is on disk), by job and step: what the writer still has to write, or what a stop now loses."""
        with self.ledger.cond:
            return sorted((e for steps in self.ledger.committed.values() for e in steps.values()
                           if e.state == State.COMMITTED and not e.dropped and "ram" in e.tiers
                           and not self.retention.safe_without_ram(e)), key=lambda e: (e.job, e.step))

    def unwritten_report(self) -> list[str]:
        """One line per job whose committed checkpoints are in RAM alone: the steps a stop now loses, and what
        of the job is kept (on disk, in the bucket)."""
        by_job: dict[str, list[int]] = {}
        for entry in self.unwritten():
            by_job.setdefault(entry.job, []).append(entry.step)
        lines = []
        with self.ledger.cond:
            for job, steps in sorted(by_job.items()):
                kept = self.ledger.committed.get(job, {})
                on_disk = max((s for s, e in kept.items() if "disk" in e.tiers), default=None)
                in_bucket = max((s for s, e in kept.items() if "object" in e.tiers), default=None)
                where = f"the newest on disk is step {on_disk}" if on_disk is not None else "none is on disk"
                if self.uploader is not None:
                    where += (f", the newest in the bucket step {in_bucket}" if in_bucket is not None
                              else ", none is in the bucket")
                lines.append(f"{job}: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
                             f"{'are' if len(steps) > 1 else 'is'} in RAM only and lost with this stop; {where}")
        return lines

    def pending(self) -> int:
        return len(self.unwritten())

    def failure(self, job: str) -> str | None:
        """Why the last disk write of ``job`` failed, if none has worked since."""
        return self.failures.get(job)

    def failure_count(self, job: str) -> int:
        """How many disk writes and deletions of ``job`` failed since dash-memd started."""
        return self.failure_counts.get(job, 0)

    def forget_job(self, job: str) -> None:
        """Under the ledger's lock: ``job`` is deleted."""
        self.failures.pop(job, None)
        self.failure_counts.pop(job, None)
        self.retries.pop(job, None)
        self.backoffs.pop(job, None)
        self.problems.forget(job)

    def persist_next(self, timeout: float) -> bool:
        """Write the next committed checkpoint to disk, or try again one whose write failed once its pause is
        over. False if none was due within ``timeout``."""
        self.between_writes()
        self._delete_again()
        entry = self._next(timeout)
        if entry is None:
            return False
        try:
            self._persist(entry)
        except Exception as e:  # not foreseen: the writer goes on, and the checkpoint is tried again
            log.exception("%s step %d: disk writer: internal error", entry.job, entry.step)
            self._failed(entry, f"internal error: {type(e).__name__}: {e}")
        return True

    def _next(self, timeout: float) -> Entry | None:
        """The checkpoint to write next: a retry that is due, else the next one committed within ``timeout``
        (or until a retry falls due)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.ledger.cond:
                due = min(self.retries.items(), key=lambda item: item[1][0], default=None)
                now = time.monotonic()
                if due is not None and due[1][0] <= now:
                    del self.retries[due[0]]
                    return due[1][1]
                wait = deadline - now if due is None else min(deadline, due[1][0]) - now
            try:
                return self.queue.get(timeout=max(0.0, wait))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return None

    def _failed(self, entry: Entry, reason: str) -> None:
        """A write of ``entry`` failed: count it, show it on the job, and try again after a pause while it is
        the job's newest checkpoint not on disk."""
        with self.ledger.cond:
            self.failures[entry.job] = reason
            self.failure_counts[entry.job] = self.failure_counts.get(entry.job, 0) + 1
            newest = max((e.step for e in self.ledger.committed.get(entry.job, {}).values()
                          if e.state == State.COMMITTED and not e.dropped), default=None)
            if entry.dropped or "ram" not in entry.tiers or newest != entry.step:
                return  # gone, or a newer checkpoint's write is what makes it safe now
            backoff = self.backoffs.setdefault(entry.job, Backoff(RETRY_FIRST, RETRY_LONGEST))
            self.retries[entry.job] = (time.monotonic() + backoff.next_delay(), entry)

    def _delete(self, job: str, step: int) -> None:
        """With :attr:`lock` held: remove a step directory the catalogue no longer holds; a failure is counted on
        the job and the removal tried again later (:meth:`_delete_again`)."""
        try:
            self.disk.delete(job, step)
        except OSError as e:
            reason = e.strerror or str(e)
            self.problems.problem((job, "delete"), reason, "%s step %d: not deleted from disk (%s); tried again "
                                  "later", job, step, reason, level=logging.ERROR)
            with self.ledger.cond:
                self.failure_counts[job] = self.failure_counts.get(job, 0) + 1
                self.undeleted.add((job, step))
        else:
            self.undeleted.discard((job, step))

    def _delete_again(self) -> None:
        """Remove the step directories whose removal failed, unless the catalogue holds that step again (a new
        attempt, which replaces the old directory as it goes into place)."""
        if not self.undeleted:
            return
        with self.lock:
            with self.ledger.cond:
                self.undeleted = {(job, step) for job, step in self.undeleted
                                  if step not in self.ledger.committed.get(job, {})}
                again = sorted(self.undeleted)
            for job, step in again:
                self._delete(job, step)
            for job in {job for job, _ in again} - {job for job, _ in self.undeleted}:
                self.problems.ok((job, "delete"), "%s: deletions from disk work again", job)

    def _persist(self, entry: Entry) -> None:
        ledger = self.ledger
        with ledger.cond:
            if entry.dropped or "ram" not in entry.tiers or self.retention.safe_without_ram(entry):
                return  # deleted, replaced, or superseded by a newer checkpoint already on disk
            if ledger.room_waiters and self._newer_waiting(entry):
                return  # the newer one's write makes this one safe too: one write frees both from RAM
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
                self.problems.problem(entry.job, reason, "%s step %d: disk write failed (%s); it stays in RAM and is "
                                      "written again, the previous checkpoint on disk stays valid", entry.job,
                                      entry.step, reason, level=logging.ERROR)
                self._failed(entry, reason)
            finally:
                for view in views:
                    view.release()
                with ledger.cond:
                    entry.readers -= 1
                    works = written and not entry.dropped
                    if works:
                        next_shards = [shard.nbytes for shard in entry.info.shards]
                        self.failures.pop(entry.job, None)
                        self.retries.pop(entry.job, None)  # an older one waiting for its retry is safe now
                        self.backoffs.pop(entry.job, None)
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
                self._delete(entry.job, entry.step)
            for old in doomed:
                self._delete(old.job, old.step)
                log.info("%s step %d: deleted from disk (keeping the newest %d)", old.job, old.step,
                         self.retention.keep_disk)
        finally:
            if locked:
                self.lock.release()
        if works:
            self.problems.ok(entry.job, "%s: disk writes work again", entry.job)
        # The job's next checkpoint will have shards of about these sizes: have its buffers touched by then.
        self.ledger.ram.prewarm(next_shards)

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
                self.undeleted.discard((job, step))
