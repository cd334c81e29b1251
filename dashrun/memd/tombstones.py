"""Deletions the bucket has not caught up with yet, kept on disk until it has.

``dashrun rm`` (and ``--fresh``) and ``gc`` take checkpoints out of RAM and
off the disk at once, but out of the bucket through the uploader's queue; and
before dash-memd's first listing of the bucket it does not even know what the
bucket holds. A :class:`Tombstone` records such a deletion: the job, which
steps (all, or those below the oldest checkpoint kept) and when. Until the
uploader has purged the bucket of what it covers, the bucket's listing adopts
none of it; and as the record is on disk (``<data dir>/tombstones.json``,
replaced atomically), neither does the listing after a restart, and the purge
runs again then. A copy committed after the deletion (a new run of the job) is
not covered: its ``committed_at`` is later (both times are dash-memd's clock;
for copies an earlier dash-memd on another machine left in the bucket, as far
as the two clocks agree).
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
    """The tombstones of one data dir; every method is safe to call from any thread."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()        # guards the records
        self._write_lock = threading.Lock()  # one write of the file at a time, each of the records as they are then
        self._records: list[Tombstone] = self._load()

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
                      "object store; delete them again with dashrun rm or gc", self.path, e)
            return []

    def records(self) -> list[Tombstone]:
        with self._lock:
            return list(self._records)

    def add(self, tombstone: Tombstone) -> None:
        """Remember a deletion (in memory: :meth:`save` makes it last)."""
        with self._lock:
            self._records.append(tombstone)

    def remove(self, tombstone: Tombstone) -> None:
        """The bucket holds nothing ``tombstone`` covers any more; the file is updated at once."""
        with self._lock:
            if tombstone not in self._records:
                return
            self._records.remove(tombstone)
        self.save()

    def covering(self, info: CheckpointInfo) -> Tombstone | None:
        with self._lock:
            return next((t for t in self._records if t.covers(info)), None)

    def job_deleted(self, job: str) -> bool:
        """True if ``job`` was deleted whole (``rm``) and the bucket may not have caught up."""
        with self._lock:
            return any(t.job == job and t.below is None for t in self._records)

    def save(self) -> None:
        """Make the records, as they are now, last (written and fsynced; the file goes once there are none)."""
        with self._write_lock:
            with self._lock:
                body = [t.to_body() for t in self._records]
            try:
                if body:
                    write_atomic(self.path, json.dumps(body, indent=1))
                else:  # if a crash undoes this, the purges run once more: they delete only what they cover
                    self.path.unlink(missing_ok=True)
            except OSError as e:
                log.error("cannot write %s (%s): if dash-memd restarts before the object store has caught up with "
                          "the deletions, it may list deleted checkpoints again", self.path, e.strerror or e)
