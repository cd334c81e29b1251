"""dash-memd's catalogue: which checkpoints exist, in which state, in which tiers.

A checkpoint of step N of a job is assembled from one shard per rank. It is
invisible while RECEIVING; it becomes COMMITTED — atomically, under the
catalogue's lock — once every rank's shard has arrived with a matching
CRC-32C and the shards tile the replicated state; then ON_DISK once the disk
tier holds it. States only move forward::

    RECEIVING -> COMMITTED -> ON_DISK -> IN_OBJECT_STORE

The state is how far a checkpoint got; ``tiers`` says where its bytes are
now (RAM copies are evicted once safe on disk, disk and object copies by
retention). A checkpoint no tier holds leaves the catalogue.

With an object tier, one uploader works through a queue behind the disk
tier: it uploads each checkpoint once on disk (reading the disk copy, so a
slow store never pins RAM), the job's launch spec, and the deletions of
retention and ``dashrun rm``, in order. Uploads are bounded: a newer
checkpoint of a job supersedes its queued older ones, and a full queue drops
its oldest upload. A failed task is retried with backoff, forever, while it
is still wanted; the failure is shown on the job. Reads fall through the
tiers: RAM, else disk, else the bucket (downloaded into a RAM buffer for the
read). A checkpoint whose object fails its checksum leaves the catalogue, so
the next request for the newest step gets the one before it.

All bookkeeping happens under one condition variable; bytes move outside it.
A checkpoint being read is pinned (``readers``) and never evicted or
deleted under the reader.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import mmap
import queue
import random
import threading
import time
from typing import TYPE_CHECKING, Iterator

from dashrun.errors import ChecksumError, ConflictError, DashError, NoSpaceError, NotFoundError, UnavailableError
from dashrun.memd.tiers import DiskTier, RamTier
from dashrun.util.units import format_size
from dashrun.wire.messages import CheckpointInfo, JobSpec, Notice, ShardHeader, tiling_problem

if TYPE_CHECKING:  # boto3 is imported only when dash-memd has an object tier
    from dashrun.memd.tiers.object import ObjectTier

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    RECEIVING = "receiving"
    COMMITTED = "committed"
    ON_DISK = "on_disk"
    IN_OBJECT_STORE = "in_object_store"


_NEXT: dict[State, frozenset[State]] = {
    State.RECEIVING: frozenset({State.COMMITTED}),
    State.COMMITTED: frozenset({State.ON_DISK}),
    State.ON_DISK: frozenset({State.IN_OBJECT_STORE}),
    State.IN_OBJECT_STORE: frozenset(),
}

#: A RECEIVING checkpoint that has not progressed for this long is abandoned
#: (a rank died before sending); its buffers are freed.
RECEIVING_TIMEOUT = 600.0
#: First and longest pause between tries of a failed object-store task.
OBJECT_BACKOFF = (1.0, 60.0)


@dataclasses.dataclass(eq=False)
class Entry:
    job: str
    step: int
    world: int
    rep_total: int
    layout: str
    state: State = State.RECEIVING
    shards: dict[int, ShardHeader] = dataclasses.field(default_factory=dict)
    buffers: dict[int, mmap.mmap] = dataclasses.field(default_factory=dict)
    tiers: set[str] = dataclasses.field(default_factory=set)
    info: CheckpointInfo | None = None
    readers: int = 0
    active: int = 0          # shards being received right now
    dropped: bool = False    # no longer in the catalogue; release buffers when unpinned
    touched: float = dataclasses.field(default_factory=time.monotonic)

    def advance(self, new: State) -> None:
        if new not in _NEXT[self.state]:
            raise AssertionError(f"{self.job} step {self.step}: {self.state.value} -> {new.value} is not allowed")
        log.info("%s step %d: %s -> %s", self.job, self.step, self.state.value, new.value)
        self.state = new

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())


@dataclasses.dataclass
class Ticket:
    """One shard being received into ``buffer``."""

    entry: Entry
    header: ShardHeader
    buffer: mmap.mmap


@dataclasses.dataclass(frozen=True, eq=False)
class ObjectTask:
    """One thing for the uploader to do: ``upload`` an entry, ``spec`` (upload a job's launch spec),
    ``delete`` a step, ``unspec`` (delete a job's spec)."""

    kind: str
    job: str
    step: int = -1
    entry: Entry | None = None


class Catalogue:
    def __init__(self, ram: RamTier, disk: DiskTier, *, keep_ram: int = 2, keep_disk: int = 3,
                 objects: ObjectTier | None = None, keep_object: int = 20, upload_queue: int = 8):
        self.ram = ram
        self.disk = disk
        self.objects = objects
        self.keep_ram = keep_ram
        self.keep_disk = keep_disk
        self.keep_object = keep_object
        self.upload_queue = upload_queue
        self._cond = threading.Condition()
        self._receiving: dict[tuple[str, int], Entry] = {}
        self._committed: dict[str, dict[int, Entry]] = {}
        self._to_disk: queue.Queue[Entry] = queue.Queue()
        self._disk_failures: dict[str, str] = {}
        self._specs: dict[str, JobSpec] = {}
        self._nodes: dict[str, dict[str, float]] = {}  # job -> node -> when it last sent a shard
        self._notices: dict[str, dict] = {}            # job -> the last interruption notice a node reported
        self._object_tasks: collections.deque[ObjectTask] = collections.deque()
        self._object_busy: ObjectTask | None = None
        self._object_failures: dict[str, str] = {}     # job -> why its last object-store task failed
        self._object_scanned = objects is None         # until then, a job unknown here may be in the bucket
        self._object_scan_error: str | None = None
        self._object_retry_at = 0.0                    # monotonic time before which nothing is tried again
        self._object_delay = OBJECT_BACKOFF[0]
        self._closing = threading.Event()

    # --- start-up ----------------------------------------------------------------

    def load_disk(self) -> list[str]:
        """Rebuild the catalogue from the disk tier; returns what was skipped, and why."""
        infos, problems = self.disk.scan_report()
        specs = self.disk.specs()
        with self._cond:
            self._specs.update(specs)
            for info in infos:
                entry = Entry(info.job, info.step, info.world, info.rep_total, info.layout,
                              state=State.ON_DISK, shards={s.rank: s for s in info.shards}, tiers={"disk"}, info=info)
                self._committed.setdefault(info.job, {})[info.step] = entry
        for problem in problems:
            log.warning("disk tier: %s", problem)
        log.info("catalogue: %d checkpoints of %d jobs on disk", len(infos), len(self._committed))
        return problems

    def load_objects(self) -> list[str]:
        """Add the object tier's checkpoints and specs; queue what the bucket lacks. Raises UnavailableError.

        A checkpoint in both tiers is one entry if it is the same attempt;
        otherwise the disk's (the newer attempt) wins and goes up again.
        """
        aborted = self.objects.abort_incomplete_uploads()
        infos, problems = self.objects.scan_report()
        specs = self.objects.specs()
        with self._cond:
            for job, spec in specs.items():
                self._specs.setdefault(job, spec)
            for info in infos:
                steps = self._committed.setdefault(info.job, {})
                entry = steps.get(info.step)
                if entry is None:
                    steps[info.step] = Entry(info.job, info.step, info.world, info.rep_total, info.layout,
                                             state=State.IN_OBJECT_STORE, shards={s.rank: s for s in info.shards},
                                             tiers={"object"}, info=info)
                elif entry.info.to_body() == info.to_body() and entry.state == State.ON_DISK:
                    entry.tiers.add("object")
                    entry.state = State.IN_OBJECT_STORE
            for job, steps in self._committed.items():
                if job not in specs and job in self._specs:
                    self._queue_object(ObjectTask("spec", job))
                newest = steps[max(steps)] if steps else None
                if newest is not None and "object" not in newest.tiers and "disk" in newest.tiers:
                    self._queue_object(ObjectTask("upload", job, newest.step, newest))
                self._trim_object(job)
            self._object_scanned = True
            self._object_scan_error = None
            self._cond.notify_all()
        for key in aborted:
            log.info("object tier: aborted an incomplete upload of %s", key)
        for problem in problems:
            log.warning("object tier: %s", problem)
        log.info("catalogue: %d checkpoints of %d jobs in %s", len(infos), len({i.job for i in infos}),
                 self.objects.url)
        return problems

    def close(self) -> None:
        """Stop retrying object-store tasks (dash-memd is shutting down)."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()

    # --- receiving --------------------------------------------------------------------

    def begin_shard(self, header: ShardHeader) -> Ticket:
        """Reserve RAM for a shard about to arrive. Raises NoSpaceError if it cannot fit."""
        if header.nbytes > self.ram.limit:
            raise NoSpaceError(
                f"a shard of {format_size(header.nbytes)} exceeds dash-memd's --memory-limit of "
                f"{format_size(self.ram.limit)}")
        with self._cond:
            key = (header.job, header.step)
            entry = self._receiving.get(key)
            shape = (header.world, header.rep_total, header.layout)
            if entry and (entry.world, entry.rep_total, entry.layout) != shape:
                log.info("%s step %d: a new attempt with another layout replaces the incomplete one",
                         header.job, header.step)
                self._drop_receiving(entry)
                entry = None
            if entry is None:
                entry = Entry(header.job, header.step, header.world, header.rep_total, header.layout)
                self._receiving[key] = entry
                log.info("%s step %d: receiving (%d ranks)", header.job, header.step, header.world)
            buffer = self._reserve(header.nbytes, entry)
            entry.active += 1
            entry.touched = time.monotonic()
            return Ticket(entry, header, buffer)

    def _reserve(self, nbytes: int, for_entry: Entry) -> mmap.mmap:
        while (buffer := self.ram.reserve(nbytes)) is None:
            if not self._evict_one(spare=for_entry):
                raise NoSpaceError(
                    f"dash-memd's RAM is full ({format_size(self.ram.used)} of {format_size(self.ram.limit)} hold "
                    "checkpoints not yet safe on disk); this checkpoint is refused, the previous one stays valid",
                    hint="raise --memory-limit or lower --keep-ram")
        return buffer

    def abort_shard(self, ticket: Ticket) -> None:
        entry = ticket.entry
        with self._cond:
            entry.active -= 1
            if not entry.shards and not entry.active and not entry.dropped:
                self._drop_receiving(entry)  # nothing of it arrived: leave no empty entry behind
        self.ram.release(ticket.buffer)

    def finish_shard(self, ticket: Ticket, crc: int) -> bool:
        """Store a verified shard; commit the checkpoint if it was the last. Returns True if committed."""
        entry, header = ticket.entry, ticket.header
        with self._cond:
            entry.active -= 1
            if entry.dropped:
                self.ram.release(ticket.buffer)
                return False
            old = entry.buffers.pop(header.rank, None)
            if old is not None:
                self.ram.release(old)
            entry.shards[header.rank] = dataclasses.replace(header, crc=crc)
            entry.buffers[header.rank] = ticket.buffer
            entry.touched = time.monotonic()
            if len(entry.shards) < entry.world:
                return False
            shards = tuple(entry.shards[r] for r in range(entry.world))
            problem = tiling_problem(shards, entry.rep_total, entry.layout)
            if problem:
                self._drop_receiving(entry)
                raise ConflictError(f"{entry.job} step {entry.step} cannot commit: {problem}")
            self._commit(entry, CheckpointInfo(entry.job, entry.step, entry.world, entry.rep_total,
                                               entry.layout, time.time(), shards))
            return True

    def _commit(self, entry: Entry, info: CheckpointInfo) -> None:
        del self._receiving[(entry.job, entry.step)]
        steps = self._committed.setdefault(entry.job, {})
        previous = steps.get(entry.step)
        if previous is not None:  # a later attempt at the same step wins
            self._forget(previous)
        entry.info = info
        entry.tiers.add("ram")
        self.ram.adopt(info, [entry.buffers[r] for r in range(entry.world)])
        steps[entry.step] = entry
        entry.advance(State.COMMITTED)
        log.info("%s step %d: %s in RAM", entry.job, entry.step, format_size(info.nbytes))
        for other in [e for (job, step), e in self._receiving.items() if job == entry.job and step < entry.step]:
            self._drop_receiving(other)
        self._to_disk.put(entry)
        self._trim_ram(entry.job)
        self._cond.notify_all()

    def _drop_receiving(self, entry: Entry) -> None:
        self._receiving.pop((entry.job, entry.step), None)
        entry.dropped = True
        for buffer in entry.buffers.values():
            self.ram.release(buffer)
        entry.buffers.clear()

    def _forget(self, entry: Entry) -> None:
        """Remove a committed entry from the catalogue; its RAM goes back once no one reads it."""
        self._committed.get(entry.job, {}).pop(entry.step, None)
        entry.dropped = True
        if "ram" in entry.tiers and entry.readers == 0:
            self._release_ram(entry)

    def _release_ram(self, entry: Entry) -> None:
        entry.tiers.discard("ram")
        for buffer in self.ram.detach(entry.job, entry.step, [entry.buffers[r] for r in sorted(entry.buffers)]):
            self.ram.release(buffer)
        entry.buffers.clear()

    # --- retention and eviction ------------------------------------------------------

    def _newest_safe_step(self, job: str) -> int | None:
        safe = [s for s, e in self._committed.get(job, {}).items() if "disk" in e.tiers]
        return max(safe, default=None)

    def _safe_without_ram(self, entry: Entry) -> bool:
        """True if dropping the RAM copy loses nothing: on disk, or superseded by a newer checkpoint on disk."""
        newest_safe = self._newest_safe_step(entry.job)
        return "disk" in entry.tiers or (newest_safe is not None and newest_safe > entry.step)

    def _drop_ram_copy(self, entry: Entry) -> None:
        if "disk" in entry.tiers:
            self._release_ram(entry)
            log.info("%s step %d: evicted from RAM (kept on disk)", entry.job, entry.step)
        else:
            log.info("%s step %d: dropped (superseded by a newer checkpoint on disk)", entry.job, entry.step)
            self._forget(entry)

    def _trim_ram(self, job: str) -> None:
        in_ram = sorted((e for e in self._committed.get(job, {}).values() if "ram" in e.tiers),
                        key=lambda e: e.step, reverse=True)
        for entry in in_ram[self.keep_ram:]:
            if entry.readers == 0 and self._safe_without_ram(entry):
                self._drop_ram_copy(entry)

    def _evict_one(self, spare: Entry) -> bool:
        """Free one checkpoint's RAM that can go without loss; False if none can."""
        now = time.monotonic()
        stale = [e for e in self._receiving.values()
                 if e is not spare and e.active == 0 and now - e.touched > RECEIVING_TIMEOUT]
        if stale:
            self._drop_receiving(stale[0])
            return True
        candidates = [e for steps in self._committed.values() for e in steps.values()
                      if "ram" in e.tiers and e.readers == 0 and self._safe_without_ram(e)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda e: e.info.committed_at)
        self._drop_ram_copy(victim)
        return True

    def _trim_disk(self, job: str) -> list[Entry]:
        on_disk = sorted((e for e in self._committed.get(job, {}).values() if "disk" in e.tiers),
                         key=lambda e: e.step, reverse=True)
        doomed = [e for e in on_disk[self.keep_disk:] if e.readers == 0]
        for entry in doomed:
            entry.tiers.discard("disk")
            if "object" not in entry.tiers:
                self._forget(entry)
            elif "ram" in entry.tiers:
                self._release_ram(entry)
        return doomed

    def _trim_object(self, job: str) -> None:
        in_store = sorted((e for e in self._committed.get(job, {}).values() if "object" in e.tiers),
                          key=lambda e: e.step, reverse=True)
        for entry in [e for e in in_store[self.keep_object:] if e.readers == 0]:
            entry.tiers.discard("object")
            self._queue_object(ObjectTask("delete", job, entry.step))
            if not entry.tiers:
                self._forget(entry)

    # --- persisting -------------------------------------------------------------------

    def persist_next(self, timeout: float) -> bool:
        """Write the next committed checkpoint to disk. False if none arrived within ``timeout``."""
        try:
            entry = self._to_disk.get(timeout=timeout)
        except queue.Empty:
            return False
        with self._cond:
            if entry.dropped or "ram" not in entry.tiers or self._safe_without_ram(entry):
                return True  # replaced, or superseded by a newer checkpoint already on disk
            entry.readers += 1
            views = [memoryview(entry.buffers[r])[:entry.shards[r].nbytes] for r in range(entry.world)]
        written = False
        try:
            self.disk.put(entry.info, views)
            written = True
        except OSError as e:
            reason = e.strerror or str(e)
            if self._disk_failures.get(entry.job) != reason:
                log.error("%s step %d: disk write failed (%s); it stays in RAM, the previous checkpoint on disk "
                          "stays valid", entry.job, entry.step, reason)
            self._disk_failures[entry.job] = reason
        finally:
            for view in views:
                view.release()
            with self._cond:
                entry.readers -= 1
                doomed = []
                next_shards = []
                if written and not entry.dropped:
                    next_shards = [shard.nbytes for shard in entry.info.shards]
                    self._disk_failures.pop(entry.job, None)
                    entry.tiers.add("disk")
                    entry.advance(State.ON_DISK)
                    doomed = self._trim_disk(entry.job)
                    self._trim_ram(entry.job)
                    if self.objects is not None:
                        self._queue_object(ObjectTask("upload", entry.job, entry.step, entry))
                elif entry.dropped and entry.readers == 0 and "ram" in entry.tiers:
                    self._release_ram(entry)
                self._cond.notify_all()
        for old in doomed:
            self.disk.delete(old.job, old.step)
            log.info("%s step %d: deleted from disk (keeping the newest %d)", old.job, old.step, self.keep_disk)
        # The job's next checkpoint will have shards of about these sizes: have its buffers touched by then.
        self.ram.prewarm(next_shards)
        return True

    def pending_disk_writes(self) -> int:
        return self._to_disk.qsize()

    # --- the object tier ---------------------------------------------------------------

    def _queue_object(self, task: ObjectTask) -> None:
        """Queue an object-store task (under the lock). Uploads are bounded; other tasks are small and kept."""
        if task.kind == "upload":
            for old in [t for t in self._object_tasks if t.kind == "upload" and t.job == task.job]:
                self._object_tasks.remove(old)
                log.info("%s step %d: upload superseded by step %d", old.job, old.step, task.step)
            uploads = [t for t in self._object_tasks if t.kind == "upload"]
            if len(uploads) >= self.upload_queue:
                self._object_tasks.remove(uploads[0])
                log.warning("%s step %d: not uploaded: the upload queue is full (%d)", uploads[0].job,
                            uploads[0].step, self.upload_queue)
        self._object_tasks.append(task)
        self._cond.notify_all()

    def object_status(self) -> dict:
        """The object tier as ``dashrun status`` shows it."""
        if self.objects is None:
            return {"object_store": None}
        return {"object_store": self.objects.url, "pending_uploads":
                self.pending_uploads(), "object_listed": self._object_scanned, "object_error": self._object_scan_error}

    def pending_uploads(self) -> int:
        with self._cond:
            return sum(t.kind == "upload" for t in self._object_tasks) + (
                self._object_busy is not None and self._object_busy.kind == "upload")

    def object_next(self, timeout: float) -> bool:
        """Run the next object-store task that is due (the initial listing first); False if none was within
        ``timeout``. A failed task stays first in the queue and is tried again after a pause that doubles."""
        def due() -> bool:
            return self._closing.is_set() or (
                (not self._object_scanned or bool(self._object_tasks)) and time.monotonic() >= self._object_retry_at)

        with self._cond:
            if not self._cond.wait_for(due, timeout) or self._closing.is_set():
                return False
            task = None
            if self._object_scanned:
                task = self._object_busy = self._object_tasks.popleft()
        try:
            if task is None:
                self.load_objects()
            else:
                self._run_object_task(task)
        except DashError as e:
            with self._cond:
                if task is None:
                    if self._object_scan_error != str(e):
                        log.error("cannot list the object store (%s); jobs held only there stay unknown until it "
                                  "answers", e)
                    self._object_scan_error = str(e)
                else:
                    self._object_failed(task, e)
                self._object_retry_at = time.monotonic() + self._object_delay * random.uniform(0.5, 1.0)
                self._object_delay = min(self._object_delay * 2, OBJECT_BACKOFF[1])
        except Exception:  # a bug must not stop the uploader
            log.exception("%s: object store %s failed", task.job if task else "-", task.kind if task else "listing")
        else:
            with self._cond:
                self._object_delay = OBJECT_BACKOFF[0]
                if task is not None and self._object_failures.pop(task.job, None) is not None:
                    log.info("%s: the object store works again", task.job)
        finally:
            with self._cond:
                self._object_busy = None
                self._cond.notify_all()
        return True

    def _object_failed(self, task: ObjectTask, error: DashError) -> None:
        """Under the lock: show why ``task`` failed; put it back first in line if it is still wanted."""
        reason = str(error)
        if self._object_failures.get(task.job) != reason:
            log.error("%s: object store %s failed (%s); retrying with backoff", task.job,
                      task.kind if task.step < 0 else f"{task.kind} of step {task.step}", reason)
        self._object_failures[task.job] = reason
        if task.kind == "upload":
            newer = any(t.kind == "upload" and t.job == task.job for t in self._object_tasks)
            wanted = not (newer or task.entry.dropped or "disk" not in task.entry.tiers)
        else:
            wanted = task.kind != "spec" or task.job in self._specs
        if wanted:
            self._object_tasks.appendleft(task)

    def object_tasks(self) -> int:
        """Object-store tasks queued or running (the initial listing counts as one)."""
        with self._cond:
            return len(self._object_tasks) + (self._object_busy is not None) + (not self._object_scanned)

    def _run_object_task(self, task: ObjectTask) -> None:
        if task.kind == "upload":
            self._upload(task.entry)
        elif task.kind == "spec":
            with self._cond:
                spec = self._specs.get(task.job)
            if spec is not None:
                self.objects.put_spec(spec, task.job)
        elif task.kind == "delete":
            self.objects.delete(task.job, task.step)
            log.info("%s step %d: deleted from the object store", task.job, task.step)
        elif task.kind == "unspec":
            self.objects.delete_spec(task.job)

    def _upload(self, entry: Entry) -> None:
        with self._cond:
            if entry.dropped or "disk" not in entry.tiers or "object" in entry.tiers:
                return  # deleted, superseded, or already there
        with contextlib.ExitStack() as stack:
            try:
                # Mapped files stay readable even if retention deletes the step meanwhile.
                views = [stack.enter_context(self.disk.open(entry.job, entry.step, r)) for r in range(entry.world)]
            except NotFoundError:
                return
            started = time.monotonic()
            self.objects.put(entry.info, views)
            elapsed = time.monotonic() - started
        with self._cond:
            if entry.dropped:  # deleted while it went up
                self._queue_object(ObjectTask("delete", entry.job, entry.step))
                return
            entry.tiers.add("object")
            entry.advance(State.IN_OBJECT_STORE)
            self._trim_object(entry.job)
            self._cond.notify_all()
        log.info("%s step %d: %s uploaded in %.1fs", entry.job, entry.step, format_size(entry.info.nbytes), elapsed)

    def _read_object(self, entry: Entry, rank: int) -> mmap.mmap:
        """Download one shard into a RAM buffer (the caller releases it). A corrupt checkpoint leaves the catalogue."""
        with self._cond:
            buffer = self._reserve(entry.shards[rank].nbytes, entry)
        try:
            with memoryview(buffer) as view:
                self.objects.read_into(entry.job, entry.step, rank, view, shard=entry.shards[rank])
        except ChecksumError as e:
            self.ram.release(buffer)
            with self._cond:
                if not entry.dropped:
                    log.error("%s step %d: %s; dropped from the catalogue, the checkpoint before it is served "
                              "instead", entry.job, entry.step, e)
                    entry.tiers.discard("object")
                    if not entry.tiers:
                        self._forget(entry)
            raise
        except BaseException:
            self.ram.release(buffer)
            raise
        return buffer

    # --- jobs ------------------------------------------------------------------------------

    def put_spec(self, job: str, spec: JobSpec) -> None:
        self.disk.put_spec(spec, job)
        with self._cond:
            self._specs[job] = spec
            if self.objects is not None:
                self._queue_object(ObjectTask("spec", job))

    def spec(self, job: str) -> JobSpec | None:
        with self._cond:
            return self._specs.get(job)

    def record_notice(self, job: str, notice: Notice) -> None:
        log.warning("%s: %s notice from %s (%s)", job, notice.kind, notice.node or "a node", notice.cloud)
        with self._cond:
            self._notices[job] = {**notice.to_body(), "at": time.time()}

    def node_seen(self, job: str, node: str) -> None:
        with self._cond:
            self._nodes.setdefault(job, {})[node] = time.time()

    def delete(self, job: str, keep: int = 0) -> list[int]:
        """Forget all committed checkpoints of a job but the newest ``keep``; with 0, its spec too.

        A checkpoint being read goes once its readers are done.
        """
        with self._cond:
            steps = self._committed.get(job, {})
            doomed = sorted(steps)[:max(0, len(steps) - keep)]
            entries = [steps.pop(step) for step in doomed]
            for entry in entries:
                entry.dropped = True
                if "ram" in entry.tiers and entry.readers == 0:
                    self._release_ram(entry)
                if "object" in entry.tiers:
                    self._queue_object(ObjectTask("delete", job, entry.step))
            if keep == 0:
                for task in [t for t in self._object_tasks if t.job == job and t.kind in ("upload", "spec")]:
                    self._object_tasks.remove(task)
                if self.objects is not None:
                    self._queue_object(ObjectTask("unspec", job))
                for entry in [e for (j, _), e in self._receiving.items() if j == job]:
                    self._drop_receiving(entry)
                self._specs.pop(job, None)
                self._nodes.pop(job, None)
                self._notices.pop(job, None)
                self._disk_failures.pop(job, None)
                self._object_failures.pop(job, None)
                if not steps:
                    self._committed.pop(job, None)
        for entry in entries:
            if "disk" in entry.tiers:
                self.disk.delete(job, entry.step)
        if keep == 0:
            self.disk.delete_spec(job)
        if entries:
            log.info("%s: deleted steps %s", job, ", ".join(map(str, doomed)))
        return doomed

    # --- reading -------------------------------------------------------------------------

    def latest(self, job: str, step: int | None = None) -> CheckpointInfo | None:
        with self._cond:
            steps = self._committed.get(job, {})
            if not steps and not self._object_scanned:
                raise UnavailableError(f"dash-memd has not listed its object store yet, which may hold {job}"
                                       + (f" ({self._object_scan_error})" if self._object_scan_error else ""),
                                       hint="it keeps trying; check the bucket's endpoint and credentials")
            if step is None:
                step = max(steps, default=None)
            entry = steps.get(step) if step is not None else None
            return entry.info if entry else None

    @contextlib.contextmanager
    def open_shard(self, job: str, step: int, rank: int) -> Iterator[tuple[memoryview, int]]:
        """One committed shard's bytes and CRC-32C, pinned while the context lasts."""
        with self._cond:
            entry = self._committed.get(job, {}).get(step)
            if entry is None or not 0 <= rank < entry.world:
                raise NotFoundError(f"{job} has no committed checkpoint of step {step} with rank {rank}")
            entry.readers += 1
            tiers = set(entry.tiers)
            header = entry.shards[rank]
        try:
            if "ram" in tiers:
                with memoryview(entry.buffers[rank]) as view:
                    yield view[:header.nbytes], header.crc
                return
            if "disk" in tiers:
                with contextlib.ExitStack() as stack:
                    try:
                        view = stack.enter_context(self.disk.open(job, step, rank))
                    except NotFoundError:
                        if "object" not in tiers:
                            raise
                        log.warning("%s step %d: gone from disk; reading it from the object store", job, step)
                    else:
                        yield view, header.crc
                        return
            if "object" not in tiers:
                raise NotFoundError(f"{job} step {step} is no longer held")
            buffer = self._read_object(entry, rank)
            try:
                with memoryview(buffer) as view:
                    yield view[:header.nbytes], header.crc
            finally:
                self.ram.release(buffer)
        finally:
            with self._cond:
                entry.readers -= 1
                if entry.readers == 0 and entry.dropped and "ram" in entry.tiers:
                    self._release_ram(entry)
                elif entry.readers == 0 and not entry.dropped:
                    self._trim_ram(job)

    def wait(self, job: str, step: int, timeout: float, *, on_disk: bool = False) -> bool:
        """Block until step ``step`` of ``job`` is committed (and, with ``on_disk``, on disk); False on timeout."""
        def reached() -> bool:
            entry = self._committed.get(job, {}).get(step)
            return entry is not None and (not on_disk or entry.state != State.COMMITTED)

        with self._cond:
            return self._cond.wait_for(reached, timeout)

    def jobs(self) -> list[dict]:
        """A summary of every job (newest first), for ``dashrun status`` and ``dashrun ls``."""
        with self._cond:
            out = [self._summary(job) for job in self._committed.keys() | self._specs.keys()]
        return sorted(out, key=lambda j: j["updated"], reverse=True)

    def _summary(self, job: str) -> dict:
        steps = self._committed.get(job, {})
        spec = self._specs.get(job)
        checkpoints = [{"step": e.step, "state": e.state.value, "tiers": sorted(e.tiers), "world": e.world,
                        "nbytes": e.info.nbytes, "committed_at": e.info.committed_at}
                       for _, e in sorted(steps.items())]
        newest = checkpoints[-1] if checkpoints else None
        return {
            "job": job,
            "newest": newest,
            "checkpoints": checkpoints,
            "receiving": sorted(s for (j, s) in self._receiving if j == job),
            "disk_error": self._disk_failures.get(job),
            "object_error": self._object_failures.get(job),
            "nodes": self._nodes.get(job, {}),
            "spec": spec.to_body() if spec else None,
            "notice": self._notices.get(job),
            "updated": max(newest["committed_at"] if newest else 0.0, spec.created if spec else 0.0),
        }
