"""The background stager: lays out a rank's shard, hands it to dash-agent, copies it while the agent streams it.

Order of operations for one snapshot, on the stager's one thread:

1. ``save()`` reserved one of the two staging buffers (:meth:`Stager.reserve`);
   if both are still busy the snapshot is skipped, never waited for, unless
   forced.
2. :meth:`Stager.layout` describes the shard (the rank's slice of the
   replicated bytes, its private bytes, the JSON description at the end, as
   :mod:`dashrun.wire.layout` lays them out), makes its
   :class:`~dashrun.wire.messages.ShardHeader`, sizes the buffer and lists the
   copies to make.
3. The buffer goes to the agent by descriptor (SNAPSHOT) before a byte is
   copied; the copy runs in shard order and PROGRESS tells the agent how far
   it may stream. On CPU the copy checksums as it goes (dashrun's C helper,
   :mod:`dashrun.rank.staging`); on CUDA it runs on a side stream.
4. The agent's reply (the shard is stored in dash-memd, or not) releases the
   buffer and counts the shard stored or failed.

A buffer whose hand-over went unanswered (the link to the agent dropped
first) may still be streaming: the agent keeps delivering a fully staged
shard whatever happens to its rank. The agent is given a descriptor of its
own open file of the segment, carrying a read lock (an open file
description lock) that lives as long as anything holds that open file —
the descriptor in flight in the socket, the agent's descriptor or mapping —
and goes when they go or the agent dies. Such a buffer is written again
only once no lock is left; until then it is set aside for a fresh segment
(at most :data:`MAX_SET_ASIDE` at a time, then snapshots are skipped).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
from typing import Any

import torch

from dashrun.errors import ProtocolError
from dashrun.rank import staging, statetree
from dashrun.rank.snapshot import SaveStats, SharedBuffer, Snapshot
from dashrun.util.faults import crash_point
from dashrun.util.problems import ProblemLog
from dashrun.wire import layout
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import Progress, SnapshotReply, SnapshotRequest
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import Kind

__all__ = ["FORCED_SAVE_TIMEOUT", "LOOK_AGAIN", "MAX_SET_ASIDE", "PIECE", "PROGRESS_EVERY", "SAVE", "STORE", "Stager",
           "lend", "lent_out"]

log = logging.getLogger(__name__)

#: How long save(force=True) waits for a buffer before giving up on the snapshot.
FORCED_SAVE_TIMEOUT = 120.0
#: The background copy works in pieces of this size, and tells the agent its progress about this often.
PIECE = 8 << 20
PROGRESS_EVERY = 8 << 20
#: Keys of the rank's ProblemLog: a shard's way to dash-memd (a stored shard says it works again), and the
#: rest of saving and restoring (skipped or unconfirmed snapshots, a restore waiting), which a stored shard clears.
STORE = "store"
SAVE = "save"
#: Segments set aside at a time because the agent may still be reading them (see the module docstring).
MAX_SET_ASIDE = 2
#: How often a forced save waiting for a buffer looks whether the agent let go of one (that notifies nobody).
LOOK_AGAIN = 0.1
_FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid

Copy = tuple[Any, int, int, int]  # (leaf, first byte, end byte, offset in the shard)


def lend(fd: int) -> tuple[int | None, bool]:
    """A descriptor of the segment ``fd`` for the agent (to close once sent), and whether it carries the read lock
    that tells when no one holds it any more: its own read-only open file, locked. (None, False) where that cannot
    be made (no /proc, out of descriptors): ``fd`` itself goes, and its buffer, if unanswered, is never reused."""
    try:
        lent = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, False
    try:
        fcntl.fcntl(lent, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return lent, False
    return lent, True


def lent_out(fd: int) -> bool:
    """Whether a descriptor :func:`lend` made of the segment ``fd`` is still held anywhere (its lock stands)."""
    held = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    return struct.unpack(_FLOCK, held)[0] != fcntl.F_UNLCK


class Stager:
    """One rank's two staging buffers and the thread that fills them (see the module docstring)."""

    def __init__(self, link: AgentLink, *, job_id: str, rank: int, world: int, stats: SaveStats,
                 problems: ProblemLog, generation: int = 0):
        self.link = link
        self.job_id = job_id
        self.rank = rank
        self.world = world
        self.generation = generation  # the world's (dash-memd refuses shards of an older one); 0: not fenced
        self.base = -1                # the step this run restored (a step's shards are all of one run); -1: fresh
        self.stats = stats
        self.problems = problems
        self._buffers: list[SharedBuffer | None] = [None, None]
        self._reserved: set[int] = set()         # buffers save() gave to a snapshot the stager has not laid out
        # Buffers whose hand-over went unanswered -> whether their lock tells when the agent lets go of them.
        self._unanswered: dict[int, bool] = {}
        self._set_aside: list[SharedBuffer] = []  # out of use until the agent lets go of them
        self._cond = threading.Condition()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dashrun-stage")
        self.side_stream = None  # the CUDA stream the copies from the GPU run on, made on first use

    # --- the two buffers ----------------------------------------------------------------

    def reserve(self, wait: bool) -> int | None:
        """Reserve a staging buffer that dash-memd is done with (waiting for one only if ``wait``)."""
        deadline = time.monotonic() + FORCED_SAVE_TIMEOUT
        with self._cond:
            while (index := self._free()) is None and wait and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(left, LOOK_AGAIN) if self._unanswered else left)
            if index is not None:
                self._reserved.add(index)
            return index

    def unreserve(self, index: int) -> None:
        """Give back a buffer :meth:`reserve` gave, unused (its snapshot failed before it was written)."""
        with self._cond:
            self._reserved.discard(index)
            self._cond.notify_all()

    def has_free(self) -> bool:
        """Whether a snapshot could start now without waiting for a buffer (nothing is reserved)."""
        with self._cond:
            return self._free() is not None

    def _free(self) -> int | None:
        """A buffer to write the next snapshot into, if one is free (call with the lock held)."""
        self._settle()
        return next((i for i, b in enumerate(self._buffers) if (b is None or not b.busy)
                     and i not in self._reserved and i not in self._unanswered), None)

    def _settle(self) -> None:
        """Let go of set-aside segments no one reads any more; set aside unanswered buffers that someone may."""
        for buffer in [b for b in self._set_aside if not lent_out(b.fd)]:
            self._set_aside.remove(buffer)
            buffer.close()
        for index, locked in list(self._unanswered.items()):
            buffer = self._buffers[index]
            if locked and not lent_out(buffer.fd):
                del self._unanswered[index]  # the agent is done with it (or gone): written again as it is
            elif not locked:  # no way to tell when the agent lets go: never written again, freed with its last holder
                del self._unanswered[index]
                self._buffers[index] = None
                buffer.close()
            elif len(self._set_aside) < MAX_SET_ASIDE:
                del self._unanswered[index]
                self._buffers[index] = None  # the next snapshot in this place gets a fresh segment
                self._set_aside.append(buffer)

    def _buffer(self, index: int, nbytes: int) -> SharedBuffer:
        """The reserved buffer ``index``, at least ``nbytes`` large, marked busy (call with the lock held)."""
        buffer = self._buffers[index]
        if buffer is None or buffer.capacity < nbytes:
            if buffer is not None:
                buffer.close()
            # Headroom, so a layout that grows a little (counters, longer numbers) reuses the buffer.
            buffer = SharedBuffer(nbytes + max(nbytes // 64, 1 << 20))
            self._buffers[index] = buffer
        buffer.busy = True
        self._reserved.discard(index)
        return buffer

    def _release(self, snapshot: Snapshot, future: concurrent.futures.Future, locked: bool) -> None:
        """The agent answered the SNAPSHOT (the buffer is free again, the shard stored or not), or the link dropped
        first (the agent may still be streaming the buffer: it waits, see :meth:`_settle`)."""
        try:
            self._count(snapshot, future, locked)
        finally:
            snapshot.settled.set()  # wait() reads the stats after this, not when the future alone is done

    def _count(self, snapshot: Snapshot, future: concurrent.futures.Future, locked: bool) -> None:
        error = future.exception()
        with self._cond:
            snapshot.buffer.busy = False
            if error is not None and not getattr(future, "answered", True):
                self._unanswered[snapshot.buffer_index] = locked
            self._cond.notify_all()
        if error is None:
            try:
                SnapshotReply.from_body(future.result().body)
            except ProtocolError as e:  # an odd reply, but the agent said the shard is stored
                log.debug("dashrun: odd SNAPSHOT reply for step %d: %s", snapshot.step, e)
            self.stats.stored += 1
            self.problems.ok(STORE, "dashrun: checkpoints reach dash-memd again (step %d stored)", snapshot.step)
            self.problems.ok(SAVE)
        else:
            self.stats.failed += 1
            self.problems.problem(STORE, f"not stored: {getattr(error, 'code', type(error).__name__)}",
                                  "dashrun: %s", f"checkpoint of step {snapshot.step} not stored: {error}; "
                                  "training continues, the next save tries again")

    # --- staging --------------------------------------------------------------------------

    def submit(self, snapshot: Snapshot) -> None:
        """Stage ``snapshot`` (which holds a reserved buffer) on the stager's thread."""
        self._thread.submit(self._stage, snapshot)

    def layout(self, snapshot: Snapshot) -> list[Copy]:
        """Describe the shard, put it in a buffer, return its copies: (leaf, first, end, shard offset)."""
        rep_offsets, rep_total = statetree.plan(snapshot.rep_leaves)
        rep_json = layout.replicated_part(snapshot.rep_tree, statetree.describe(snapshot.rep_leaves, rep_offsets),
                                          rep_total, snapshot.sharded)
        priv_offsets, own_len = statetree.plan(snapshot.priv_leaves)
        # This rank's pieces of sharded state close its private part, so a restore can leave them out of what
        # every node fetches and read only the ranges it needs (see dashrun.rank.sharded).
        piece_offsets, pieces_len = statetree.plan(snapshot.piece_leaves)
        piece_offsets = [own_len + offset for offset in piece_offsets]
        priv_len = own_len + pieces_len
        private = layout.private_part(snapshot.priv_tree, statetree.describe(snapshot.priv_leaves, priv_offsets),
                                      [[p.index, list(p.offsets), list(p.sizes), at]
                                       for p, at in zip(snapshot.pieces, piece_offsets)])
        # Every rank holds the same description of the replicated state; rank 0 carries it.
        meta = layout.encode(step=snapshot.step, rank=self.rank, world=self.world, private=private,
                             replicated=rep_json if self.rank == 0 else None)
        rep_start, rep_end = layout.split(rep_total, self.rank, self.world)
        rep_len = rep_end - rep_start
        snapshot.header = ShardHeader(
            job=self.job_id, step=snapshot.step, rank=self.rank, world=self.world, rep_total=rep_total,
            rep_start=rep_start, rep_end=rep_end, private_len=priv_len, meta_len=len(meta),
            layout=hashlib.sha256(rep_json).hexdigest(), generation=self.generation, pieces_len=pieces_len,
            base=self.base)
        with self._cond:
            snapshot.buffer = self._buffer(snapshot.buffer_index, snapshot.header.nbytes)
        snapshot.buffer.write(rep_len + priv_len, meta)

        copies = []
        for leaf, offset in zip(snapshot.rep_leaves, rep_offsets):
            first, end = max(offset, rep_start), min(offset + statetree.nbytes_of(leaf), rep_end)
            # Pieces, so that the agent can start streaming before a big tensor is copied whole.
            for piece in range(first, end, PIECE):
                copies.append((leaf, piece - offset, min(piece + PIECE, end) - offset, piece - rep_start))
        for leaf, offset in zip([*snapshot.priv_leaves, *snapshot.piece_leaves], [*priv_offsets, *piece_offsets]):
            copies.append((leaf, 0, statetree.nbytes_of(leaf), rep_len + offset))
        return copies

    def _stage(self, snapshot: Snapshot) -> None:
        """The stager: lay out, hand the segment to the agent, copy; the agent streams what is done."""
        try:
            copies = self.layout(snapshot)
        except BaseException as e:
            self.unreserve(snapshot.buffer_index)
            snapshot.copied.set()
            snapshot.handed.set()
            log.error("dashrun: the checkpoint of step %d cannot be staged: %s", snapshot.step, e)
            return
        # The rank checksums as it copies (on CPU, with dashrun's C helper); otherwise the agent does.
        checksum = staging.streaming and snapshot.gpu_done is None
        request = SnapshotRequest(snapshot.header, ready=0, emergency=snapshot.emergency, checksum=checksum,
                                  skipped=self.stats.skipped, stall_s=round(self.stats.stall_s, 6),
                                  restored=snapshot.restored)
        lent, locked = lend(snapshot.buffer.fd)
        try:
            snapshot.result = self.link.request(Kind.SNAPSHOT, request.to_body(),
                                                fds=[snapshot.buffer.fd if lent is None else lent])
        finally:
            if lent is not None:
                os.close(lent)
        snapshot.handed.set()
        crash_point("rank.handoff", rank=self.rank, step=snapshot.step)
        snapshot.result.add_done_callback(lambda f: self._release(snapshot, f, locked))
        request_id = snapshot.result.request_id
        try:
            if snapshot.gpu_done is not None:
                self._copy_cuda(snapshot, copies)
                snapshot.gpu_done.synchronize()  # bytes in host memory before the agent reads them
                crc = None
            else:
                crc = self._copy_cpu(snapshot, copies, request_id, checksum)
        except BaseException as e:
            snapshot.copied.set()
            self.link.notify(Kind.PROGRESS, Progress(request_id, failed=True).to_body())
            log.error("dashrun: staging the checkpoint of step %d failed: %s", snapshot.step, e)
            return
        snapshot.copied.set()
        self.link.notify(Kind.PROGRESS, Progress(request_id, ready=snapshot.header.nbytes, crc=crc).to_body())

    def _copy_cpu(self, snapshot: Snapshot, copies: list[Copy], request_id: int, checksum: bool) -> int | None:
        """Copy in shard order, telling the agent how far it is; the shard's CRC-32C if ``checksum``.

        The CRC also covers the alignment gaps between the copies and the
        description at the end, read back from the buffer.
        """
        stage = snapshot.buffer.tensor
        crc = 0 if checksum else None
        reported = done = 0
        for index, (leaf, first, end, offset) in enumerate(copies):
            if index == len(copies) // 2:
                crash_point("rank.staging", rank=self.rank, step=snapshot.step)
            if crc is not None:
                if offset < done:
                    raise RuntimeError("the shard's copies are out of order")
                crc = staging.crc_of(stage[done:offset], crc)
            crc = staging.copy_into(stage[offset:offset + end - first], statetree.byte_view(leaf)[first:end], crc)
            done = offset + end - first
            if done - reported >= PROGRESS_EVERY and index + 1 < len(copies):
                self.link.notify(Kind.PROGRESS, Progress(request_id, ready=done).to_body())
                reported = done
        if crc is not None:
            crc = staging.crc_of(stage[done:snapshot.header.nbytes], crc)
        return crc

    def _copy_cuda(self, snapshot: Snapshot, copies: list[Copy]) -> None:
        """Enqueue the copies on a side stream that starts once the state's optimizer step is done."""
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream()
        stream = self.side_stream
        stage = snapshot.buffer.tensor
        with torch.cuda.stream(stream):
            stream.wait_event(snapshot.gpu_ready)
            for leaf, first, end, offset in copies:
                stage[offset:offset + end - first].copy_(statetree.byte_view(leaf)[first:end], non_blocking=True)
            snapshot.gpu_done.record(stream)
        snapshot.copied.set()  # enqueued: the compute stream waits for gpu_done on the GPU

    # --- shutting down --------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the snapshot being staged and stop the thread."""
        self._thread.shutdown(wait=True)

    def close(self) -> None:
        """Free both buffers (after :meth:`stop`; the agent keeps its own descriptor of one it still sends)."""
        for buffer in [*self._buffers, *self._set_aside]:
            if buffer is not None:
                buffer.close()
        self._buffers = [None, None]
        self._set_aside.clear()
        self._unanswered.clear()
