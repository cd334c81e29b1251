"""dash-memd's catalogue: which checkpoints exist, in which state, in which tiers.

A checkpoint of step N of a job is assembled from one shard per rank. It is
invisible while RECEIVING; it becomes COMMITTED — atomically, under the
catalogue's lock — once every rank's shard has arrived with a matching
CRC-32C and the shards tile the replicated state; then ON_DISK once the disk
tier holds it, IN_OBJECT_STORE once the bucket does (:mod:`.entry`). A
checkpoint no tier holds leaves the catalogue.

:class:`Catalogue` is what the server calls; it receives, commits, serves
reads and deletes, and hands the rest to its parts, which share one
:class:`~dashrun.memd.ledger.Ledger` (one condition variable guards all
bookkeeping; bytes move outside it):

* :mod:`.retention` — how many checkpoints each tier keeps, which RAM may go;
* :mod:`.disk_writer` — RAM to disk, in commit order;
* :mod:`.uploader` — with an object tier: uploads, deletions and specs behind
  the disk, and reads from the bucket;
* :mod:`.verifier` — disk copies checked against their CRC-32C (on every read,
  and in the background after a start), bad ones quarantined.

Reads fall through the tiers: RAM, else disk, else the bucket (downloaded into
a RAM buffer for the read). A checkpoint being read is pinned (``readers``)
and never evicted or deleted under the reader.

Each rank's shard of a step is taken once: a copy of it that arrives while it
is being received, or once the step is committed (an agent's retry, a zombie
node), is refused and changes nothing. A deletion wins over a disk write or an
upload in progress and, through :mod:`.tombstones`, over the bucket's listing
and a restart: nothing deleted comes back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import time
from typing import TYPE_CHECKING, Callable, Iterator

from dashrun.errors import ChecksumError, ConflictError, DashError, NoSpaceError, NotFoundError, UnavailableError
from dashrun.memd.disk_writer import DiskWriter
from dashrun.memd.entry import Entry, State
from dashrun.memd.ledger import Ledger
from dashrun.memd.retention import Retention
from dashrun.memd.tiers import DiskTier, RamTier
from dashrun.memd.uploader import Uploader
from dashrun.memd.verifier import DiskVerifier
from dashrun.util.units import format_size
from dashrun.wire.blocks import Marks, check_marks
from dashrun.wire.messages import CheckpointInfo, JobSpec, Notice, ShardHeader, tiling_problem

if TYPE_CHECKING:  # boto3 is imported only when dash-memd has an object tier
    from dashrun.memd.tiers.object import ObjectTier

__all__ = ["Catalogue", "Entry", "State", "Ticket"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Ticket:
    """One shard being received into ``buffer``.

    ``cancel``, set by the receiver, ends the receive at once (its connection's recv fails); called, with the
    catalogue's lock held, when a newer copy of the shard, or a shard of a newer world, replaces this one.
    """

    entry: Entry
    header: ShardHeader
    buffer: mmap.mmap
    cancel: Callable[[], None] | None = None
    replaced: str | None = None  # why this copy is no longer wanted, once a newer one replaced it


class Catalogue:
    """The checkpoints dash-memd holds; every method is safe to call from any thread.

    ``ram``, ``disk`` and ``objects`` (None without an object tier) are its
    tiers; ``uploader`` is None without an object tier.
    """

    def __init__(self, ram: RamTier, disk: DiskTier, *, keep_ram: int = 2, keep_disk: int = 3,
                 objects: ObjectTier | None = None, keep_object: int = 20, upload_queue: int = 8):
        self.ram = ram
        self.disk = disk
        self.objects = objects
        self.ledger = Ledger(ram)
        self.retention = Retention(self.ledger, keep_ram=keep_ram, keep_disk=keep_disk, keep_object=keep_object)
        self.uploader = (Uploader(self.ledger, objects, disk, self.retention, upload_queue=upload_queue)
                         if objects is not None else None)
        self.disk_writer = DiskWriter(self.ledger, disk, self.retention, self.uploader)
        self.verifier = DiskVerifier(self.ledger, disk, self.disk_writer.lock)
        if self.uploader is not None:
            self.uploader.disk_copy_failed = self.verifier.failed
        self._cond = self.ledger.cond
        self._nodes: dict[str, dict[str, float]] = {}  # job -> node -> when it last sent a shard
        self._notices: dict[str, dict] = {}            # job -> the last interruption notice a node reported
        #: Raises (ConflictError) for a shard its job no longer takes: one of an older world generation
        #: (:meth:`dashrun.memd.membership.Membership.check_shard`). Called as a shard is announced and as its
        #: checkpoint commits, with the catalogue's lock held; it must not block.
        self.fence: Callable[[ShardHeader], None] = lambda header: None

    # --- start-up ----------------------------------------------------------------

    def load_disk(self) -> list[str]:
        """Rebuild the catalogue from the disk tier's manifests and file sizes; returns what was skipped, and
        why. The shards' bytes are checked later (:meth:`verify_next`) and before any read of them."""
        infos, problems = self.disk.scan_report()
        specs = self.disk.specs()
        with self._cond:
            self.ledger.specs.update(specs)
            entries = []
            for info in infos:
                entry = Entry(info.job, info.step, info.world, info.rep_total, info.layout,
                              state=State.ON_DISK, shards={s.rank: s for s in info.shards}, tiers={"disk"}, info=info)
                self.ledger.committed.setdefault(info.job, {})[info.step] = entry
                entries.append(entry)
            self.verifier.listed(entries)
        for problem in problems:
            log.warning("disk tier: %s", problem)
        log.info("catalogue: %d checkpoints of %d jobs on disk", len(infos), len(self.ledger.committed))
        return problems

    def load_objects(self) -> list[str]:
        """Add the object tier's checkpoints and specs (see :meth:`Uploader.load_objects`)."""
        return self.uploader.load_objects() if self.uploader is not None else []

    def close(self) -> None:
        """Stop retrying object-store tasks (dash-memd is shutting down)."""
        if self.uploader is not None:
            self.uploader.close()

    # --- receiving --------------------------------------------------------------------

    def begin_shard(self, header: ShardHeader, cancel: Callable[[], None] | None = None) -> Ticket:
        """Reserve RAM for a shard about to arrive; ``cancel`` ends its receive (:class:`Ticket`). Raises
        NoSpaceError if it cannot fit, ConflictError if the same rank's shard of that step is committed already
        (a retry or a zombie node sending it again: what dash-memd holds is not touched) or the step is sent by
        a newer world. A copy of a shard whose first copy still arrives replaces that receive: the first may
        come over a link that died, whose receive would hold the step open until it timed out; a shard of a
        newer world replaces the older world's shards of the step."""
        if header.nbytes > self.ram.limit:
            raise NoSpaceError(
                f"a shard of {format_size(header.nbytes)} exceeds dash-memd's --memory-limit of "
                f"{format_size(self.ram.limit)}")
        with self._cond:
            self.fence(header)
            key = (header.job, header.step)
            shape = (header.world, header.rep_total, header.layout)
            committed = self.ledger.committed.get(header.job, {}).get(header.step)
            if committed is not None and (committed.world, committed.rep_total, committed.layout) == shape:
                raise ConflictError(f"{header.job} step {header.step} is already committed: rank {header.rank}'s "
                                    "shard of it is not taken again", hint="the checkpoint dash-memd holds stays")
            entry = self.ledger.receiving.get(key)
            if entry and (entry.world, entry.rep_total, entry.layout) != shape:
                log.info("%s step %d: a new attempt with another layout replaces the incomplete one",
                         header.job, header.step)
                self.ledger.drop_receiving(entry)
                entry = None
            if entry is not None and header.generation < entry.generation:
                raise ConflictError(f"{header.job} step {header.step}: a shard of world generation "
                                    f"{header.generation}, while world {entry.generation} sends this step: this node "
                                    "was cut off from the job", hint="its ranks restart in the job's new world")
            if entry is None:
                entry = Entry(header.job, header.step, header.world, header.rep_total, header.layout,
                              generation=header.generation)
                self.ledger.receiving[key] = entry
                log.info("%s step %d: receiving (%d ranks)", header.job, header.step, header.world)
            try:
                buffer = self.retention.reserve(header.nbytes, entry)
            except NoSpaceError as e:
                self._drop_if_empty(entry)
                failing = sorted(set(self.disk_writer.failures.values()))
                if failing:  # the disk is not slow but failing: say so, not "a faster disk"
                    raise NoSpaceError(f"dash-memd's RAM is full of checkpoints its disk writes failed to save "
                                       f"({'; '.join(failing)}); this checkpoint is refused, the previous one "
                                       "stays valid", hint="free space in dash-memd's --data-dir (or mend its "
                                       "disk): the writes are tried again") from None
                raise e
            if header.generation < entry.generation:  # a newer world came while the room was waited for
                self.ram.release(buffer)
                raise ConflictError(f"{header.job} step {header.step}: world generation {entry.generation} sends "
                                    f"this step now, not {header.generation}", hint="its ranks restart in the "
                                    "job's new world")
            if header.generation > entry.generation:
                self._newer_world(entry, header.generation)
            stalled = entry.arriving.get(header.rank)
            if stalled is not None:  # its first copy still arrives, maybe over a link that died: this one wins
                log.info("%s step %d: a new copy of rank %d's shard replaces the one still arriving", header.job,
                         header.step, header.rank)
                self._replace(stalled, "a newer copy of the shard replaced it")
            ticket = Ticket(entry, header, buffer, cancel)
            entry.arriving[header.rank] = ticket
            entry.touched = time.monotonic()
            return ticket

    def _replace(self, ticket: Ticket, why: str) -> None:
        """With the lock held: ``ticket``'s receive is no longer wanted; end it (its buffer goes back when its
        receiver aborts or finishes)."""
        ticket.replaced = why
        if ticket.entry.arriving.get(ticket.header.rank) is ticket:
            del ticket.entry.arriving[ticket.header.rank]
        if ticket.cancel is not None:
            ticket.cancel()

    def _newer_world(self, entry: Entry, generation: int) -> None:
        """With the lock held: a shard of world ``generation`` arrives for ``entry``, which holds shards of an
        older world (whose nodes died or were cut off while they sent it): those leave it, so that a committed
        checkpoint's shards are all of one world, and the newer world's shards are kept."""
        stale = sorted(r for r, shard in entry.shards.items() if shard.generation < generation)
        log.info("%s step %d: world generation %d sends it; the shards of world %d (ranks %s) leave it", entry.job,
                 entry.step, generation, entry.generation, ", ".join(map(str, stale)) or "none yet")
        for rank in stale:
            del entry.shards[rank]
            entry.marks.pop(rank, None)
            self.ram.release(entry.buffers.pop(rank))
        for ticket in [t for t in entry.arriving.values() if t.header.generation < generation]:
            self._replace(ticket, f"world generation {generation} sends this step now")
        entry.generation = generation

    def _drop_if_empty(self, entry: Entry) -> None:
        if entry.state == State.RECEIVING and not entry.shards and not entry.arriving and not entry.dropped:
            self.ledger.drop_receiving(entry)  # nothing of it arrived: leave no empty entry behind

    def abort_shard(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.entry.arriving.get(ticket.header.rank) is ticket:
                del ticket.entry.arriving[ticket.header.rank]
            self._drop_if_empty(ticket.entry)
        self.ram.release(ticket.buffer)

    def finish_shard(self, ticket: Ticket, crc: int, marks: Marks | None = None) -> bool:
        """Store a verified shard; commit the checkpoint if it was the last. Returns True if committed.
        ``marks``: its CRC-32C at every block's end as it arrived (see :mod:`dashrun.wire.blocks`), kept with it.

        The ticket's buffer goes into the checkpoint or back to the pool; a buffer the checkpoint already
        holds is released only while it is still being received (a rank sending its shard again replaces
        the copy that arrived before), never once it is committed.
        """
        entry, header = ticket.entry, ticket.header
        if marks is not None:
            check_marks(marks, header.nbytes, crc)
        with self._cond:
            if ticket.replaced is not None:
                self.ram.release(ticket.buffer)
                raise ConflictError(f"{entry.job} step {entry.step}: this copy of rank {header.rank}'s shard is not "
                                    f"taken: {ticket.replaced}")
            del entry.arriving[header.rank]
            if entry.dropped:
                self.ram.release(ticket.buffer)
                return False
            if entry.state != State.RECEIVING:  # committed while this copy arrived, from the copy before it
                self.ram.release(ticket.buffer)
                if entry.shards[header.rank].crc != crc:
                    raise ConflictError(f"{entry.job} step {entry.step} was committed with another copy of rank "
                                        f"{header.rank}'s shard while this one arrived; this one is not taken")
                return True
            old = entry.buffers.pop(header.rank, None)
            if old is not None:
                self.ram.release(old)
            entry.shards[header.rank] = dataclasses.replace(header, crc=crc)
            entry.buffers[header.rank] = ticket.buffer
            if marks is not None:
                entry.marks[header.rank] = marks
            else:
                entry.marks.pop(header.rank, None)
            entry.touched = time.monotonic()
            if len(entry.shards) < entry.world:
                return False
            shards = tuple(entry.shards[r] for r in range(entry.world))
            problem = tiling_problem(shards, entry.rep_total, entry.layout)
            if problem:
                self.ledger.drop_receiving(entry)
                raise ConflictError(f"{entry.job} step {entry.step} cannot commit: {problem}")
            try:  # the job may have moved on to a newer world while the shards arrived
                for shard in shards:
                    self.fence(shard)
            except ConflictError:
                self.ledger.drop_receiving(entry)
                raise
            self._commit(entry, CheckpointInfo(entry.job, entry.step, entry.world, entry.rep_total,
                                               entry.layout, time.time(), shards))
            return True

    def _commit(self, entry: Entry, info: CheckpointInfo) -> None:
        ledger = self.ledger
        del ledger.receiving[(entry.job, entry.step)]
        steps = ledger.committed.setdefault(entry.job, {})
        previous = steps.get(entry.step)
        if previous is not None:  # a later attempt at the same step wins
            ledger.forget(previous)
        entry.info = info
        entry.tiers.add("ram")
        self.ram.adopt(info, [entry.buffers[r] for r in range(entry.world)])
        steps[entry.step] = entry
        entry.advance(State.COMMITTED)
        log.info("%s step %d: %s in RAM", entry.job, entry.step, format_size(info.nbytes))
        for other in [e for (job, step), e in ledger.receiving.items() if job == entry.job and step < entry.step]:
            ledger.drop_receiving(other)
        self.disk_writer.submit(entry)
        self.retention.trim_ram(entry.job)
        self._cond.notify_all()

    # --- the disk writer and the uploader -----------------------------------------------

    def persist_next(self, timeout: float) -> bool:
        """Write the next committed checkpoint to disk. False if none arrived within ``timeout``."""
        return self.disk_writer.persist_next(timeout)

    def pending_disk_writes(self) -> int:
        """Committed checkpoints held in RAM alone, not superseded by a newer one on disk."""
        return self.disk_writer.pending()

    def unwritten_report(self) -> list[str]:
        """One line per job whose committed checkpoints are in RAM alone: the steps a stop now loses, and what
        of the job is kept (on disk, in the bucket)."""
        by_job: dict[str, list[int]] = {}
        for entry in self.disk_writer.unwritten():
            by_job.setdefault(entry.job, []).append(entry.step)
        lines = []
        with self._cond:
            for job, steps in sorted(by_job.items()):
                kept = self.ledger.committed.get(job, {})
                on_disk = max((s for s, e in kept.items() if "disk" in e.tiers), default=None)
                in_bucket = max((s for s, e in kept.items() if "object" in e.tiers), default=None)
                where = f"the newest on disk is step {on_disk}" if on_disk is not None else "none is on disk"
                if self.objects is not None:
                    where += (f", the newest in the bucket step {in_bucket}" if in_bucket is not None
                              else ", none is in the bucket")
                lines.append(f"{job}: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
                             f"{'are' if len(steps) > 1 else 'is'} in RAM only and lost with this stop; {where}")
        return lines

    def verify_next(self) -> bool:
        """Check the next shard file listed at start against its CRC-32C; False once all are checked."""
        return self.verifier.next()

    def object_next(self, timeout: float) -> bool:
        """Run the next object-store task that is due (the initial listing first); False if none was within
        ``timeout``. A failed task stays first in the queue and is tried again after a pause that doubles."""
        if self.uploader is None:
            time.sleep(timeout)
            return False
        return self.uploader.next(timeout)

    def object_status(self) -> dict:
        """The object tier as ``dashrun status`` shows it."""
        return self.uploader.status() if self.uploader is not None else {"object_store": None}

    def pending_uploads(self) -> int:
        return self.uploader.pending_uploads() if self.uploader is not None else 0

    def object_tasks(self) -> int:
        """Object-store tasks queued or running (the initial listing counts as one)."""
        return self.uploader.tasks_left() if self.uploader is not None else 0

    # --- jobs ------------------------------------------------------------------------------

    def put_spec(self, job: str, spec: JobSpec) -> None:
        try:
            self.disk.put_spec(spec, job)
        except OSError as e:  # a full or failing disk must not keep a job from starting: RAM holds the spec
            log.error("%s: launch spec not written to disk (%s); it is kept in RAM", job, e.strerror or e)
        with self._cond:
            self.ledger.specs[job] = spec
            if self.uploader is not None:
                self.uploader.queue_spec(job)

    def spec(self, job: str) -> JobSpec | None:
        with self._cond:
            return self.ledger.specs.get(job)

    def record_notice(self, job: str, notice: Notice) -> None:
        log.warning("%s: %s notice from %s (%s)", job, notice.kind.value, notice.node or "a node", notice.cloud)
        with self._cond:
            self._notices[job] = {**notice.to_body(), "at": time.time()}

    def node_seen(self, job: str, node: str) -> None:
        with self._cond:
            self._nodes.setdefault(job, {})[node] = time.time()

    def delete(self, job: str, keep: int = 0) -> list[int]:
        """Delete all committed checkpoints of a job but the newest ``keep``; with 0, its spec too. Returns the
        steps deleted.

        Everything older than the oldest checkpoint kept goes from every tier, also copies the catalogue does
        not list (an older attempt's, and the bucket's before its first listing). A checkpoint being written to
        disk meanwhile never goes into place, one being uploaded is deleted once up, and what the bucket still
        holds is covered by a tombstone kept on disk until it is purged (:mod:`.tombstones`): nothing deleted
        comes back, at a restart either. A checkpoint being read goes once its readers are done.
        """
        ledger = self.ledger
        with self.disk_writer.lock:  # no step directory goes into place meanwhile
            with self._cond:
                steps = ledger.committed.get(job, {})
                ordered = sorted(steps)
                if keep and len(ordered) < keep:
                    return []
                below = ordered[-keep] if keep else None  # the oldest checkpoint kept
                doomed = [step for step in ordered if below is None or step < below]
                entries = [steps.pop(step) for step in doomed]
                for entry in entries:
                    entry.dropped = True
                    if "ram" in entry.tiers and entry.readers == 0:
                        ledger.release_ram(entry)
                if self.uploader is not None:
                    self.uploader.deleted(job, below)
                if keep == 0:
                    for entry in [e for (j, _), e in ledger.receiving.items() if j == job]:
                        ledger.drop_receiving(entry)
                    ledger.specs.pop(job, None)
                    self._nodes.pop(job, None)
                    self._notices.pop(job, None)
                    ledger.bad_ram.pop(job, None)
                    self.disk_writer.forget_job(job)
                if not steps:
                    ledger.committed.pop(job, None)
            if self.uploader is not None:
                self.uploader.tombstones.save()
            self.disk_writer.delete_steps(job, below)
            if keep == 0:
                self.disk.delete_spec(job)
        if entries:
            log.info("%s: deleted steps %s", job, ", ".join(map(str, doomed)))
        return doomed

    # --- reading -------------------------------------------------------------------------

    def latest(self, job: str, step: int | None = None) -> CheckpointInfo | None:
        with self._cond:
            steps = self.ledger.committed.get(job, {})
            uploader = self.uploader
            if not steps and uploader is not None and uploader.may_hold(job):
                raise UnavailableError(f"dash-memd has not listed its object store yet, which may hold {job}"
                                       + (f" ({uploader.listing_error})" if uploader.listing_error else ""),
                                       hint="it keeps trying; check the bucket's endpoint and credentials")
            if step is None:
                step = max(steps, default=None)
            entry = steps.get(step) if step is not None else None
            return entry.info if entry else None

    @contextlib.contextmanager
    def open_shard(self, job: str, step: int, rank: int,
                   committed_at: float | None = None) -> Iterator[tuple[memoryview, int, Marks | None]]:
        """One committed shard's bytes, CRC-32C and marks (served from RAM, where they were kept as it
        arrived; else None), pinned while the context lasts; with ``committed_at``, only of the attempt at
        that step committed then (a later attempt at a step replaces it)."""
        with self._cond:
            entry = self.ledger.committed.get(job, {}).get(step)
            if entry is None or not 0 <= rank < entry.world:
                raise NotFoundError(f"{job} has no committed checkpoint of step {step} with rank {rank}")
            if committed_at is not None and entry.info.committed_at != committed_at:
                raise NotFoundError(f"{job} step {step} was committed again since it was looked up",
                                    hint="look up the newest checkpoint again")
            entry.readers += 1
            tiers = set(entry.tiers)
            header = entry.shards[rank]
        try:
            if "ram" in tiers:
                with memoryview(entry.buffers[rank]) as view:
                    yield view[:header.nbytes], header.crc, entry.marks.get(rank)
                return
            if "disk" in tiers:
                with contextlib.ExitStack() as stack:
                    try:  # checked before a byte is sent: what is sent cannot be taken back
                        view = stack.enter_context(self.disk.open(job, step, rank, shard=header))
                    except (NotFoundError, ChecksumError) as e:
                        self.verifier.failed(entry, e)
                        if "object" not in tiers:
                            raise type(e)(f"{e}; the checkpoint before it is served instead") from None
                    else:
                        yield view, header.crc, None
                        return
            if "object" not in tiers:
                raise NotFoundError(f"{job} step {step} is no longer held")
            buffer = self.uploader.read_shard(entry, rank)
            try:
                with memoryview(buffer) as view:
                    yield view[:header.nbytes], header.crc, None
            finally:
                self.ram.release(buffer)
        finally:
            with self._cond:
                entry.readers -= 1
                if entry.readers == 0 and not self.ledger.release_unwanted_ram(entry) and not entry.dropped:
                    self.retention.trim_ram(job)

    def ram_copy_failed(self, job: str, step: int, rank: int, marks: Marks, error: DashError) -> None:
        """Bytes of rank ``rank``'s shard in the RAM copy of ``job`` step ``step`` (the copy ``marks``, as
        :meth:`open_shard` gave them, describe) no longer match their checksums from when they arrived: the
        copy leaves the RAM tier (its memory goes back once no one reads it) and the checkpoint is read from
        disk or the bucket; held nowhere else, it leaves the catalogue and the one before it is served."""
        with self._cond:
            entry = self.ledger.committed.get(job, {}).get(step)
            if entry is None or entry.marks.get(rank) is not marks or "ram" not in entry.tiers:
                return  # gone or replaced meanwhile, or reported already
            then = self.ledger.lose_copy(entry, "ram")
        log.error("%s step %d: the RAM copy is bad (%s); %s", job, step, error, then)

    def wait(self, job: str, step: int, timeout: float, *, on_disk: bool = False) -> bool:
        """Block until step ``step`` of ``job`` is committed (and, with ``on_disk``, on disk, or passed over by
        the disk writer for a newer checkpoint of the job that is); False on timeout."""
        def reached() -> bool:
            entry = self.ledger.committed.get(job, {}).get(step)
            if entry is not None and (not on_disk or entry.state != State.COMMITTED):
                return True
            newest_on_disk = self.retention.newest_safe_step(job) if on_disk else None
            return newest_on_disk is not None and newest_on_disk > step

        with self._cond:
            return self._cond.wait_for(reached, timeout)

    def jobs(self) -> list[dict]:
        """A summary of every job (newest first), for ``dashrun status`` and ``dashrun ls``."""
        with self._cond:
            out = [self._summary(job) for job in self.ledger.committed.keys() | self.ledger.specs.keys()]
        return sorted(out, key=lambda j: j["updated"], reverse=True)

    def _summary(self, job: str) -> dict:
        steps = self.ledger.committed.get(job, {})
        spec = self.ledger.specs.get(job)
        checkpoints = [{"step": e.step, "state": e.state.value, "tiers": sorted(e.tiers), "world": e.world,
                        "nbytes": e.info.nbytes, "committed_at": e.info.committed_at}
                       for _, e in sorted(steps.items())]
        newest = checkpoints[-1] if checkpoints else None
        return {
            "job": job,
            "newest": newest,
            "checkpoints": checkpoints,
            "receiving": sorted(s for (j, s) in self.ledger.receiving if j == job),
            "disk_error": self.disk_writer.failure(job),
            "disk_failures": self.disk_writer.failure_count(job),
            "object_error": self.uploader.failure(job) if self.uploader is not None else None,
            "quarantined": self.disk.quarantined.get(job, 0),
            "bad_ram": self.ledger.bad_ram.get(job, 0),
            "nodes": self._nodes.get(job, {}),
            "spec": spec.to_body() if spec else None,
            "notice": self._notices.get(job),
            "updated": max(newest["committed_at"] if newest else 0.0, spec.created if spec else 0.0),
        }
