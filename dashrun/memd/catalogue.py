"""dash-memd's catalogue: which checkpoints exist, in which state, in which tiers.

A checkpoint of step N of a job is assembled from one shard per rank. It is
invisible while RECEIVING; it becomes COMMITTED — atomically, under the
catalogue's lock — once every rank's shard has arrived with a matching
CRC-32C and the shards tile the replicated state; then ON_DISK once the disk
tier holds it. States only move forward::

    RECEIVING -> COMMITTED -> ON_DISK -> IN_OBJECT_STORE

The state is how far a checkpoint got; ``tiers`` says where its bytes are
now (RAM copies are evicted once safe on disk, disk copies by retention).

All bookkeeping happens under one condition variable; bytes move outside it.
A checkpoint being read is pinned (``readers``) and never evicted or
deleted under the reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import mmap
import queue
import threading
import time
from typing import Iterator

from dashrun.errors import ConflictError, NoSpaceError, NotFoundError
from dashrun.memd.tiers import DiskTier, RamTier
from dashrun.protocol import CheckpointInfo, JobSpec, NoticeInfo, ShardHeader, tiling_problem
from dashrun.units import format_size

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


class Catalogue:
    def __init__(self, ram: RamTier, disk: DiskTier, *, keep_ram: int = 2, keep_disk: int = 3):
        self.ram = ram
        self.disk = disk
        self.keep_ram = keep_ram
        self.keep_disk = keep_disk
        self._cond = threading.Condition()
        self._receiving: dict[tuple[str, int], Entry] = {}
        self._committed: dict[str, dict[int, Entry]] = {}
        self._to_disk: queue.Queue[Entry] = queue.Queue()
        self._disk_failures: dict[str, str] = {}
        self._specs: dict[str, JobSpec] = {}
        self._nodes: dict[str, dict[str, float]] = {}  # job -> node -> when it last sent a shard
        self._notices: dict[str, dict] = {}            # job -> the last interruption notice a node reported

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
            if entry and (entry.world, entry.rep_total, entry.layout) != (header.world, header.rep_total, header.layout):
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
            if "ram" in entry.tiers:
                self._forget(entry)
            else:
                self._committed[job].pop(entry.step, None)
        return doomed

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
                if written and not entry.dropped:
                    self._disk_failures.pop(entry.job, None)
                    entry.tiers.add("disk")
                    entry.advance(State.ON_DISK)
                    doomed = self._trim_disk(entry.job)
                    self._trim_ram(entry.job)
                elif entry.dropped and entry.readers == 0 and "ram" in entry.tiers:
                    self._release_ram(entry)
                self._cond.notify_all()
        for old in doomed:
            self.disk.delete(old.job, old.step)
            log.info("%s step %d: deleted from disk (keeping the newest %d)", old.job, old.step, self.keep_disk)
        return True

    def pending_disk_writes(self) -> int:
        return self._to_disk.qsize()

    # --- jobs ------------------------------------------------------------------------------

    def put_spec(self, job: str, spec: JobSpec) -> None:
        self.disk.put_spec(spec, job)
        with self._cond:
            self._specs[job] = spec

    def spec(self, job: str) -> JobSpec | None:
        with self._cond:
            return self._specs.get(job)

    def record_notice(self, job: str, notice: NoticeInfo) -> None:
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
            if keep == 0:
                for entry in [e for (j, _), e in self._receiving.items() if j == job]:
                    self._drop_receiving(entry)
                self._specs.pop(job, None)
                self._nodes.pop(job, None)
                self._notices.pop(job, None)
                self._disk_failures.pop(job, None)
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
            from_ram = "ram" in entry.tiers
            header = entry.shards[rank]
        try:
            if from_ram:
                with memoryview(entry.buffers[rank]) as view:
                    yield view[:header.nbytes], header.crc
            else:
                with self.disk.open(job, step, rank) as view:
                    yield view, header.crc
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
            "nodes": self._nodes.get(job, {}),
            "spec": spec.to_body() if spec else None,
            "notice": self._notices.get(job),
            "updated": max(newest["committed_at"] if newest else 0.0, spec.created if spec else 0.0),
        }
