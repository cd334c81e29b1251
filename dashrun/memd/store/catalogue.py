"""dash-memd's catalogue: which checkpoints exist, in which state, in which tiers.

A checkpoint of step N of a job is assembled from one shard per rank. It is
invisible while RECEIVING; it becomes COMMITTED — atomically, under the
catalogue's lock — once every rank's shard has arrived with a matching
CRC-32C and the shards tile the replicated state; then ON_DISK once the disk
tier holds it, IN_OBJECT_STORE once the bucket does (:mod:`.entry`). A
checkpoint no tier holds leaves the catalogue.

:class:`Catalogue` is what the server calls; it serves reads and deletes,
and hands the rest to its parts, which share one
:class:`~dashrun.memd.store.ledger.Ledger` (one condition variable guards all
bookkeeping; bytes move outside it):

* :mod:`.receiver` — shards into RAM, and the commit;
* :mod:`.retention` — how many checkpoints each tier keeps, which RAM may go;
* :mod:`.disk_writer` — RAM to disk, in commit order;
* :mod:`.uploader` — with an object tier: uploads, deletions and specs behind
  the disk;
* :mod:`.downloads` — reads from the bucket: one download per shard, shared;
* :mod:`.verifier` — disk copies checked against their CRC-32C (on every read,
  and in the background after a start), bad ones quarantined.

Reads fall through the tiers: RAM, else disk (checked once per read
session), else the bucket (downloaded into a RAM buffer once, shared by
every read of the shard). A checkpoint being read is pinned (``readers``)
and never evicted or deleted under the reader.

A deletion wins over a disk write or an
upload in progress and, through :mod:`.tombstones`, over the bucket's listing
and a restart: nothing deleted comes back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Iterator

from dashrun.errors import ChecksumError, DashError, NotFoundError, UnavailableError
from dashrun.memd.store import listing
from dashrun.memd.store.disk_writer import DiskWriter
from dashrun.memd.store.downloads import Downloads
from dashrun.memd.store.entry import Entry, State
from dashrun.memd.store.ledger import Ledger
from dashrun.memd.store.receiver import Receiver, Ticket
from dashrun.memd.store.retention import Retention
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.memd.store.tombstones import Tombstone
from dashrun.memd.store.uploader import Uploader
from dashrun.memd.store.verifier import DiskVerifier
from dashrun.wire.blocks import Marks
from dashrun.wire.messages import CheckpointInfo, JobSpec, Notice

if TYPE_CHECKING:  # boto3 is imported only when dash-memd has an object tier
    from dashrun.memd.store.tiers.object import ObjectTier

__all__ = ["Catalogue", "Entry", "State", "Ticket"]

log = logging.getLogger(__name__)


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
        self.downloads = Downloads(self.ledger, self.retention, objects) if objects is not None else None
        if self.downloads is not None:
            self.retention.spare = self.downloads.evict_idle
        self.verifier = DiskVerifier(self.ledger, disk, self.disk_writer.lock)
        if self.uploader is not None:
            self.uploader.disk_copy_failed = self.verifier.failed
        self.receiver = Receiver(self.ledger, self.retention, self.disk_writer)
        if self.downloads is not None:  # between writes: the downloads from the bucket no read wants any more go
            self.disk_writer.between_writes = self._expire_downloads
        self._cond = self.ledger.cond
        self._nodes: dict[str, dict[str, float]] = {}  # job -> node -> when it last sent a shard
        self._notices: dict[str, dict] = {}            # job -> the last interruption notice a node reported

    # --- start-up ----------------------------------------------------------------

    def load_disk(self) -> list[str]:
        """Rebuild the catalogue from the disk tier's manifests and file sizes; returns what was skipped, and
        why. The shards' bytes are checked later (:meth:`verify_next`) and before any read of them.

        A checkpoint a tombstone covers (deleted, but its removal undone by a crash, or failed) is removed
        again, never loaded: with the bucket unreachable too, a start serves nothing deleted."""
        found, problems = self.disk.scan_report()
        infos, removed = self.disk.drop_deleted(found)
        problems += removed
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

    def _expire_downloads(self) -> None:
        with self._cond:
            self.downloads.expire()

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
        """``node`` sent a shard of ``job`` that was taken (the most recent nodes are kept: :mod:`.listing`)."""
        with self._cond:
            listing.node_seen(self._nodes.setdefault(job, {}), node, time.time())

    def delete(self, job: str, keep: int = 0) -> list[int]:
        """Delete all committed checkpoints of a job but the newest ``keep``; with 0, its spec too. Returns the
        steps deleted.

        The deletion is recorded first, durably, as a tombstone in the data dir (:mod:`.tombstones`): if that
        fails (OSError), nothing is deleted and the caller is told. Once this returns, nothing deleted comes
        back, at a restart either: a start removes again a step directory the tombstone covers (a removal a
        crash undid, or one that failed here), and the bucket's listing adopts nothing it covers. Everything
        older than the oldest checkpoint kept goes from every tier, also copies the catalogue does not list (an
        older attempt's, and the bucket's before its first listing). A checkpoint being written to disk
        meanwhile never goes into place, one being uploaded is deleted once up, and one committed while the
        tombstone was written is newer than the deletion and stays. A checkpoint being read goes once its
        readers are done.
        """
        ledger = self.ledger
        tombstones = self.disk.tombstones
        with self.disk_writer.lock:  # no step directory goes into place meanwhile
            with self._cond:
                steps = ledger.committed.get(job, {})
                ordered = sorted(steps)
                if keep and len(ordered) < keep:
                    return []
                below = ordered[-keep] if keep else None  # the oldest checkpoint kept
                doomed = {step: steps[step] for step in ordered if below is None or step < below}
                # Not before a checkpoint it deletes, even should the clock have stepped back since one committed.
                at = max([time.time(), *(entry.info.committed_at for entry in doomed.values())])
            tombstone = Tombstone(job, below, at)
            try:
                tombstones.record(tombstone)
            except OSError as e:
                log.error("%s: nothing deleted: the deletion cannot be recorded in %s (%s)", job, tombstones.path,
                          e.strerror or e)
                raise
            with self._cond:
                steps = ledger.committed.get(job, {})
                entries = [steps.pop(step) for step, entry in doomed.items() if steps.get(step) is entry]
                for entry in entries:
                    entry.dropped = True
                    if "ram" in entry.tiers and entry.readers == 0:
                        ledger.release_ram(entry)
                if self.uploader is not None:
                    self.uploader.deleted(tombstone)
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
            try:
                self.disk_writer.delete_steps(job, below)
                if keep == 0:
                    self.disk.delete_spec(job)
            except OSError as e:  # deleted all the same: the tombstone stays, and a start removes what is left
                log.error("%s: not every deleted copy could be removed from disk (%s); it is removed at the next "
                          "start", job, e.strerror or e)
            else:
                tombstones.purged(tombstone, "disk")
        deleted = [entry.step for entry in entries]
        if deleted:
            log.info("%s: deleted steps %s", job, ", ".join(map(str, deleted)))
        return deleted

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
            with self.downloads.open(entry, rank) as view:  # one download, verified once, for every range
                yield view, header.crc, None
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

    def jobs_page(self, *, after: str | None = None, limit: int,
                  job: str | None = None) -> tuple[list[dict], bool, int]:
        """Summaries of at most ``limit`` jobs in job-id order from the first after ``after``, or of ``job`` alone
        (a LIST page: :mod:`.listing`); whether more jobs follow them, and how many jobs there are in all."""
        with self._cond:
            names = sorted(self.ledger.committed.keys() | self.ledger.specs.keys())
            total = len(names)
            if job is not None:
                names = [job] if job in self.ledger.committed or job in self.ledger.specs else []
            chosen, more = listing.page(names, after, limit)
            return [self._summary(name) for name in chosen], more, total

    def _summary(self, job: str) -> dict:
        """What ``dashrun status`` and ``ls`` show of a job, bounded (:func:`.listing.summary`); with the
        catalogue's lock held."""
        steps = self.ledger.committed.get(job, {})
        spec = self.ledger.specs.get(job)
        checkpoints = [{"step": e.step, "state": e.state.value, "tiers": sorted(e.tiers), "world": e.world,
                        "nbytes": e.info.nbytes, "committed_at": e.info.committed_at,
                        **({} if e.commit_seconds is None else {"commit_s": round(e.commit_seconds, 6)})}
                       for _, e in sorted(steps.items())]
        newest = checkpoints[-1] if checkpoints else None
        return listing.summary(
            job, checkpoints=checkpoints, receiving=sorted(s for (j, s) in self.ledger.receiving if j == job),
            nodes=self._nodes.get(job, {}), spec=spec.to_body() if spec else None,
            disk_error=self.disk_writer.failure(job),
            disk_failures=self.disk_writer.failure_count(job),
            object_error=self.uploader.failure(job) if self.uploader is not None else None,
            quarantined=self.disk.quarantined.get(job, 0),
            bad_ram=self.ledger.bad_ram.get(job, 0),
            notice=self._notices.get(job),
            updated=max(newest["committed_at"] if newest else 0.0, spec.created if spec else 0.0),
        )
