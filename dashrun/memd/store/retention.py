"""Retention and eviction: how many checkpoints each tier keeps per job, and which RAM may go.

Each tier keeps the newest ``keep_*`` committed checkpoints of a job. A RAM
copy goes only once nothing is lost with it: the checkpoint is on disk, or a
newer checkpoint of its job is. A checkpoint no tier holds any more leaves the
catalogue. When a receive needs room, the oldest RAM copy that may go is
evicted, after any checkpoint whose receive was abandoned and any idle
download from the bucket (:mod:`.downloads`). When none may go
yet (the RAM holds checkpoints the disk has not caught up with), the receive
waits for room, up to :data:`ROOM_WAIT`, behind the receives that waited
before it: ingest slows to the disk's pace instead of refusing shards, which
would leave their checkpoints incomplete, the nodes whose shards came at the
wrong moment behind the others.

Everything here is bookkeeping done with the ledger's lock held; what a trim
takes out of the disk or the object tier is returned, for the disk writer or
the uploader to delete.
"""

from __future__ import annotations

import logging
import mmap
import time
from typing import Callable

from dashrun.errors import NoSpaceError
from dashrun.memd.store.entry import Entry
from dashrun.memd.store.ledger import Ledger
from dashrun.util.units import format_size

__all__ = ["RECEIVING_TIMEOUT", "ROOM_WAIT", "Retention"]

log = logging.getLogger(__name__)

#: A RECEIVING checkpoint that has not progressed for this long is abandoned
#: (a rank died before sending); its buffers are freed.
RECEIVING_TIMEOUT = 600.0
#: Longest a receive waits for RAM to come free before it is refused; well under a client's timeout
#: (dash-agent's --memd-timeout), so a refusal reaches the client as one, not as a dropped connection.
ROOM_WAIT = 5.0
#: A waiting receive looks again this often even if nothing told it that RAM came free.
ROOM_POLL = 0.1


class Retention:
    """Trims and evictions over a :class:`Ledger`; every method runs with ``ledger.cond`` held."""

    def __init__(self, ledger: Ledger, *, keep_ram: int = 2, keep_disk: int = 3, keep_object: int = 20):
        self.ledger = ledger
        self.keep_ram = keep_ram
        self.keep_disk = keep_disk
        self.keep_object = keep_object
        #: seconds a receive may wait for RAM to come free (:meth:`reserve`)
        self.room_wait = ROOM_WAIT
        #: Frees one buffer held only to serve reads again (a download from the bucket); False if none is idle.
        self.spare: Callable[[], bool] = lambda: False

    def newest_safe_step(self, job: str) -> int | None:
        safe = [s for s, e in self.ledger.committed.get(job, {}).items() if "disk" in e.tiers]
        return max(safe, default=None)

    def safe_without_ram(self, entry: Entry) -> bool:
        """True if dropping the RAM copy loses nothing: on disk, or superseded by a newer checkpoint on disk."""
        newest_safe = self.newest_safe_step(entry.job)
        return "disk" in entry.tiers or (newest_safe is not None and newest_safe > entry.step)

    def _drop_ram_copy(self, entry: Entry) -> None:
        if "disk" in entry.tiers:
            self.ledger.release_ram(entry)
            log.info("%s step %d: evicted from RAM (kept on disk)", entry.job, entry.step)
        else:
            log.info("%s step %d: dropped (superseded by a newer checkpoint on disk)", entry.job, entry.step)
            self.ledger.forget(entry)

    def trim_ram(self, job: str) -> None:
        """Drop the RAM copies of ``job`` beyond the newest ``keep_ram`` that are not read and may go."""
        in_ram = sorted((e for e in self.ledger.committed.get(job, {}).values() if "ram" in e.tiers),
                        key=lambda e: e.step, reverse=True)
        for entry in in_ram[self.keep_ram:]:
            if entry.readers == 0 and self.safe_without_ram(entry):
                self._drop_ram_copy(entry)

    def evict_one(self, spare: Entry) -> bool:
        """Free one checkpoint's RAM that can go without loss; False if none can."""
        now = time.monotonic()
        stale = [e for e in self.ledger.receiving.values()
                 if e is not spare and not e.arriving and now - e.touched > RECEIVING_TIMEOUT]
        if stale:
            self.ledger.drop_receiving(stale[0])
            return True
        if self.spare():
            return True
        candidates = [e for steps in self.ledger.committed.values() for e in steps.values()
                      if "ram" in e.tiers and e.readers == 0 and self.safe_without_ram(e)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda e: e.info.committed_at)
        self._drop_ram_copy(victim)
        self.ledger.evictions += 1
        return True

    def reserve(self, nbytes: int, for_entry: Entry) -> mmap.mmap:
        """A RAM buffer of ``nbytes`` for ``for_entry``, evicting what may go, else waiting (``ledger.cond``
        released meanwhile) up to :attr:`room_wait` for room, after the receives that waited before.
        Raises NoSpaceError."""
        ledger, ram = self.ledger, self.ledger.ram
        waiters = ledger.room_waiters
        me = object()
        began = time.monotonic()
        deadline = began + self.room_wait
        try:
            while True:
                if not waiters or waiters[0] is me:  # nobody who waited longer is owed this room
                    buffer = ram.reserve(nbytes)
                    if buffer is not None:
                        return buffer
                    if self.evict_one(spare=for_entry):
                        continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoSpaceError(
                        f"dash-memd's RAM is full ({format_size(ram.used)} of {format_size(ram.limit)} hold "
                        f"checkpoints not yet safe on disk) and stayed full for {self.room_wait:g}s; this checkpoint "
                        "is refused, the previous one stays valid",
                        hint="raise --memory-limit, lower --keep-ram, or give dash-memd a faster disk")
                if me not in waiters:
                    waiters.append(me)
                    ledger.room_waits += 1
                ledger.cond.wait(min(left, ROOM_POLL))
        finally:
            if me in waiters:
                waiters.remove(me)
                ledger.room_wait_s += time.monotonic() - began
                ledger.cond.notify_all()  # the next in line may go

    def trim_disk(self, job: str) -> list[Entry]:
        """Take the disk copies of ``job`` beyond the newest ``keep_disk`` out of the catalogue; the caller
        deletes the returned entries' files."""
        on_disk = sorted((e for e in self.ledger.committed.get(job, {}).values() if "disk" in e.tiers),
                         key=lambda e: e.step, reverse=True)
        doomed = [e for e in on_disk[self.keep_disk:] if e.readers == 0]
        for entry in doomed:
            entry.tiers.discard("disk")
            if "object" not in entry.tiers:
                self.ledger.forget(entry)
            elif "ram" in entry.tiers:
                self.ledger.release_ram(entry)
        return doomed

    def trim_object(self, job: str) -> list[Entry]:
        """Take the object-store copies of ``job`` beyond the newest ``keep_object`` out of the catalogue; the
        caller deletes the returned entries from the bucket."""
        in_store = sorted((e for e in self.ledger.committed.get(job, {}).values() if "object" in e.tiers),
                          key=lambda e: e.step, reverse=True)
        doomed = [e for e in in_store[self.keep_object:] if e.readers == 0]
        for entry in doomed:
            entry.tiers.discard("object")
            if not entry.tiers:
                self.ledger.forget(entry)
        return doomed
