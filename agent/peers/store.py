"""The agent's store: shards held in its own memory, its node's own snapshot and other nodes' replicas.

Each shard lives in a memfd segment the agent owns, keyed (job, step, rank),
with its :class:`~dashrun.wire.messages.ShardHeader` (its CRC-32C set), the
node it is a copy of (its *owner*), whether its step is known committed, and
its marks (:mod:`dashrun.wire.blocks`: the running CRC-32C at every block
boundary, taken as the bytes came in), so that any byte range read out is
checked against the checksum of the bytes as they arrived.

The store holds at most ``limit`` bytes of segments. What it lets go when a
shard does not fit, per job: every step older than the newest committed one
(dropped as soon as a step is known committed, :meth:`Store.committed`), and
a step that is not committed once a newer step of the same owner arrives. So
per owner it keeps the newest committed step and the step arriving, and the
copies of a node that left the job stay until a newer step is committed
(its replacement may need them). A shard that cannot fit after that is
refused with NoSpaceError. A dropped segment is kept, within the limit, for
the next shard of its size (fresh memory costs far more per byte than
writing to pages that exist: 0.6-0.8 s per GiB on the build VM), and closed
once its room is needed. A new segment is mapped half of :data:`HEADROOM`
larger than its shard, and a free one is taken for any shard it holds with
no more than that to spare: the next checkpoint of a model, whose layout
description may be a few bytes longer or shorter, fits the segment the one
before it left. The limit counts the bytes of the shards a segment holds:
the pages past them stay untouched, and take no memory.

Thread-safe: a shard being read (:meth:`Store.read`, :meth:`Store.open`) is
never closed under its reader; it goes once the last reader is done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import threading
from typing import Callable, Iterator, Sequence

from dashrun.errors import ChecksumError, ConflictError, NoSpaceError, ProtocolError
from dashrun.util.files import unmap
from dashrun.util.units import format_size
from dashrun.wire import blocks
from dashrun.wire.blocks import BLOCK, Marks
from dashrun.wire.messages import CheckpointInfo, ShardHeader, tiling_problem
from dashrun.wire.protocol import crc32c

__all__ = ["Holding", "Receiving", "Store", "copy_in"]

log = logging.getLogger(__name__)

Key = tuple[str, int, int]  # (job, step, rank)

#: Most bytes a segment has beyond its shard's.
HEADROOM = 128 << 10


class _Segment:
    """A memfd segment of ``capacity`` bytes, mapped read-write."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.charge = 0  # the bytes the store's limit counts for it: its shard's
        self.fd = os.memfd_create("dash-agent-store", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(capacity, 1))
            self.mapped = mmap.mmap(self.fd, max(capacity, 1))
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        unmap(self.mapped)
        os.close(self.fd)


@dataclasses.dataclass
class _Held:
    header: ShardHeader
    owner: str
    segment: _Segment
    marks: Marks
    committed: bool = False
    users: int = 0
    dropped: bool = False


@dataclasses.dataclass(frozen=True)
class Holding:
    """One shard the store holds, as the agent tells dash-memd (HOLDINGS)."""

    header: ShardHeader
    owner: str
    committed: bool


class Receiving:
    """Room reserved for one arriving shard: fill :attr:`view`, then :meth:`finish` (or :meth:`abort`).

    Used as a context manager, it is aborted unless finished inside it.
    """

    def __init__(self, store: Store, header: ShardHeader, owner: str, segment: _Segment):
        self.store, self.header, self.owner, self._segment = store, header, owner, segment
        self.view = memoryview(segment.mapped)[:header.nbytes]
        self._done = False

    def finish(self, marks: Marks, expected: int | None) -> ShardHeader:
        """Make the shard readable; ``marks`` as its bytes came in (:meth:`Channel.recv_data_into`,
        :func:`copy_in`). ChecksumError (and the room is given back) unless the bytes' CRC-32C is ``expected``
        (None: no checksum known beside the marks'). Returns the header as held, its crc set."""
        crc = marks[-1] if len(marks) else 0
        try:
            blocks.check_marks(marks, self.header.nbytes, crc)
        except ValueError as e:
            self.abort()
            raise ProtocolError(str(e)) from None
        if expected is not None and crc != expected:
            self.abort()
            raise ChecksumError(f"{self.header.job} step {self.header.step}, rank {self.header.rank}'s shard: "
                                f"CRC-32C {crc:#010x} where {expected:#010x} was announced")
        self._release_view()
        self._done = True
        header = dataclasses.replace(self.header, crc=crc)
        self.store._finish(header, self.owner, self._segment, marks)
        return header

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._release_view()
            self.store._give_back(self._segment)

    def _release_view(self) -> None:
        self.view.release()

    def __enter__(self) -> Receiving:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


class Store:
    """Shards in this agent's memory, within ``limit`` bytes (see the module's text)."""

    def __init__(self, limit: int, option: str = "--peer-memory-limit"):
        self.limit = limit
        self.option = option
        self._lock = threading.Lock()
        self._held: dict[Key, _Held] = {}
        self._free: list[_Segment] = []  # dropped segments kept for a shard of their size
        self._used = 0  # bytes of every segment alive: held, being filled, free, dropped but still read
        self._newest_committed: dict[str, int] = {}
        self._closed = False
        #: told (under the store's lock: it must not block) whenever what the store holds changes, so that the
        #: agent announces it at once (:mod:`dashrun.agent.announcer`)
        self.changed: Callable[[], None] = lambda: None

    # --- filling --------------------------------------------------------------------------

    def reserve(self, header: ShardHeader, owner: str) -> Receiving:
        """Room for ``header``'s shard, a copy of node ``owner``'s; NoSpaceError if it cannot fit after dropping
        what the store may let go, ConflictError for a step older than the job's newest committed one here."""
        need = header.nbytes
        if need > self.limit:
            raise NoSpaceError(f"a shard of {format_size(need)} ({need} bytes) is larger than this agent's "
                               f"{format_size(self.limit)} of peer memory ({self.option})",
                               hint=f"raise {self.option} on the node that keeps it")
        with self._lock:
            newest = self._newest_committed.get(header.job)
            if newest is not None and header.step < newest:
                raise ConflictError(f"{header.job} step {header.step} is older than step {newest}, committed "
                                    "already: not kept")
            segment = self._room(header, owner, need)
        return Receiving(self, header, owner, segment)

    def put(self, header: ShardHeader, owner: str, views: Sequence[memoryview], expected: int | None = None,
            committed: bool = False) -> ShardHeader:
        """Copy a whole shard in (``views``, in order); returns its header as held (crc set)."""
        with self.reserve(header, owner) as slot:
            marks = copy_in(slot.view, views)
            held = slot.finish(marks, expected)
        if committed:
            self.committed(header.job, header.step)
        return held

    def _room(self, header: ShardHeader, owner: str, need: int) -> _Segment:
        """A segment for ``need`` bytes: a free one of about that size, or a new one once there is room (under
        _lock)."""
        while True:
            for i, free in enumerate(self._free):
                if need <= free.capacity <= need + HEADROOM and self._used - free.charge + need <= self.limit:
                    self._used += need - free.charge
                    free.charge = need
                    return self._free.pop(i)
            if self._used + need <= self.limit:
                segment = _Segment(need + HEADROOM // 2)
                segment.charge = need
                self._used += need
                return segment
            if self._free:
                self._close(self._free.pop(0))
                continue
            victim = self._evictable(header, owner)
            if victim is None:
                in_use = sum(h.segment.charge for h in self._held.values())
                raise NoSpaceError(
                    f"{header.job} step {header.step}, rank {header.rank}'s shard ({format_size(need)}) does not fit "
                    f"in this agent's {format_size(self.limit)} of peer memory: {format_size(in_use)} hold shards "
                    f"it must keep (the newest committed step and the steps arriving; {self.option})",
                    hint=f"raise {self.option} on the node that keeps it")
            self._drop(victim)

    def _evictable(self, header: ShardHeader, owner: str) -> Key | None:
        """The oldest shard the policy lets go to make room for ``header`` of ``owner`` (under _lock)."""
        newest_of: dict[tuple[str, str], int] = {(header.job, owner): header.step}
        for (job, step, _), held in self._held.items():
            newest_of[(job, held.owner)] = max(step, newest_of.get((job, held.owner), step))
        candidates = []
        for key, held in self._held.items():
            job, step, _ = key
            newest = self._newest_committed.get(job)
            older_than_committed = newest is not None and step < newest
            superseded = not held.committed and step < newest_of[(job, held.owner)]
            if older_than_committed or superseded:
                candidates.append((step, key))
        return min(candidates)[1] if candidates else None

    def _finish(self, header: ShardHeader, owner: str, segment: _Segment, marks: Marks) -> None:
        key = (header.job, header.step, header.rank)
        with self._lock:
            if self._closed:
                self._close(segment)
                return
            if key in self._held:
                self._drop(key)  # a new attempt at the step replaces the copy before it
            newest = self._newest_committed.get(header.job)
            self._held[key] = _Held(header, owner, segment, marks,
                                    committed=newest is not None and header.step == newest)
            self.changed()

    def _give_back(self, segment: _Segment) -> None:
        with self._lock:
            if self._closed:
                self._close(segment)
            else:
                self._free.append(segment)

    def _drop(self, key: Key) -> None:
        """Forget a shard (under _lock); its segment is kept for reuse once no reader holds it."""
        held = self._held.pop(key)
        held.dropped = True
        if held.users == 0:
            self._free.append(held.segment)

    def _close(self, segment: _Segment) -> None:
        segment.close()
        self._used -= segment.charge

    # --- commits ----------------------------------------------------------------------------

    def committed(self, job: str, step: int) -> None:
        """``step`` of ``job`` is committed: its shards are kept, every older step's go."""
        with self._lock:
            if step < self._newest_committed.get(job, -1):
                return
            self._newest_committed[job] = step
            for key, held in list(self._held.items()):
                if key[0] != job:
                    continue
                if key[1] == step:
                    held.committed = True
                elif key[1] < step:
                    self._drop(key)
            self.changed()

    # --- reading ----------------------------------------------------------------------------

    def holds(self, job: str, step: int, rank: int, crc: int) -> bool:
        with self._lock:
            held = self._held.get((job, step, rank))
            return held is not None and held.header.crc == crc

    @contextlib.contextmanager
    def open(self, job: str, step: int, rank: int, crc: int | None = None) -> Iterator[tuple[memoryview, Marks,
                                                                                             ShardHeader] | None]:
        """The shard's bytes, marks and header while the caller holds them (None: not held, or of another crc)."""
        with self._lock:
            held = self._held.get((job, step, rank))
            if held is None or (crc is not None and held.header.crc != crc):
                held = None
            else:
                held.users += 1
        if held is None:
            yield None
            return
        view = memoryview(held.segment.mapped)[:held.header.nbytes]
        try:
            yield view, held.marks, held.header
        finally:
            view.release()
            with self._lock:
                held.users -= 1
                if held.dropped and held.users == 0:
                    if self._closed:
                        self._close(held.segment)
                    else:
                        self._free.append(held.segment)

    def read(self, job: str, step: int, rank: int, crc: int, offset: int, views: Sequence[memoryview]) -> bool:
        """Copy bytes ``[offset, offset + len(views))`` of a held shard into ``views``, checked against the
        CRC-32C of the bytes as they arrived (ChecksumError if they changed since); False if it is not held."""
        with self.open(job, step, rank, crc) as opened:
            if opened is None:
                return False
            view, marks, header = opened
            total = sum(len(v) for v in views)
            if not 0 <= offset <= offset + total <= header.nbytes:
                raise ProtocolError(f"bytes [{offset}, {offset + total}) of a shard of {header.nbytes}")
            expected = blocks.range_crc(view, marks, offset, offset + total)
            got, at = 0, offset
            for dest in views:
                dest = memoryview(dest).cast("B")
                for start in range(0, len(dest), BLOCK):
                    piece = dest[start:start + BLOCK]
                    piece[:] = view[at:at + len(piece)]
                    got = crc32c(piece, got)  # the copy, still in cache
                    at += len(piece)
            if got != expected:
                raise ChecksumError(f"{job} step {step}, rank {rank}'s shard changed in this agent's memory")
            return True

    # --- what is held -----------------------------------------------------------------------

    def holdings(self, job: str | None = None) -> list[Holding]:
        with self._lock:
            return sorted((Holding(h.header, h.owner, h.committed) for k, h in self._held.items()
                           if job is None or k[0] == job), key=lambda h: (h.header.job, h.header.step, h.header.rank))

    def checkpoint(self, job: str, step: int | None = None) -> CheckpointInfo | None:
        """The newest committed step of ``job`` (or ``step``, committed) whose every rank's shard is held here,
        described as dash-memd would (``committed_at`` 0: the time is dash-memd's); None where one is missing."""
        with self._lock:
            newest = self._newest_committed.get(job)
            if newest is None or (step is not None and step != newest):
                return None
            shards = sorted((h.header for (j, s, _), h in self._held.items() if j == job and s == newest),
                            key=lambda header: header.rank)
        if not shards or [shard.rank for shard in shards] != list(range(shards[0].world)):
            return None
        first = shards[0]
        if any(shard.world != first.world for shard in shards) or tiling_problem(shards, first.rep_total,
                                                                                  first.layout):
            return None
        return CheckpointInfo(job, newest, first.world, first.rep_total, first.layout, 0.0, tuple(shards))

    def newest_committed(self, job: str) -> int | None:
        with self._lock:
            return self._newest_committed.get(job)

    @property
    def used(self) -> int:
        """Bytes of memory the store's segments take now (shards held, being filled, kept for reuse)."""
        with self._lock:
            return self._used

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for key, held in list(self._held.items()):
                self._drop(key)
            free, self._free = self._free, []
            for segment in free:
                self._close(segment)


def copy_in(dest: memoryview, sources: Sequence[memoryview], gate: Callable[[int], None] | None = None) -> Marks:
    """Copy ``sources`` (in order) into ``dest`` a block at a time, each block checksummed as it lands (in
    cache); ``gate(end)`` returns once the source's first ``end`` bytes are final. Returns the marks."""
    marks = Marks("I", [0])
    crc, at = 0, 0
    for source in sources:
        source = memoryview(source).cast("B")
        offset = 0
        while offset < len(source):
            n = min(BLOCK - at % BLOCK, len(source) - offset)
            if gate is not None:
                gate(at + n)
            piece = dest[at:at + n]
            piece[:] = source[offset:offset + n]
            crc = crc32c(piece, crc)
            offset += n
            at += n
            if at % BLOCK == 0:
                marks.append(crc)
    if at != len(dest):
        raise ProtocolError(f"{at} bytes copied into a shard of {len(dest)}")
    if at % BLOCK:
        marks.append(crc)
    return marks
