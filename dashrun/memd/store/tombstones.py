"""Deletions kept on disk until every tier has caught up with them, so that nothing deleted comes back.

``dashrun rm`` (and ``--fresh``) and ``gc`` take checkpoints out of RAM and
off the disk at once, but out of the bucket through the uploader's queue; and
before dash-memd's first listing of the bucket it does not even know what the
bucket holds. A :class:`Tombstone` records such a deletion: the job, which
steps (all, or those below the oldest checkpoint kept) and when. It is
written to ``<data dir>/tombstones.json`` (replaced atomically, fsynced)
*before* anything is deleted: a deletion whose record cannot be written is
refused with nothing deleted, and one that is answered is durable. Until
every tier that holds checkpoints has purged what a tombstone covers, the
tombstone stays: the disk tier's scan at a start removes a covered step
directory that came back (a removal a crash undid, or one that failed), and
the bucket's listing adopts none of it while the uploader's purge runs again.
A copy committed after the deletion (a new run of the job) is not covered:
its ``committed_at`` is later (both times are dash-memd's clock; for copies
an earlier dash-memd on another machine left in the bucket, as far as the two
clocks agree).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path

from dashrun.errors import ProtocolError
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.files import write_atomic
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.protocol import field_float, field_job, field_step

__all__ = ["TOMBSTONES", "Tombstone", "Tombstones"]

log = logging.getLogger(__name__)

#: The file in the data dir that holds the tombstones, while there are any.
TOMBSTONES = "tombstones.json"


@dataclasses.dataclass(frozen=True, eq=False)
class Tombstone:
    """Every checkpoint of ``job`` (or those below step ``below``) committed at or before ``at`` is deleted;
    with ``below`` None, the job's spec too."""

    job: str
    below: int | None
    at: float

    def covers(self, info: CheckpointInfo) -> bool:
        return (info.job == self.job and (self.below is None or info.step < self.below)
                and info.committed_at <= self.at)

    def to_body(self) -> dict:
        return {"job": self.job, "below": self.below, "at": self.at}

    @classmethod
    def from_body(cls, body: dict) -> Tombstone:
        if not isinstance(body, dict):
            raise ProtocolError("a tombstone must be an object")
        below = None if body.get("below") is None else field_step(body, "below")
        return cls(field_job(body), below, field_float(body, "at", 0.0, 1e11))


class Tombstones:
    """The tombstones of one data dir; every method is safe to call from any thread.

    Each tier that purges what the tombstones cover says so once, as it is set up (:meth:`purged_by`); a
    tombstone goes once each of them has (:meth:`purged`). Which tiers are left is kept in RAM only: after a
    restart every purge runs again, and each removes only what the tombstone covers.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()        # guards the records and what is left of their purges
        self._write_lock = threading.Lock()  # one write of the file at a time, each of the records as they are then
        self._records: list[Tombstone] = self._load()
        self._tiers: set[str] = set()
        self._pending: dict[Tombstone, set[str]] = {t: set() for t in self._records}

    def _load(self) -> list[Tombstone]:
        try:
            raw = loads_bounded(self.path.read_bytes())
            if not isinstance(raw, list):
                raise ProtocolError("not a list")
            return [Tombstone.from_body(body) for body in raw]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, ProtocolError) as e:
            log.error("ignored %s (%s): checkpoints deleted before dash-memd stopped may be listed again from the "
                      "disk or the object store; delete them again with dashrun rm or gc", self.path, e)
            return []

    def purged_by(self, tier: str) -> None:
        """``tier`` holds checkpoints: every tombstone stays until ``tier`` has purged what it covers."""
        with self._lock:
            self._tiers.add(tier)
            for pending in self._pending.values():
                pending.add(tier)

    def records(self) -> list[Tombstone]:
        with self._lock:
            return list(self._records)

    def record(self, tombstone: Tombstone) -> None:
        """Remember a deletion, durably (written and fsynced) before this returns; OSError if the file cannot be
        written, and then nothing is recorded (also not in RAM)."""
        with self._write_lock:  # no other write of the file may carry this record before it is known to last
            with self._lock:
                body = [t.to_body() for t in [*self._records, tombstone]]
            self._write(body)
            with self._lock:
                self._records.append(tombstone)
                self._pending[tombstone] = set(self._tiers)

    def purged(self, tombstone: Tombstone, tier: str) -> None:
        """``tier`` holds nothing ``tombstone`` covers any more; once no tier does, the tombstone goes and the
        file is rewritten. A failure to rewrite it is logged only: the tombstone is then read again at the next
        start, and its purges run once more, removing only what it covers."""
        with self._lock:
            pending = self._pending.get(tombstone)
            if pending is None:
                return
            pending.discard(tier)
            if pending:
                return
            del self._pending[tombstone]
            self._records.remove(tombstone)
        try:
            self._save()
        except OSError as e:
            log.warning("cannot write %s (%s): deletions the tiers have caught up with are purged again at the next "
                        "start", self.path, e.strerror or e)

    def covering(self, info: CheckpointInfo) -> Tombstone | None:
        with self._lock:
            return next((t for t in self._records if t.covers(info)), None)

    def job_deleted(self, job: str) -> bool:
        """True if ``job`` was deleted whole (``rm``) and not every tier may have caught up."""
        with self._lock:
            return any(t.job == job and t.below is None for t in self._records)

    def _save(self) -> None:
        """Make the records, as they are now, last (written and fsynced; the file goes once there are none).
        OSError if that fails."""
        with self._write_lock:
            with self._lock:
                body = [t.to_body() for t in self._records]
            self._write(body)

    def _write(self, body: list[dict]) -> None:
        if body:
            write_atomic(self.path, json.dumps(body, indent=1))
        else:  # if a crash undoes this, the purges run once more: they delete only what they cover
            self.path.unlink(missing_ok=True)
