"""Reads from the bucket: one download of a shard, verified once, shared by every read of it.

A restore reads a shard in byte ranges (32 MiB pieces over several streams;
a sharded restore, up to thousands of ranges): when the bucket is the only
copy, each range would otherwise download the whole shard again and reserve
a whole shard of RAM for it, so that the third stream at once finds no room.
Here the first read of a shard downloads it into one RAM buffer and checks it
against its CRC-32C; the reads that come meanwhile wait for that download and
share it, and so do the reads that come while it lingers after the last one
(:data:`LINGER`, or until a receive needs the RAM: :meth:`Downloads.evict_idle`
is the retention's first thing to free). A download that fails is not
shared: the next read tries again. A shard that fails its checksum takes its
checkpoint out of the object tier (out of the catalogue if no other tier holds
it), so that the next lookup serves the checkpoint before it.

Everything here is kept under the ledger's lock; bytes move outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import threading
import time
from typing import TYPE_CHECKING, Iterator

from dashrun.errors import ChecksumError
from dashrun.memd.store.entry import Entry
from dashrun.memd.store.ledger import Ledger
from dashrun.memd.store.retention import Retention

if TYPE_CHECKING:  # boto3 is imported only when dash-memd has an object tier
    from dashrun.memd.store.tiers.object import ObjectTier

__all__ = ["LINGER", "Downloads"]

log = logging.getLogger(__name__)

#: Seconds a downloaded shard stays in RAM after its last read, for the restore's next range of it.
LINGER = 30.0


@dataclasses.dataclass(eq=False)
class _Download:
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    buffer: mmap.mmap | None = None  # set once downloaded and verified
    failed: bool = False
    readers: int = 0
    idle_since: float = 0.0


class Downloads:
    """The shards downloaded from the bucket for reads, keyed by checkpoint attempt and rank."""

    def __init__(self, ledger: Ledger, retention: Retention, objects: ObjectTier):
        self.ledger = ledger
        self.retention = retention
        self.objects = objects
        self.linger = LINGER
        self._held: dict[tuple[str, int, float, int], _Download] = {}
        self.fetched = 0  # shards downloaded, for the tests and the log

    @contextlib.contextmanager
    def open(self, entry: Entry, rank: int) -> Iterator[memoryview]:
        """Rank ``rank``'s shard of ``entry`` from the bucket, verified, while the context lasts (the caller
        pins ``entry``). Raises what the download raised: ChecksumError, NotFoundError, UnavailableError."""
        key = (entry.job, entry.step, entry.info.committed_at, rank)
        nbytes = entry.shards[rank].nbytes
        with self.ledger.cond:
            self.expire()
            held = self._held.get(key)
            leader = held is None
            if leader:
                held = self._held[key] = _Download()
            held.readers += 1
        try:
            if leader:
                self._fetch(entry, rank, held)
            else:
                held.done.wait()
                if held.failed:  # the one this read waited for failed: this read tries by itself
                    with self.ledger.cond:
                        held.readers -= 1
                    held = None
                    with self.open(entry, rank) as view:
                        yield view
                    return
            with memoryview(held.buffer) as view:
                yield view[:nbytes]
        finally:
            if held is not None:
                with self.ledger.cond:
                    held.readers -= 1
                    held.idle_since = time.monotonic()
                    if held.failed and held.readers == 0 and self._held.get(key) is held:
                        del self._held[key]

    def _fetch(self, entry: Entry, rank: int, held: _Download) -> None:
        """Download into a buffer of its own (waiting for room as a receive does), verified; sets ``held``."""
        try:
            with self.ledger.cond:
                buffer = self.retention.reserve(entry.shards[rank].nbytes, entry)
            try:
                with memoryview(buffer) as view:
                    self.objects.read_into(entry.job, entry.step, rank, view, shard=entry.shards[rank])
            except BaseException:
                self.ledger.ram.release(buffer)
                raise
        except ChecksumError as e:
            self._failed(held)
            with self.ledger.cond:
                if not entry.dropped and "object" in entry.tiers:
                    log.error("%s step %d: %s; %s", entry.job, entry.step, e, self.ledger.lose_copy(entry, "object"))
            raise
        except BaseException:
            self._failed(held)
            raise
        with self.ledger.cond:
            held.buffer = buffer
            self.fetched += 1
        held.done.set()

    def _failed(self, held: _Download) -> None:
        with self.ledger.cond:
            held.failed = True
            for key in [k for k, d in self._held.items() if d is held]:
                del self._held[key]  # the next read downloads again
        held.done.set()

    def expire(self, now: float | None = None) -> None:
        """With the ledger's lock held: give back the downloads no read has used for :attr:`linger` seconds."""
        now = time.monotonic() if now is None else now
        for key, held in list(self._held.items()):
            if held.buffer is not None and held.readers == 0 and now - held.idle_since >= self.linger:
                self._release(key)

    def evict_idle(self) -> bool:
        """With the ledger's lock held: give back the download idle the longest; False if none is idle."""
        idle = [(held.idle_since, key) for key, held in self._held.items()
                if held.buffer is not None and held.readers == 0]
        if not idle:
            return False
        self._release(min(idle)[1])
        return True

    def held(self) -> int:
        """Downloads held in RAM now (being read, or lingering)."""
        with self.ledger.cond:
            return sum(1 for held in self._held.values() if held.buffer is not None)

    def _release(self, key) -> None:
        held = self._held.pop(key)
        self.ledger.ram.release(held.buffer)
        held.buffer = None
