"""The uploader: one queue of object-store tasks behind the disk tier, and reads from the bucket.

It uploads each checkpoint once it is on disk (reading the disk copy, so a
slow store never pins RAM), the job's launch spec and membership record
(:meth:`Uploader.keep_records`), and the deletions of retention, in order.
Uploads are bounded: a newer checkpoint of a job supersedes its queued older
ones, and a full queue drops its oldest upload. A
failed task is retried with backoff, forever, while it is still wanted; the
failure is shown on the job. A disk copy whose bytes no longer match their
checksums is not retried: it is quarantined as the disk verifier does (the
checkpoint keeps its RAM copy, or leaves the catalogue). Before any task, the bucket is listed once
(:meth:`Uploader.load_objects`): until then, a job unknown here may be held
there.

``dashrun rm`` and ``gc`` leave a tombstone (:mod:`.tombstones`, kept on disk
by the disk tier) and queue a purge: the bucket's listing adopts nothing a
tombstone covers, and the purge lists the job in the bucket and deletes every
copy it covers — also copies the catalogue never knew (before the first
listing, or an older attempt's) — then says the bucket has caught up (the
tombstone goes once the disk has too).

The listing adopts only checkpoints whose manifest carries a valid MAC
under the cluster's key (:mod:`.tiers.signing`); an unsigned, edited or
planted one is refused with an error in the log, never served. Reads fall
through to the bucket when neither RAM nor disk holds a checkpoint:
:meth:`Uploader.read_shard` downloads a shard into a RAM buffer. A
checkpoint whose object fails its checksum leaves the catalogue, so the next
request for the newest step gets the one before it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import mmap
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from dashrun.errors import ChecksumError, DashError, NotFoundError, ProtocolError, SignatureError
from dashrun.memd.store.entry import Entry, State
from dashrun.memd.store.ledger import Ledger
from dashrun.memd.store.retention import Retention
from dashrun.memd.store.tiers import DiskTier
from dashrun.memd.store.tiers.base import SourceChanged
from dashrun.memd.store.tombstones import Tombstone
from dashrun.util.problems import ProblemLog
from dashrun.util.retry import Backoff
from dashrun.util.units import format_size

if TYPE_CHECKING:  # boto3 is imported only when dash-memd has an object tier
    from dashrun.memd.store.tiers.object import ObjectTier

__all__ = ["ObjectTask", "Records", "Uploader"]

log = logging.getLogger(__name__)

#: ProblemLog key of the bucket's listing (job ids are strings: no job has it).
_LISTING = ("listing",)


@dataclasses.dataclass(frozen=True, eq=False)
class ObjectTask:
    """One thing for the uploader to do: ``upload`` an entry, ``spec`` (upload a job's launch spec),
    ``record`` (make the bucket's copy of a job's membership record the one dash-memd has, or delete it if it has
    none), ``delete`` a step, ``purge`` (delete what a tombstone covers)."""

    kind: str
    job: str
    step: int = -1
    entry: Entry | None = None
    tombstone: Tombstone | None = None


class Records(Protocol):
    """The jobs' membership records (:class:`dashrun.memd.fleet.membership.Membership`), as the uploader keeps
    their copies in the bucket."""

    mirror: Callable[[str], None]

    def jobs(self) -> list[str]: ...

    def body(self, job: str) -> dict | None: ...

    def adopt(self, job: str, raw: Any) -> bool: ...


class Uploader:
    """Object-store tasks of one catalogue, run one at a time by :meth:`next` (dash-memd's uploader thread)."""

    def __init__(self, ledger: Ledger, objects: ObjectTier, disk: DiskTier, retention: Retention, *,
                 upload_queue: int = 8):
        self.ledger = ledger
        self.objects = objects
        self.disk = disk
        self.retention = retention
        self.upload_queue = upload_queue
        self.tasks: collections.deque[ObjectTask] = collections.deque()
        self.busy: ObjectTask | None = None
        self.failures: dict[str, str] = {}   # job -> why its last object-store task failed
        self.problems = ProblemLog(log)
        self.listed = False                  # until then, a job unknown here may be in the bucket
        self.listing_error: str | None = None
        self.backoff = Backoff(1.0, 60.0)    # pauses after a failed task, whichever it was
        self.retry_at = 0.0                  # monotonic time before which nothing is tried again
        self.closing = threading.Event()
        #: Deletions not every tier has caught up with (the data dir's); those left by the last run are purged again.
        self.tombstones = disk.tombstones
        self.tombstones.purged_by("object")
        #: What to do with a disk copy found bad as it went up: the catalogue's verifier quarantines it (unset,
        #: the upload fails and is retried, as any other failure).
        self.disk_copy_failed: Callable[[Entry, DashError], None] | None = None
        self.tasks.extend(ObjectTask("purge", t.job, tombstone=t) for t in self.tombstones.records())
        #: The membership records copied to the bucket (:meth:`keep_records`); None: none are.
        self.records: Records | None = None

    def keep_records(self, records: Records) -> None:
        """Keep a copy of every job's membership record in the bucket: replaced as ``records`` says one changed,
        taken back at the listing for a job the data dir has none of, deleted with the job."""
        self.records = records
        records.mirror = self.record_changed

    def record_changed(self, job: str) -> None:
        """(Without the ledger's lock.) Queue the bucket's copy of ``job``'s record, unless it is queued: the task
        sends the record as it is when it runs."""
        with self.ledger.cond:
            if not any(t.kind == "record" and t.job == job for t in self.tasks):
                self.queue(ObjectTask("record", job))

    def close(self) -> None:
        """Stop retrying (dash-memd is shutting down)."""
        self.closing.set()
        with self.ledger.cond:
            self.ledger.cond.notify_all()

    # --- the listing -------------------------------------------------------------------

    def load_objects(self) -> list[str]:
        """Add the object tier's checkpoints and specs; queue what the bucket lacks. Raises UnavailableError.

        A checkpoint in both tiers is one entry if it is the same attempt;
        otherwise the disk's (the newer attempt) wins and goes up again.
        What a tombstone covers is not adopted: its purge is queued.
        """
        aborted = self.objects.abort_incomplete_uploads()
        infos, problems = self.objects.scan_report()
        jobs = self.objects.jobs()
        specs = self.objects.specs(jobs)
        records = self._bucket_records(jobs, problems)
        ledger = self.ledger
        deleted = 0
        with ledger.cond:
            for job, spec in specs.items():
                if not self.tombstones.job_deleted(job):
                    ledger.specs.setdefault(job, spec)
            for info in infos:
                if self.tombstones.covering(info) is not None:
                    deleted += 1
                    continue
                steps = ledger.committed.setdefault(info.job, {})
                entry = steps.get(info.step)
                if entry is None:
                    steps[info.step] = Entry(info.job, info.step, info.world, info.rep_total, info.layout,
                                             state=State.IN_OBJECT_STORE, shards={s.rank: s for s in info.shards},
                                             tiers={"object"}, info=info)
                elif entry.info.to_body() == info.to_body() and entry.state == State.ON_DISK:
                    entry.tiers.add("object")
                    entry.advance(State.IN_OBJECT_STORE)
            for job in ledger.specs:
                if job not in specs or self.tombstones.job_deleted(job):  # missing, or what is there was deleted
                    self.queue(ObjectTask("spec", job))
            for job, steps in ledger.committed.items():
                newest = steps[max(steps)] if steps else None
                if newest is not None and "object" not in newest.tiers and "disk" in newest.tiers:
                    self.queue_upload(newest)
                self._trim(job)
            self.listed = True
            self.listing_error = None
            ledger.cond.notify_all()
        if self.records is not None:
            self._adopt_records(records, problems)
        self.problems.ok(_LISTING)
        for key in aborted:
            log.info("object tier: aborted an incomplete upload of %s", key)
        for problem in problems:  # a refused manifest is someone's doing, not rot: said louder
            log.log(logging.ERROR if problem.startswith("refused") else logging.WARNING, "object tier: %s", problem)
        if deleted:
            log.info("object tier: %d checkpoints deleted from dash-memd are still in %s; not taken, being deleted",
                     deleted, self.objects.url)
        log.info("catalogue: %d checkpoints of %d jobs in %s", len(infos) - deleted,
                 len({i.job for i in infos}), self.objects.url)
        return problems

    def _bucket_records(self, jobs: list[str], problems: list[str]) -> dict[str, dict]:
        """The membership records the bucket holds of ``jobs`` (none a tombstone deleted); the refused and the
        unreadable are added to ``problems``."""
        found: dict[str, dict] = {}
        if self.records is None:
            return found
        for job in jobs:
            if self.tombstones.job_deleted(job):
                continue
            try:
                record = self.objects.get_record(job)
            except SignatureError as e:
                problems.append(f"refused the membership record of {job}: {e}")
            except ChecksumError as e:
                problems.append(f"ignored the membership record of {job}: {e}")
            else:
                if record is not None:
                    found[job] = record
        return found

    def _adopt_records(self, found: dict[str, dict], problems: list[str]) -> None:
        """Give the records the bucket holds (``found``) to :attr:`records` (which takes those of jobs the data
        dir had none of), then queue the copy of every record the bucket lacks or holds another of."""
        for job, raw in found.items():
            try:
                if self.records.adopt(job, raw):
                    log.info("%s: membership record and run history taken from %s", job, self.objects.url)
            except (ValueError, ProtocolError) as e:  # signed by us, so written by a dashrun that got it wrong
                problems.append(f"ignored the membership record of {job}: {e}")
        for job in self.records.jobs():
            if self.records.body(job) != found.get(job):
                self.record_changed(job)

    # --- the queue (with the ledger's lock held) -------------------------------------------

    def queue(self, task: ObjectTask) -> None:
        """Queue an object-store task. Uploads are bounded; other tasks are small and kept."""
        if task.kind == "upload":
            for old in [t for t in self.tasks if t.kind == "upload" and t.job == task.job]:
                self.tasks.remove(old)
                log.info("%s step %d: upload superseded by step %d", old.job, old.step, task.step)
            uploads = [t for t in self.tasks if t.kind == "upload"]
            if len(uploads) >= self.upload_queue:
                self.tasks.remove(uploads[0])
                log.warning("%s step %d: not uploaded: the upload queue is full (%d)", uploads[0].job,
                            uploads[0].step, self.upload_queue)
        self.tasks.append(task)
        self.ledger.cond.notify_all()

    def queue_upload(self, entry: Entry) -> None:
        self.queue(ObjectTask("upload", entry.job, entry.step, entry))

    def queue_spec(self, job: str) -> None:
        self.queue(ObjectTask("spec", job))

    def queue_delete(self, job: str, step: int) -> None:
        # Before any queued upload of the same step: that one is of a newer attempt, and must stay.
        later = [t for t in self.tasks if t.kind == "upload" and t.job == job and t.step == step]
        for task in later:
            self.tasks.remove(task)
        self.queue(ObjectTask("delete", job, step))
        self.tasks.extend(later)

    def deleted(self, tombstone: Tombstone) -> None:
        """What ``tombstone`` covers is deleted (recorded in :attr:`tombstones` already): queue the bucket's purge,
        and with a whole job (``below`` None) drop its uploads queued."""
        job = tombstone.job
        if tombstone.below is None:
            for task in [t for t in self.tasks if t.job == job and t.kind in ("upload", "spec", "record")]:
                self.tasks.remove(task)
            self.failures.pop(job, None)
            self.problems.forget(job)
        self.queue(ObjectTask("purge", job, tombstone=tombstone))

    def may_hold(self, job: str) -> bool:
        """True if the bucket may hold checkpoints of ``job`` the catalogue does not know yet (not listed yet,
        and the job not deleted since)."""
        return not self.listed and not self.tombstones.job_deleted(job)

    def failure(self, job: str) -> str | None:
        """Why the last object-store task of ``job`` failed, if it has not worked since."""
        return self.failures.get(job)

    def _trim(self, job: str) -> None:
        for entry in self.retention.trim_object(job):
            self.queue_delete(job, entry.step)

    # --- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        """The object tier as ``dashrun status`` shows it."""
        return {"object_store": self.objects.url, "pending_uploads": self.pending_uploads(),
                "object_listed": self.listed, "object_error": self.listing_error}

    def pending_uploads(self) -> int:
        """Uploads queued or running; one whose step is already in the bucket is done, though its task has not
        yet let go (a scrape between the two would show the step both up and waiting)."""
        with self.ledger.cond:
            busy = self.busy
            running = busy is not None and busy.kind == "upload" and "object" not in busy.entry.tiers
            return sum(t.kind == "upload" for t in self.tasks) + running

    def tasks_left(self) -> int:
        """Object-store tasks queued or running (the initial listing counts as one)."""
        with self.ledger.cond:
            return len(self.tasks) + (self.busy is not None) + (not self.listed)

    # --- running tasks ---------------------------------------------------------------------

    def next(self, timeout: float) -> bool:
        """Run the next object-store task that is due (the initial listing first); False if none was within
        ``timeout``. A failed task stays first in the queue and is tried again after a pause that doubles."""
        cond = self.ledger.cond

        def due() -> bool:
            return self.closing.is_set() or (
                (not self.listed or bool(self.tasks)) and time.monotonic() >= self.retry_at)

        with cond:
            if not cond.wait_for(due, timeout) or self.closing.is_set():
                return False
            task = None
            if self.listed:
                task = self.busy = self.tasks.popleft()
        try:
            if task is None:
                self.load_objects()
            else:
                self._run(task)
        except DashError as e:
            with cond:
                if task is None:
                    self.problems.problem(_LISTING, str(e), "cannot list the object store (%s); jobs held only "
                                          "there stay unknown until it answers", e, level=logging.ERROR)
                    self.listing_error = str(e)
                else:
                    self._failed(task, e)
                self.retry_at = time.monotonic() + self.backoff.next_delay()
        except Exception:  # a bug must not stop the uploader
            log.exception("%s: object store %s failed", task.job if task else "-", task.kind if task else "listing")
        else:
            with cond:
                self.backoff.reset()
                if task is not None:
                    self.failures.pop(task.job, None)
            if task is not None:
                self.problems.ok(task.job, "%s: the object store works again", task.job)
        finally:
            with cond:
                self.busy = None
                cond.notify_all()
        return True

    def _failed(self, task: ObjectTask, error: DashError) -> None:
        """Under the lock: show why ``task`` failed; put it back first in line if it is still wanted."""
        reason = str(error)
        self.problems.problem(task.job, reason, "%s: object store %s failed (%s); retrying with backoff", task.job,
                              task.kind if task.step < 0 else f"{task.kind} of step {task.step}", reason,
                              level=logging.ERROR)
        self.failures[task.job] = reason
        if task.kind == "upload":
            newer = any(t.kind == "upload" and t.job == task.job for t in self.tasks)
            wanted = not (newer or task.entry.dropped or "disk" not in task.entry.tiers)
        elif task.kind == "record":  # unless its job changed again since (that task sends the newer record)
            wanted = not any(t.kind == "record" and t.job == task.job for t in self.tasks)
        else:
            wanted = task.kind != "spec" or task.job in self.ledger.specs
        if wanted:
            self.tasks.appendleft(task)

    def _run(self, task: ObjectTask) -> None:
        if task.kind == "upload":
            self._upload(task.entry)
        elif task.kind == "spec":
            with self.ledger.cond:
                spec = self.ledger.specs.get(task.job)
            if spec is not None:
                self.objects.put_spec(spec, task.job)
        elif task.kind == "record":
            record = self.records.body(task.job) if self.records is not None else None
            if record is None:
                self.objects.delete_record(task.job)
            else:
                self.objects.put_record(task.job, record)
        elif task.kind == "delete":
            self.objects.delete(task.job, task.step)
            log.info("%s step %d: deleted from the object store", task.job, task.step)
        elif task.kind == "purge":
            self._purge(task.tombstone)

    def _purge(self, tombstone: Tombstone) -> None:
        """Delete from the bucket every checkpoint ``tombstone`` covers (and, for a whole job, its spec unless
        one was put since), then drop the tombstone."""
        job = tombstone.job
        for step in self.objects.steps(job):
            if tombstone.below is not None and step >= tombstone.below:
                continue
            try:
                # Unsigned is good enough to delete by: whoever could plant it can delete it as well.
                info = self.objects.read_manifest(job, step, signed=False)
            except (NotFoundError, ChecksumError):
                continue  # no readable manifest: not a checkpoint, the listing never takes it
            if tombstone.covers(info):
                self.objects.delete(job, step)
                log.info("%s step %d: deleted from the object store", job, step)
        if tombstone.below is None:
            with self.ledger.cond:
                respecified = job in self.ledger.specs  # its upload is queued and replaces the old one
            if not respecified:
                self.objects.delete_spec(job)
            self.objects.delete_record(job)
            if self.records is not None and self.records.body(job) is not None:  # launched again since
                self.record_changed(job)
        self.tombstones.purged(tombstone, "object")

    def _upload(self, entry: Entry) -> None:
        cond = self.ledger.cond
        with cond:
            if entry.dropped or "disk" not in entry.tiers or "object" in entry.tiers:
                return  # deleted, superseded, or already there
        with contextlib.ExitStack() as stack:
            try:
                # Mapped files stay readable even if retention deletes the step meanwhile.
                views = [stack.enter_context(self.disk.open(entry.job, entry.step, r)) for r in range(entry.world)]
            except NotFoundError:
                return
            started = time.monotonic()
            try:
                self.objects.put(entry.info, views)
            except SourceChanged as e:  # the disk copy no longer holds what was committed: quarantined, not retried
                if self.disk_copy_failed is None:
                    raise
                self.disk_copy_failed(entry, e)
                return
            elapsed = time.monotonic() - started
        with cond:
            if entry.dropped:  # deleted while it went up
                self.queue_delete(entry.job, entry.step)
                return
            entry.tiers.add("object")
            entry.advance(State.IN_OBJECT_STORE)
            self._trim(entry.job)
            cond.notify_all()
        log.info("%s step %d: %s uploaded in %.1fs", entry.job, entry.step, format_size(entry.info.nbytes), elapsed)

    # --- reading ---------------------------------------------------------------------------

    def read_shard(self, entry: Entry, rank: int) -> mmap.mmap:
        """Download one shard into a RAM buffer (the caller releases it). A corrupt checkpoint leaves the catalogue."""
        ram = self.ledger.ram
        with self.ledger.cond:
            buffer = self.retention.reserve(entry.shards[rank].nbytes, entry)
        try:
            with memoryview(buffer) as view:
                self.objects.read_into(entry.job, entry.step, rank, view, shard=entry.shards[rank])
        except ChecksumError as e:
            ram.release(buffer)
            with self.ledger.cond:
                if not entry.dropped:
                    log.error("%s step %d: %s; dropped from the catalogue, the checkpoint before it is served "
                              "instead", entry.job, entry.step, e)
                    entry.tiers.discard("object")
                    if not entry.tiers:
                        self.ledger.forget(entry)
            raise
        except BaseException:
            ram.release(buffer)
            raise
        return buffer
