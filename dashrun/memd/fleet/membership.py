"""Each elastic job's world generation (the fence against cut-off nodes) and its membership history.

A job's world generation only rises (:meth:`Membership.raise_generation`);
the launcher raises it each time the job forms a new world. A shard of a
generation older than the job's is refused (:meth:`Membership.check_shard`,
called by the catalogue as a shard is announced and again as its checkpoint
commits): a node cut off from the others that still reaches dash-memd
cannot commit into the new world. Generation 0 means "not fenced" (dashrun
before elastic jobs, and jobs that are not elastic), always accepted.

The history keeps the newest :data:`MAX_EVENTS` membership events of each job
(``dashrun status JOB`` lists them, and reads the job's state from them): the
elastic agent's joins, notices and deaths, and each launch's start and end
(``finished``/``failed``) as the launcher records them. Both are kept in
``<data dir>/membership/<job>.json``, replaced atomically and fsynced at
every change (changes are rare: one per world change or launch), so a restarted
dash-memd has them; ``dashrun rm`` removes them with the job's launch spec and
notices.

Beside the events, the record holds the job's run history
(:class:`~dashrun.wire.history.RunHistory`: its snapshots' steps, the steps
redone, the restores, each node's failure domain), which ``dashrun report``
reads. It changes with every checkpoint, so it is written at most every
:data:`HISTORY_SAVE_PERIOD` seconds, with any event, and at stop
(:meth:`Membership.flush`): a dash-memd killed outright loses at most that
last second of it.

With an object tier, a copy of each record goes to the bucket beside the
job's launch spec (:meth:`dashrun.memd.store.uploader.Uploader.keep_records`):
at every event, and for the run history alone at most every
:data:`MIRROR_PERIOD` seconds. A dash-memd that lost its data dir takes the
job's record back from there when it lists the bucket (:meth:`Membership.adopt`),
so ``dashrun report`` still covers the whole job; what a job recorded in the
meantime (it reconnected before the listing) is added after it.

Files are written outside the lock that guards the records (one write at a
time, each of the records as they are then), so a check of a shard, which the
catalogue makes under its own lock, never waits for a disk.

A generation is raised in RAM only once the file with it is written: a save
that fails (a full disk) fails the request and leaves the generation as it
was, so the fence dash-memd applies is always the one a restart reads back
and the one the launcher was told. An event whose save fails stays in the
history in RAM and is written with the job's next change.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from dashrun.errors import ConflictError, NoSpaceError, ProtocolError
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.files import write_atomic
from dashrun.wire.domain import FailureDomain
from dashrun.wire.history import Restored, RunHistory
from dashrun.wire.messages import MembershipEvent, ShardHeader
from dashrun.wire.protocol import MAX_STEP, field_int, valid_job_id

__all__ = ["HISTORY_SAVE_PERIOD", "MAX_EVENTS", "MAX_MEMBERSHIP_JOBS", "MEMBERSHIP", "MIRROR_PERIOD", "Membership"]

log = logging.getLogger(__name__)

#: Directory in the data dir with one file per job.
MEMBERSHIP = "membership"
#: Membership events kept per job (the newest).
MAX_EVENTS = 1000
#: Jobs with a generation or a membership history at once.
MAX_MEMBERSHIP_JOBS = 1024
#: Seconds between writes of a job's record for its run history alone.
HISTORY_SAVE_PERIOD = 1.0
#: Seconds between copies of a job's record to the bucket for its run history alone (an event goes at once).
MIRROR_PERIOD = 30.0
#: Largest file read back (1000 events of the longest fields, JSON-escaped, stay below it).
_MAX_FILE = 16 << 20


class _Job:
    def __init__(self) -> None:
        self.generation = 0
        self.events: collections.deque[MembershipEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.history = RunHistory()
        self.saved_at = 0.0  # monotonic
        self.dirty = False   # the history changed since the record was written
        self.loaded = False  # read from the data dir (or taken from the bucket): nothing older to take
        self.mirrored_at = 0.0   # monotonic: when its copy to the bucket was last asked for
        self.unmirrored = False  # the history changed since


class Membership:
    """The generations and membership histories of every job; every method is safe to call from any thread."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.Lock()        # guards _jobs and _sent
        self._write_lock = threading.Lock()  # one file write at a time
        self._jobs: dict[str, _Job] = {}
        #: job -> the newest world generation a shard of it was announced with (in RAM alone, see check_shard)
        self._sent: dict[str, int] = {}
        #: Called, outside every lock here, with a job whose record changed, for its copy in the bucket
        #: (:meth:`~dashrun.memd.store.uploader.Uploader.keep_records` sets it).
        self.mirror: Callable[[str], None] = lambda job: None

    def load(self) -> None:
        """Read what an earlier dash-memd left; a file that cannot be read is skipped with a warning."""
        if not self.root.is_dir():  # made at the first change
            return
        for leftover in self.root.glob(".*.tmp"):  # a replacement a stop interrupted
            leftover.unlink(missing_ok=True)
        with self._lock:
            for path in sorted(self.root.glob("*.json")):
                if not valid_job_id(path.stem) or len(self._jobs) >= MAX_MEMBERSHIP_JOBS:
                    continue
                try:
                    if path.stat().st_size > _MAX_FILE:
                        raise ValueError("too large")
                    record = _parse(loads_bounded(path.read_bytes()), str(path))
                except (OSError, ValueError, ProtocolError) as e:
                    log.warning("membership: ignored %s: %s", path, e)
                    continue
                self._jobs[path.stem] = record

    def adopt(self, job: str, raw: Any) -> bool:
        """Take ``job``'s record from the bucket (``raw``, a :meth:`body`) unless the data dir had one (always
        the newer): a dash-memd that lost its data dir. What this dash-memd recorded of the job before
        (it reconnected first) is added after it, and the generation is the higher. Whether it was taken;
        ValueError or ProtocolError if ``raw`` is no record."""
        found = _parse(raw, f"the object store's record of {job}")
        with self._write_lock:
            with self._lock:
                local = self._jobs.get(job)
                if local is not None and local.loaded:
                    return False
                if local is None and len(self._jobs) >= MAX_MEMBERSHIP_JOBS:
                    log.warning("membership: %s's record in the object store not taken: %d jobs have one here",
                                job, MAX_MEMBERSHIP_JOBS)
                    return False
                if local is not None:
                    found.generation = max(found.generation, local.generation)
                    found.events.extend(local.events)
                    found.history.extend(local.history)
                found.saved_at = time.monotonic()
                self._jobs[job] = found
                body = _body(found.generation, found)
            try:
                self._write(job, body)
            except OSError as e:  # RAM has it; written with the job's next change
                found.dirty = True
                log.warning("%s: membership record taken from the object store not written: %s", job, e)
        return True

    def jobs(self) -> list[str]:
        """The jobs with a record."""
        with self._lock:
            return list(self._jobs)

    def body(self, job: str) -> dict | None:
        """``job``'s record as it is written (and copied to the bucket); None where it has none."""
        with self._lock:
            record = self._jobs.get(job)
            return None if record is None else _body(record.generation, record)

    def mirror_due(self) -> None:
        """Ask for the bucket's copy of every record whose run history changed :data:`MIRROR_PERIOD` seconds or
        more after its last copy (called every half second by dash-memd's uploader thread)."""
        now = time.monotonic()
        with self._lock:
            due = [job for job, record in self._jobs.items()
                   if record.unmirrored and now - record.mirrored_at >= MIRROR_PERIOD]
        for job in due:
            self._mirror(job)

    # --- the generation fence -----------------------------------------------------------

    def generation(self, job: str) -> int:
        with self._lock:
            record = self._jobs.get(job)
            return record.generation if record else 0

    def raise_generation(self, job: str, generation: int) -> int:
        """Raise ``job``'s generation to ``generation`` if that is higher; returns the job's generation, which
        is on disk before this returns. OSError if it cannot be written, and the generation is unchanged."""
        # The write lock from the look to the change: no other save can come between them, so the record
        # written is the one RAM then holds (an event recorded meanwhile waits to be written after it).
        with self._write_lock:
            with self._lock:
                record = self._jobs.get(job)
                current = record.generation if record else 0
                if generation <= current:
                    return current
                record = record or self._add(job)  # generation 0, no events: reads as no record
                body = _body(generation, record)
            try:
                self._write(job, body)
            except OSError:
                with self._lock:
                    if not record.events and record.generation == 0 and self._jobs.get(job) is record:
                        del self._jobs[job]  # added for this raise only
                raise
            with self._lock:
                record.generation = generation
        log.info("%s: world generation %d", job, generation)
        self._mirror(job)
        return generation

    def check_shard(self, header: ShardHeader) -> None:
        """ConflictError if ``header`` is of a world generation older than its job's: the one the launcher set,
        or a newer one a shard was announced with. A world that sends shards was formed by the rendezvous, so
        its shards raise the fence by themselves: the fence never rests on the launcher's call alone, which a
        failing disk or link may have refused (kept in RAM only: after a restart the launcher's call and the
        shards of the world that lives raise it again)."""
        if header.generation == 0:
            return
        with self._lock:
            record = self._jobs.get(header.job)
            current = max(record.generation if record else 0, self._sent.get(header.job, 0))
            if header.generation > current:
                self._sent[header.job] = header.generation
        if header.generation < current:
            raise ConflictError(f"shard of world generation {header.generation}, the job is at {current}: this "
                                "node was cut off from the job",
                                hint="its ranks restart in the job's new world, or this node leaves")

    # --- the history -----------------------------------------------------------------------

    def record(self, job: str, event: MembershipEvent) -> None:
        """Add ``event`` to ``job``'s history (the oldest beyond :data:`MAX_EVENTS` goes); on disk on return."""
        with self._lock:
            (self._jobs.get(job) or self._add(job)).events.append(event)
        log.info("%s: %s %s%s, world %d", job, event.node, event.change, f" ({event.why})" if event.why else "",
                 event.world)
        self._save(job)
        self._mirror(job)

    def history(self, job: str) -> list[MembershipEvent]:
        """``job``'s membership events, oldest first."""
        with self._lock:
            record = self._jobs.get(job)
            return list(record.events) if record else []

    def note_snapshot(self, header: ShardHeader, restored: Restored | None) -> None:
        """Count a snapshot a rank reported in the job's run history (:class:`RunHistory`); on disk within
        :data:`HISTORY_SAVE_PERIOD`. Only a job launched by dashrun keeps one (its launch recorded it joined):
        shards from other clients (dashrun.dcp.Writer, a script of the operator's) leave no record."""
        with self._lock:
            record = self._jobs.get(header.job)
            if record is None:
                return
            if not record.history.note_snapshot(header, restored, time.time()):
                return
            record.dirty = record.unmirrored = True  # the bucket's copy follows with mirror_due
            due = time.monotonic() - record.saved_at >= HISTORY_SAVE_PERIOD
        if due:  # not fsynced: a dash-memd that dies keeps it (the kernel has it), a machine that dies loses a second
            self._save(header.job, durable=False)

    def note_domain(self, job: str, node: str, domain: FailureDomain | None) -> None:
        """Keep the failure domain ``node`` of ``job`` announced (its instance type, zone, market) in the job's
        run history, where it has a membership record."""
        with self._lock:
            record = self._jobs.get(job)
            if record is None or not record.history.note_domain(node, domain):
                return
        self._save(job)
        self._mirror(job)

    def run_history(self, job: str) -> dict | None:
        """``job``'s run history as the MEMBERSHIP reply sends it; None where it has no record."""
        with self._lock:
            record = self._jobs.get(job)
            return record.history.to_body() if record else None

    def flush(self) -> None:
        """Write every record whose run history changed since it was written (at stop)."""
        with self._lock:
            dirty = [job for job, record in self._jobs.items() if record.dirty]
        for job in dirty:
            try:
                self._save(job)
            except OSError as e:
                log.warning("%s: run history not written: %s", job, e)

    def delete_job(self, job: str) -> None:
        """Forget ``job``'s generation and history (``dashrun rm``)."""
        with self._lock:
            self._jobs.pop(job, None)
            self._sent.pop(job, None)
        self._save(job)
        self.mirror(job)  # the bucket's copy goes too

    # --- plumbing ----------------------------------------------------------------------------

    def _add(self, job: str) -> _Job:
        if len(self._jobs) >= MAX_MEMBERSHIP_JOBS:
            raise NoSpaceError(f"dash-memd keeps membership records of {MAX_MEMBERSHIP_JOBS} jobs already",
                               hint="remove finished jobs with: dashrun rm JOB")
        record = self._jobs[job] = _Job()
        return record

    def _mirror(self, job: str) -> None:
        """Ask for ``job``'s copy in the bucket (which sends its record as it is then)."""
        with self._lock:
            record = self._jobs.get(job)
            if record is None:
                return
            record.mirrored_at, record.unmirrored = time.monotonic(), False
        self.mirror(job)

    def _save(self, job: str, durable: bool = True) -> None:
        """Write ``job``'s record as it is now (remove its file if it has none); OSError if that fails."""
        with self._write_lock:
            with self._lock:
                record = self._jobs.get(job)
                body = None if record is None else _body(record.generation, record)
                if record is not None:
                    record.saved_at, record.dirty = time.monotonic(), False
            try:
                self._write(job, body, durable)
            except OSError:
                if record is not None:
                    record.dirty = True
                raise

    def _write(self, job: str, body: dict | None, durable: bool = True) -> None:
        """Replace ``job``'s file with ``body``, or remove it (None); the write lock held."""
        path = self.root / f"{job}.json"
        if body is None:
            path.unlink(missing_ok=True)
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(body, separators=(",", ":")), durable=durable)


def _parse(raw: Any, where: str) -> _Job:
    """A record from its body (as :func:`_body` makes it); a run history that does not parse is dropped with a
    warning (the events and the fence stand without it)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("events"), list):
        raise ValueError("not a membership record")
    record = _Job()
    record.loaded = True
    record.generation = field_int(raw, "generation", 0, MAX_STEP)
    record.events.extend(MembershipEvent.from_body(e) for e in raw["events"][-MAX_EVENTS:])
    if raw.get("history") is not None:
        try:
            record.history = RunHistory.from_body(raw["history"])
        except ProtocolError as e:
            log.warning("membership: the run history in %s is ignored: %s", where, e)
    return record


def _body(generation: int, record: _Job) -> dict:
    return {"generation": generation, "events": [e.to_body() for e in record.events],
            "history": record.history.to_body()}
