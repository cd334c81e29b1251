"""Receiving a checkpoint: one shard per rank into RAM, committed once every rank's arrived and they tile.

A checkpoint of step N of a job is invisible while RECEIVING; it becomes
COMMITTED — atomically, under the ledger's lock — once every rank's shard has
arrived with a matching CRC-32C and the shards tile the replicated state
(:mod:`.entry`). Then it is queued for the disk writer.

Each rank's shard of a committed step is taken once: a copy of it that
arrives later (an agent's retry, a zombie node) is refused and changes
nothing. A copy that arrives while the first is still being received
replaces that receive and ends it: the first may come over a link that died
without a word, whose receive would hold the step open until its idle
timeout. A checkpoint holds shards of one world generation: a shard of a
newer world takes the older world's shards out of the step (their nodes died
or were cut off while they sent it), and one of an older world is refused.
Within a world, it holds the shards of one run (``ShardHeader.base``, the step
the run restored): a run that crashed after some of its ranks sent step N
leaves them behind, and the run that redoes N began at a newer step; its
shards take the crashed run's out, so that no checkpoint is made of two runs'
states. (Every rank of a run restores the same step: torch restarts every rank
of the job when one fails or the world changes.)
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from typing import Callable

from dashrun.errors import ConflictError, NoSpaceError
from dashrun.memd.store.disk_writer import DiskWriter
from dashrun.memd.store.entry import Entry, State
from dashrun.memd.store.ledger import Ledger
from dashrun.memd.store.retention import Retention
from dashrun.util.units import format_size
from dashrun.wire.blocks import Marks, check_marks
from dashrun.wire.messages import CheckpointInfo, ShardHeader, tiling_problem

__all__ = ["Receiver", "Ticket"]

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



class Receiver:
    """Receives and commits checkpoints over a :class:`Ledger`; every method is safe to call from any thread."""

    def __init__(self, ledger: Ledger, retention: Retention, disk_writer: DiskWriter):
        self.ledger = ledger
        self.retention = retention
        self.disk_writer = disk_writer
        #: Raises (ConflictError) for a shard its job no longer takes: one of an older world generation
        #: (:meth:`dashrun.memd.fleet.membership.Membership.check_shard`). Called as a shard is announced and as its
        #: checkpoint commits, with the ledger's lock held; it must not block.
        self.fence: Callable[[ShardHeader], None] = lambda header: None
        #: Told of each commit (dash-memd's metrics), with the ledger's lock held; it must not block.
        self.on_commit: Callable[[Entry], None] = lambda entry: None

    def begin_shard(self, header: ShardHeader, cancel: Callable[[], None] | None = None) -> Ticket:
        """Reserve RAM for a shard about to arrive; ``cancel`` ends its receive (:class:`Ticket`). Raises
        NoSpaceError if it cannot fit, ConflictError if the same rank's shard of that step is committed already
        (a retry or a zombie node sending it again: what dash-memd holds is not touched) or the step is sent by
        a newer world. A copy of a shard whose first copy still arrives replaces that receive: the first may
        come over a link that died, whose receive would hold the step open until it timed out; a shard of a
        newer world replaces the older world's shards of the step."""
        if header.nbytes > self.ledger.ram.limit:
            raise NoSpaceError(
                f"a shard of {format_size(header.nbytes)} exceeds dash-memd's --memory-limit of "
                f"{format_size(self.ledger.ram.limit)}")
        with self.ledger.cond:
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
            if entry is not None and header.attempt < entry.attempt:
                raise self._stale(header, entry)
            if entry is None:
                entry = Entry(header.job, header.step, header.world, header.rep_total, header.layout,
                              attempt=header.attempt)
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
            if header.attempt < entry.attempt:  # a newer world or run came while the room was waited for
                self.ledger.ram.release(buffer)
                raise self._stale(header, entry)
            if header.attempt > entry.attempt:
                self._newer_attempt(entry, header.attempt)
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

    @staticmethod
    def _stale(header: ShardHeader, entry: Entry) -> ConflictError:
        """The refusal of a shard of an older sending of its step than ``entry``'s."""
        if header.generation < entry.attempt[0]:
            return ConflictError(f"{header.job} step {header.step}: a shard of world generation {header.generation}, "
                                 f"while world {entry.attempt[0]} sends this step: this node was cut off from the "
                                 "job", hint="its ranks restart in the job's new world")
        return ConflictError(f"{header.job} step {header.step}: a shard of a run that began at step {header.base}, "
                             f"while a run that began at step {entry.attempt[1]} sends this step",
                             hint="a rank of a crashed run sent it late; the newer run's checkpoint stays")

    @staticmethod
    def _sending(attempt: tuple[int, int]) -> str:
        generation, base = attempt
        return f"world {generation}, run from step {base}" if base >= 0 else f"world {generation}, fresh run"

    def _newer_attempt(self, entry: Entry, attempt: tuple[int, int]) -> None:
        """With the lock held: a shard of a newer sending of ``entry``'s step arrives — a newer world, or a run that
        began at a newer step (the ranks of the older died, were cut off, or crashed while they sent it): the
        older one's shards leave it, so that a committed checkpoint's shards are all of one world and one run."""
        stale = sorted(r for r, shard in entry.shards.items() if shard.attempt < attempt)
        log.info("%s step %d: %s sends it; the shards of %s (ranks %s) leave it", entry.job, entry.step,
                 self._sending(attempt), self._sending(entry.attempt), ", ".join(map(str, stale)) or "none yet")
        for rank in stale:
            del entry.shards[rank]
            entry.marks.pop(rank, None)
            self.ledger.ram.release(entry.buffers.pop(rank))
        for ticket in [t for t in entry.arriving.values() if t.header.attempt < attempt]:
            self._replace(ticket, f"{self._sending(attempt)} sends this step now")
        entry.attempt = attempt

    def _drop_if_empty(self, entry: Entry) -> None:
        if entry.state == State.RECEIVING and not entry.shards and not entry.arriving and not entry.dropped:
            self.ledger.drop_receiving(entry)  # nothing of it arrived: leave no empty entry behind

    def abort_shard(self, ticket: Ticket) -> None:
        with self.ledger.cond:
            if ticket.entry.arriving.get(ticket.header.rank) is ticket:
                del ticket.entry.arriving[ticket.header.rank]
            self._drop_if_empty(ticket.entry)
        self.ledger.ram.release(ticket.buffer)

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
        with self.ledger.cond:
            if ticket.replaced is not None:
                self.ledger.ram.release(ticket.buffer)
                raise ConflictError(f"{entry.job} step {entry.step}: this copy of rank {header.rank}'s shard is not "
                                    f"taken: {ticket.replaced}")
            del entry.arriving[header.rank]
            if entry.dropped:
                self.ledger.ram.release(ticket.buffer)
                return False
            if entry.state != State.RECEIVING:  # committed while this copy arrived, from the copy before it
                self.ledger.ram.release(ticket.buffer)
                if entry.shards[header.rank].crc != crc:
                    raise ConflictError(f"{entry.job} step {entry.step} was committed with another copy of rank "
                                        f"{header.rank}'s shard while this one arrived; this one is not taken")
                return True
            old = entry.buffers.pop(header.rank, None)
            if old is not None:
                self.ledger.ram.release(old)
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
        self.ledger.ram.adopt(info, [entry.buffers[r] for r in range(entry.world)])
        steps[entry.step] = entry
        entry.advance(State.COMMITTED)
        entry.commit_seconds = max(0.0, time.monotonic() - entry.begun)
        log.info("%s step %d: %s in RAM", entry.job, entry.step, format_size(info.nbytes))
        for other in [e for (job, step), e in ledger.receiving.items() if job == entry.job and step < entry.step]:
            ledger.drop_receiving(other)
        self.on_commit(entry)
        self.disk_writer.submit(entry)
        self.retention.trim_ram(entry.job)
        self.ledger.cond.notify_all()
