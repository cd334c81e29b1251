"""The RAM tier: committed shards in anonymous memory, within a byte limit, in reused buffers."""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import threading
from typing import Iterator, Sequence

from dashrun.errors import NoSpaceError, NotFoundError
from dashrun.memd.store.tiers.base import SourceChanged, Tier
from dashrun.util.files import populated
from dashrun.util.units import format_size
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.protocol import crc32c

__all__ = ["RamTier"]

log = logging.getLogger(__name__)


class RamTier(Tier):
    """Shards in anonymous memory, within a byte limit, with buffers reused.

    Freed buffers stay mapped in a pool keyed by size class: a job's shards
    have nearly the same size every save (a layout description grows by a
    digit now and then), and touching fresh pages costs far more than reusing
    touched ones. Sizes round up to a multiple of 1/32 of their power of two
    (so under 1/16 of a buffer is slack). The pool gives buffers of other
    classes back to the OS when the limit would otherwise be exceeded.
    """

    name = "ram"

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._in_use = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._held: dict[tuple[str, int], tuple[CheckpointInfo, list[mmap.mmap]]] = {}

    @property
    def used(self) -> int:
        return self._in_use

    @staticmethod
    def size_class(nbytes: int) -> int:
        granule = max(4096, 1 << max(0, nbytes.bit_length() - 5))
        return max(granule, -(-nbytes // granule) * granule)

    def reserve(self, nbytes: int) -> mmap.mmap | None:
        """A buffer of at least ``nbytes`` (its size class), or None if the limit does not allow it now."""
        size = self.size_class(nbytes)
        with self._lock:
            pooled = self._free.get(size)
            if pooled:
                buf = pooled.pop()
                self._free_bytes -= size
            else:
                if self._in_use + size > self.limit:
                    return None
                # Give pooled buffers of other sizes back until the new one fits.
                while self._in_use + self._free_bytes + size > self.limit and self._free_bytes:
                    other = next(s for s, bufs in self._free.items() if bufs)
                    self._free[other].pop().close()
                    self._free_bytes -= other
                buf = mmap.mmap(-1, size)
            self._in_use += size
            return buf

    def prewarm(self, sizes: Sequence[int]) -> int:
        """Put a touched buffer in the pool for each of ``sizes`` (shards expected next), as far as the limit
        allows; returns how many it made.

        A receive into fresh pages faults on every page while the socket waits, which can make it slower than
        the stream itself; pages touched here, ahead of the next checkpoint and outside any lock, cost that
        checkpoint nothing. Pooled buffers never stand in a receive's way: reserve() gives them back.
        """
        wanted = collections.Counter(self.size_class(nbytes) for nbytes in sizes)
        made = 0
        for size, count in wanted.items():
            while True:
                with self._lock:
                    if len(self._free.get(size, ())) >= count or self._in_use + self._free_bytes + size > self.limit:
                        break
                try:
                    buf = populated(size)
                except OSError as e:
                    log.warning("RAM tier: cannot prepare a %d-byte buffer ahead of need: %s", size, e)
                    return made
                with self._lock:
                    if self._in_use + self._free_bytes + size > self.limit:  # a receive took the room meanwhile
                        buf.close()
                        return made
                    self._free.setdefault(size, []).append(buf)
                    self._free_bytes += size
                made += 1
                log.info("RAM tier: a %s buffer touched ahead of the next checkpoint", format_size(size))
        return made

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._in_use -= len(buf)
            self._free.setdefault(len(buf), []).append(buf)
            self._free_bytes += len(buf)

    def adopt(self, info: CheckpointInfo, buffers: list[mmap.mmap]) -> None:
        """Take ownership of buffers already filled (and verified) by the receive path."""
        with self._lock:
            self._held[(info.job, info.step)] = (info, buffers)

    def detach(self, job: str, step: int, buffers) -> list[mmap.mmap]:
        """Stop holding ``buffers`` as (job, step) — only if they are what is held there — and return them.

        The caller releases them; identity matters because a newer attempt at
        the same step may already be held under the same key.
        """
        buffers = list(buffers)
        with self._lock:
            held = self._held.get((job, step))
            if held is not None and len(held[1]) == len(buffers) and all(a is b for a, b in zip(held[1], buffers)):
                del self._held[(job, step)]
        return buffers

    def holds(self, job: str, step: int) -> bool:
        return (job, step) in self._held

    def put(self, info: CheckpointInfo, shards: Sequence[memoryview]) -> None:
        buffers = []
        try:
            for shard, data in zip(info.shards, shards):
                buf = self.reserve(shard.nbytes)
                if buf is None:
                    raise NoSpaceError(f"RAM tier full ({self.limit} bytes)")
                buffers.append(buf)
                with memoryview(buf) as view:
                    view[:shard.nbytes] = data
                    if crc32c(view[:shard.nbytes]) != shard.crc:
                        raise SourceChanged(f"{info.job} step {info.step} rank {shard.rank}: bytes do not match "
                                            "their CRC")
        except BaseException:
            for buf in buffers:
                self.release(buf)
            raise
        self.adopt(info, buffers)

    @contextlib.contextmanager
    def open(self, job: str, step: int, rank: int) -> Iterator[memoryview]:
        held = self._held.get((job, step))
        if held is None or not 0 <= rank < len(held[1]):
            raise NotFoundError(f"{job} step {step} rank {rank} is not in RAM")
        info, buffers = held
        with memoryview(buffers[rank]) as view:
            yield view[:info.shards[rank].nbytes]

    def delete(self, job: str, step: int) -> None:
        with self._lock:
            held = self._held.pop((job, step), None)
        if held:
            for buf in held[1]:
                self.release(buf)

    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        return [info for info, _ in list(self._held.values())], []
