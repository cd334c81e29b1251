"""The catalogue's shared bookkeeping: which checkpoints exist, under one condition variable.

The catalogue, its retention, its disk writer and its uploader all read and
change these records, always holding :attr:`Ledger.cond`; bytes move outside
it. A checkpoint being read is pinned (``Entry.readers``) and its RAM is never
released under the reader. Receives that found the RAM full wait for room in
the order they came (:attr:`Ledger.room_waiters`).
"""

from __future__ import annotations

import collections
import threading

from dashrun.memd.store.entry import Entry
from dashrun.memd.store.tiers import RamTier
from dashrun.wire.messages import JobSpec

__all__ = ["Ledger"]


class Ledger:
    """Checkpoints being received, committed checkpoints per job, and the jobs' launch specs.

    Every method runs with :attr:`cond` held by the caller.
    """

    def __init__(self, ram: RamTier):
        self.ram = ram
        #: Guards everything here and in the parts that share this ledger; notified on every change.
        self.cond = threading.Condition()
        self.receiving: dict[tuple[str, int], Entry] = {}
        self.committed: dict[str, dict[int, Entry]] = {}
        self.specs: dict[str, JobSpec] = {}
        #: Receives waiting for RAM to come free, oldest first: only the oldest may take what comes free, so
        #: that no node's shards wait while others' keep getting through (see Retention.reserve).
        self.room_waiters: collections.deque[object] = collections.deque()
        #: RAM copies found changed since they arrived, per job, since dash-memd started: its memory may be failing.
        self.bad_ram: dict[str, int] = {}
        #: How hard the memory limit presses, since dash-memd started: RAM copies freed to make room for a
        #: receive, receives that had to wait for room, and the seconds they waited.
        self.evictions = 0
        self.room_waits = 0
        self.room_wait_s = 0.0

    def drop_receiving(self, entry: Entry) -> None:
        """Abandon a checkpoint still being received and free what of it arrived."""
        self.receiving.pop((entry.job, entry.step), None)
        entry.dropped = True
        for buffer in entry.buffers.values():
            self.ram.release(buffer)
        entry.buffers.clear()
        entry.marks.clear()

    def forget(self, entry: Entry) -> None:
        """Remove a committed entry from the catalogue; its RAM goes back once no one reads it."""
        self.committed.get(entry.job, {}).pop(entry.step, None)
        entry.dropped = True
        self.release_unwanted_ram(entry)

    def lose_copy(self, entry: Entry, tier: str) -> str:
        """``entry``'s copy in ``tier`` failed its checksums: it leaves that tier, and the entry leaves the
        catalogue if no tier holds it any more. Returns what is served instead, for the log."""
        entry.tiers.discard(tier)
        if tier == "ram":
            self.bad_ram[entry.job] = self.bad_ram.get(entry.job, 0) + 1
        left = sorted(entry.tiers)
        if left:
            self.release_unwanted_ram(entry)
        else:
            self.forget(entry)  # which gives its RAM back too, once no one reads it
        self.cond.notify_all()
        return (f"it is read from {', '.join(left)} instead" if left
                else "dropped from the catalogue; the checkpoint before it is served instead")

    def release_unwanted_ram(self, entry: Entry) -> bool:
        """Give back the RAM of an entry no one reads any more, if it is dropped or its RAM copy was found
        bad; True if it did."""
        if entry.readers == 0 and entry.buffers and (entry.dropped or "ram" not in entry.tiers):
            self.release_ram(entry)
            return True
        return False

    def release_ram(self, entry: Entry) -> None:
        """Give an entry's RAM copy back to the RAM tier's pool."""
        entry.tiers.discard("ram")
        for buffer in self.ram.detach(entry.job, entry.step, [entry.buffers[r] for r in sorted(entry.buffers)]):
            self.ram.release(buffer)
        entry.buffers.clear()
        entry.marks.clear()
