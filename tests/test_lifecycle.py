"""dash-memd's catalogue under every interleaving of its lifecycle: a model-based test (hypothesis's stateful testing).

One :class:`~dashrun.memd.store.catalogue.Catalogue` is driven directly, on the test's thread: shards begun,
finished (in any order, duplicated, late) and aborted; commits; disk writes and object-store tasks run
one at a time; evictions; ``gc`` and ``rm`` — also from inside a disk write or an upload in progress, and
under a reader; a job's spec; the bucket's listing; and restarts (a new catalogue over the same data dir
and bucket; RAM, queues and shards in flight lost, as in a crash). A model of what was committed and
deleted is checked after every step:

* a committed checkpoint is never lost unless deleted: each job's newest checkpoint that should have
  survived is the catalogue's newest;
* a deleted checkpoint never comes back: every checkpoint the catalogue holds is an attempt the model
  holds (committed, not deleted since), and a deleted job's spec stays deleted;
* bytes served always match their checksum, and are the bytes that were committed;
* RAM accounting never drifts: the RAM tier's bytes in use are those of the live buffers (shards being
  received, checkpoints held in RAM), each counted once, none of them in the pool of free buffers;
* nothing the catalogue's threads would log as an error happened (the uploader logs and survives bugs).

The disk tier is the real one, in a temporary directory (on tmpfs where there is one: what is checked
here is order, not durability, and fsync is slow). The object tier is :class:`MemoryBucket`, an in-memory
implementation of the interface the catalogue uses that keeps :class:`ObjectTier`'s contract (a checkpoint
exists if and only if its manifest does; ``put`` withdraws the old manifest first and writes the new one
last; ``delete`` removes the manifest first; reads are verified against the CRC-32C). A run makes about
2,000 calls of that interface, each several S3 requests: against moto's server, where test_objecttier.py
tests the real tier, they would not fit in the minute this test may take.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dashrun.errors import ChecksumError, ConflictError, NotFoundError, UnavailableError
from dashrun.memd.fleet.membership import Membership
from dashrun.memd.store.catalogue import Catalogue, Ticket
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.memd.store.tiers.base import MANIFEST
from dashrun.wire.messages import CheckpointInfo, JobSpec, MembershipEvent, ShardHeader
from dashrun.wire.protocol import crc32c

WORLD = {"a": 2, "b": 1}                 # job -> ranks
LAYOUTS = ("0a" * 32, "0b" * 32)         # two ways to lay out a job's state: another layout is a new attempt
REP_TOTAL = (96, 200)                    # replicated bytes under each layout
RAM_LIMIT = 1 << 20                      # room for every buffer a run can hold (4 KiB each at least)
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None
JOBS = st.sampled_from(sorted(WORLD))
STEPS = st.integers(1, 5)
ACTIONS = st.sampled_from([None, ("rm", "a"), ("rm", "b"), ("gc", "a", 1), ("gc", "b", 1), ("gc", "a", 2)])

#: An attempt at a checkpoint: (run, layout). A run is a job's life between two ``rm``s; a shard's bytes
#: are a function of (job, run, step, rank, layout), so every copy of an attempt has the same bytes.
Attempt = tuple[int, int]


def header(job: str, step: int, rank: int, layout: int) -> ShardHeader:
    world, total = WORLD[job], REP_TOTAL[layout]
    cut = [total * r // world for r in range(world + 1)]
    return ShardHeader(job, step, rank, world, total, cut[rank], cut[rank + 1], 8, 8, LAYOUTS[layout])


def payload(job: str, run: int, step: int, rank: int, layout: int) -> bytes:
    return random.Random(f"{job}/{run}/{step}/{rank}/{layout}").randbytes(header(job, step, rank, layout).nbytes)


class MemoryBucket:
    """The object tier's interface in memory, with ObjectTier's contract (see the module docstring).

    ``during_put``, if set, runs once inside the next ``put``: after the shards, before the manifest.
    """

    url = "memory://bucket"

    def __init__(self):
        self.steps_held: dict[tuple[str, int], dict[str, bytes]] = {}  # (job, step) -> object name -> bytes
        self.spec_objects: dict[str, bytes] = {}
        self.record_objects: dict[str, bytes] = {}
        self.during_put: Callable[[], None] | None = None

    def abort_incomplete_uploads(self) -> list[str]:
        return []

    def put(self, info: CheckpointInfo, shards) -> None:
        views = [memoryview(data).cast("B")[:shard.nbytes] for shard, data in zip(info.shards, shards, strict=True)]
        for shard, view in zip(info.shards, views):
            if len(view) != shard.nbytes or crc32c(view) != shard.crc:
                raise ChecksumError(f"{info.job} step {info.step} rank {shard.rank}: bytes do not match their CRC")
        held = self.steps_held.setdefault((info.job, info.step), {})
        held.pop(MANIFEST, None)  # the old attempt is gone from this tier once put begins
        for shard, view in zip(info.shards, views):
            held[f"rank-{shard.rank:05d}.bin"] = bytes(view)
        hook, self.during_put = self.during_put, None
        if hook is not None:
            hook()
        self.steps_held.setdefault((info.job, info.step), held)[MANIFEST] = json.dumps(info.to_body()).encode()

    def delete(self, job: str, step: int) -> None:
        self.steps_held.pop((job, step), None)

    def steps(self, job: str) -> list[int]:
        return sorted(step for (j, step) in self.steps_held if j == job)

    def read_manifest(self, job: str, step: int, *, signed: bool = True) -> CheckpointInfo:  # as ObjectTier's
        raw = self.steps_held.get((job, step), {}).get(MANIFEST)
        if raw is None:
            raise NotFoundError(f"{job} step {step} is not in the object store")
        return CheckpointInfo.from_body(json.loads(raw))

    def scan_report(self) -> tuple[list[CheckpointInfo], list[str]]:
        found = []
        for (job, step), held in sorted(self.steps_held.items()):
            if MANIFEST in held:
                info = self.read_manifest(job, step)
                if all(len(held.get(f"rank-{s.rank:05d}.bin", b"")) == s.nbytes for s in info.shards):
                    found.append(info)
        return found, []

    def read_into(self, job: str, step: int, rank: int, view: memoryview, shard: ShardHeader | None = None):
        shard = shard or self.read_manifest(job, step).shards[rank]
        data = self.steps_held.get((job, step), {}).get(f"rank-{rank:05d}.bin")
        if data is None:
            raise NotFoundError(f"{job} step {step} rank {rank} is not in the object store")
        if len(data) != shard.nbytes or crc32c(data) != shard.crc:
            raise ChecksumError(f"{job} step {step} rank {rank} fails its checksum")
        memoryview(view).cast("B")[:shard.nbytes] = data
        return shard

    def put_spec(self, spec: JobSpec, job: str) -> None:
        self.spec_objects[job] = json.dumps(spec.to_body()).encode()

    def delete_spec(self, job: str) -> None:
        self.spec_objects.pop(job, None)

    def jobs(self) -> list[str]:
        return sorted({job for job, _ in self.steps_held} | set(self.spec_objects) | set(self.record_objects))

    def specs(self, jobs=None) -> dict[str, JobSpec]:
        return {job: JobSpec.from_body(json.loads(raw)) for job, raw in self.spec_objects.items()
                if jobs is None or job in jobs}

    def put_record(self, job: str, record: dict) -> None:
        self.record_objects[job] = json.dumps(record).encode()

    def get_record(self, job: str) -> dict | None:
        raw = self.record_objects.get(job)
        return None if raw is None else json.loads(raw)

    def delete_record(self, job: str) -> None:
        self.record_objects.pop(job, None)

    def close(self) -> None:
        pass


class HookedDisk(DiskTier):
    """The real disk tier; ``during_put``, if set, runs once as the next write begins."""

    during_put: Callable[[], None] | None = None

    def put(self, info, shards, **kwargs):
        hook, self.during_put = self.during_put, None
        if hook is not None:
            hook()
        return super().put(info, shards, **kwargs)


class Errors(logging.Handler):
    """What dash-memd's catalogue logged at ERROR or above."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage() + (f"\n{record.exc_text or ''}" if record.exc_info else ""))


@dataclasses.dataclass
class Open:
    """A shard begun and not finished or aborted yet."""

    ticket: Ticket
    run: int
    layout: int
    crc: int
    replaced: bool = False  # a newer copy of the same shard was begun for the same checkpoint since


class Lifecycle(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="dash-lifecycle-", dir=SCRATCH))
        self.bucket = MemoryBucket()
        self.errors = Errors()
        logging.getLogger("dashrun.memd").addHandler(self.errors)
        self.cat = self.start()
        self.open: list[Open] = []
        self.run = {job: 0 for job in WORLD}
        #: job -> step -> the attempts the catalogue may serve there (committed and not deleted since)
        self.alive: dict[str, dict[int, set[Attempt]]] = {job: {} for job in WORLD}
        #: job -> steps that reached the disk or the bucket (a restart keeps the newest of them)
        self.durable: dict[str, set[int]] = {job: set() for job in WORLD}
        #: job -> steps committed since the last restart (until one, the newest of them stays too)
        self.fresh: dict[str, set[int]] = {job: set() for job in WORLD}
        self.spec = {job: False for job in WORLD}
        self.events = {job: 0 for job in WORLD}  # membership events recorded since the job's last rm

    def start(self) -> Catalogue:
        self.disk = HookedDisk(self.dir)
        cat = Catalogue(RamTier(RAM_LIMIT), self.disk, keep_ram=1, keep_disk=2, objects=self.bucket, keep_object=3)
        cat.load_disk()
        self.members = Membership(self.dir / "membership")  # as dash-memd wires them
        self.members.load()
        cat.uploader.keep_records(self.members)
        return cat

    def teardown(self):
        self.cat.close()
        logging.getLogger("dashrun.memd").removeHandler(self.errors)
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- receiving ------------------------------------------------------------------------------

    def begin(self, job: str, step: int, rank: int, layout: int) -> Open | None:
        """Begin a shard and receive its bytes; None if dash-memd refused it as a duplicate."""
        try:
            ticket = self.cat.receiver.begin_shard(header(job, step, rank, layout))
        except ConflictError:  # only a duplicate of a committed step may be refused; one in flight replaces
            held = self.cat.ledger.committed.get(job, {}).get(step)
            assert held is not None and held.layout == LAYOUTS[layout], f"{job} step {step} rank {rank} refused"
            return None
        for earlier in self.open:
            if earlier.ticket.entry is ticket.entry and earlier.ticket.header.rank == rank:
                earlier.replaced = True
        data = payload(job, self.run[job], step, rank, layout)
        ticket.buffer[:len(data)] = data
        shard = Open(ticket, self.run[job], layout, crc32c(data))
        self.open.append(shard)
        return shard

    def finish(self, shard: Open) -> None:
        self.open.remove(shard)
        if shard.replaced:  # the newer copy is the one taken; this one's bytes are not, whenever they complete
            with pytest.raises(ConflictError, match="newer copy"):
                self.cat.receiver.finish_shard(shard.ticket, shard.crc)
            return
        if self.cat.receiver.finish_shard(shard.ticket, shard.crc):
            job, step = shard.ticket.header.job, shard.ticket.header.step
            self.alive[job].setdefault(step, set()).add((shard.run, shard.layout))
            self.fresh[job].add(step)

    @rule(job=JOBS, step=STEPS, rank=st.integers(0, 1), layout=st.sampled_from([0, 0, 1]))
    def begin_shard(self, job, step, rank, layout):
        self.begin(job, step, rank % WORLD[job], layout)

    @rule(job=JOBS, step=STEPS, layout=st.sampled_from([0, 0, 1]))
    def deliver(self, job, step, layout):
        """Every rank's shard of a step, one after the other."""
        for rank in range(WORLD[job]):
            shard = self.begin(job, step, rank, layout)
            if shard is None:
                return
            self.finish(shard)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def finish_shard(self, data):
        self.finish(data.draw(st.sampled_from(self.open), label="shard"))

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def abort_shard(self, data):
        shard = data.draw(st.sampled_from(self.open), label="shard")
        self.open.remove(shard)
        self.cat.receiver.abort_shard(shard.ticket)

    @precondition(lambda self: self.open or any(self.alive.values()))
    @rule(data=st.data())
    def duplicate(self, data):
        """The same shard again: an agent's retry, a zombie node — while the first is in flight, or after."""
        sent = [(s.ticket.header.job, s.ticket.header.step, s.ticket.header.rank, s.layout) for s in self.open]
        sent += [(job, step, rank, layout) for job, steps in self.alive.items() for step, attempts in steps.items()
                 for run, layout in attempts if run == self.run[job] for rank in range(WORLD[job])]
        if sent:
            self.begin(*data.draw(st.sampled_from(sent), label="shard"))

    @rule(job=JOBS, step=STEPS, layout=st.sampled_from([0, 0, 1]))
    def retry_while_the_first_copy_arrives(self, job, step, layout):
        """Rank 0's shard, and a retry of it while it is still being received (its link died, say): the retry
        replaces the first copy, and the step commits with it once every rank's shard is in."""
        copies = [s for s in (self.begin(job, step, 0, layout), self.begin(job, step, 0, layout)) if s is not None]
        if copies:
            self.finish(copies[0])
        for rank in range(1, WORLD[job]):
            shard = self.begin(job, step, rank, layout)
            if shard is not None:
                self.finish(shard)
        for shard in copies[1:]:
            self.finish(shard)

    # --- the disk writer, the uploader, retention -----------------------------------------------

    def action(self, action) -> Callable[[], None] | None:
        if action is None:
            return None
        return lambda: self.delete(action[1], action[2] if action[0] == "gc" else 0)

    @rule(during=ACTIONS)
    def persist(self, during):
        """The disk writer's next write; ``during`` runs while it writes."""
        self.disk.during_put = self.action(during)
        self.cat.disk_writer.persist_next(timeout=0)
        self.disk.during_put = None

    @rule(during=ACTIONS)
    def object_task(self, during):
        """The uploader's next task (the listing first); ``during`` runs while an upload is in progress."""
        self.bucket.during_put = self.action(during)
        self.cat.uploader.next(timeout=0)
        self.bucket.during_put = None

    @rule()
    def evict(self):
        with self.cat.ledger.cond:
            self.cat.retention.evict_one(spare=None)

    # --- commands -----------------------------------------------------------------------------------

    def delete(self, job: str, keep: int) -> None:
        before = sorted(self.cat.ledger.committed.get(job, {}))
        deleted = self.cat.delete(job, keep)
        assert deleted == before[:max(0, len(before) - keep)]
        if keep == 0:
            self.members.delete_job(job)  # the fleet's records go with the job, as dash-memd's `rm` does
            self.events[job] = 0
            self.alive[job].clear()
            self.durable[job].clear()
            self.fresh[job].clear()
            self.spec[job] = False
            self.run[job] += 1  # what the job commits from now on is another run's
        elif len(before) >= keep:  # gc: everything older than the oldest checkpoint kept goes
            oldest_kept = before[-keep]
            self.alive[job] = {s: a for s, a in self.alive[job].items() if s >= oldest_kept}
            self.durable[job] = {s for s in self.durable[job] if s >= oldest_kept}
            self.fresh[job] = {s for s in self.fresh[job] if s >= oldest_kept}

    @rule(job=JOBS, keep=st.sampled_from([0, 0, 1, 2]))
    def rm_or_gc(self, job, keep):
        self.delete(job, keep)

    @rule(job=JOBS, keep=st.sampled_from([0, 1]))
    def delete_under_a_reader(self, job, keep):
        steps = sorted(self.cat.ledger.committed.get(job, {}))
        if not steps:
            return
        with self.cat.open_shard(job, steps[0], 0) as (view, crc, _marks):
            self.delete(job, keep)
            assert crc32c(view) == crc, "a checkpoint was freed or overwritten under its reader"

    @rule(job=JOBS)
    def put_spec(self, job):
        self.cat.put_spec(job, JobSpec(("train.py",), "/", "node", time.time()))
        self.spec[job] = True

    @rule(job=JOBS)
    def member_event(self, job):
        """A launch's start (or any membership change) of ``job``: its record changes, and goes to the bucket."""
        self.members.record(job, MembershipEvent(time.time(), "node", "joined", "started", 1, 0))
        self.events[job] += 1

    @rule()
    def settle(self):
        """The disk writer and the uploader do all they have to do; then the bucket's membership records are
        dash-memd's, and a deleted job has none there."""
        while self.cat.disk_writer.persist_next(timeout=0):
            pass
        while self.cat.uploader.next(timeout=0):
            pass
        for job in WORLD:
            assert self.bucket.get_record(job) == self.members.body(job), f"{job}: the bucket's record is stale"

    @rule(then=ACTIONS)
    def restart(self, then):
        """dash-memd dies and starts again: RAM, queues and shards in flight are lost; disk and bucket stay.
        ``then`` arrives before the bucket is listed."""
        self.cat.close()
        self.cat = self.start()
        self.open.clear()
        for job in WORLD:
            self.fresh[job].clear()
        if then is not None:
            self.action(then)()

    # --- what must always hold ------------------------------------------------------------------

    @invariant()
    def observe_durable(self):
        for job, steps in self.cat.ledger.committed.items():
            self.durable[job].update(s for s, e in steps.items() if e.tiers & {"disk", "object"})

    @invariant()
    def nothing_lost_nothing_back_bytes_verified(self):
        listed = self.cat.uploader.listed
        for job in WORLD:
            held = self.cat.ledger.committed.get(job, {})
            for step, entry in held.items():
                candidates = {run for run, layout in self.alive[job].get(step, ()) if LAYOUTS[layout] == entry.layout}
                assert candidates, f"{job} step {step} is back after it was deleted (or was never committed)"
                layout = LAYOUTS.index(entry.layout)
                for rank in range(entry.world):
                    with self.cat.open_shard(job, step, rank) as (view, crc, _marks):
                        assert crc32c(view) == crc, f"{job} step {step} rank {rank}: served bytes fail their CRC"
                        served = bytes(view)
                    candidates = {run for run in candidates if payload(job, run, step, rank, layout) == served}
                    assert candidates, f"{job} step {step} rank {rank}: served bytes are not those committed"
            newest = max(self.durable[job] | self.fresh[job], default=None)
            try:
                latest = self.cat.latest(job)
            except UnavailableError:
                assert not listed and not held, "unavailable although the bucket was listed"
                continue
            if listed or held:
                assert (latest.step if latest else None) == newest, f"{job}: newest {newest} lost"
            assert (self.cat.spec(job) is not None) == self.spec[job], f"{job}: spec {self.spec[job]}"

    @invariant()
    def nothing_deleted_left_on_disk(self):
        """What would come back at the next start is on disk now: every checkpoint there is one the model holds."""
        for job in WORLD:
            job_dir = self.disk.step_dir(job, 0).parent
            for step_dir in sorted(job_dir.glob("[0-9]*")) if job_dir.is_dir() else ():
                info = self.disk.read_manifest(step_dir)
                layout = LAYOUTS.index(info.layout)
                runs = [run for run, lay in self.alive[job].get(info.step, ()) if lay == layout and all(
                    crc32c(payload(job, run, info.step, s.rank, layout)) == s.crc for s in info.shards)]
                assert runs, f"{job} step {info.step} is on disk after it was deleted (or was never committed)"

    @invariant()
    def ram_accounting(self):
        ledger, ram = self.cat.ledger, self.cat.ram
        live = [b for e in ledger.receiving.values() for b in e.buffers.values()]
        live += [b for steps in ledger.committed.values() for e in steps.values() if "ram" in e.tiers
                 for b in e.buffers.values()]
        live += [s.ticket.buffer for s in self.open]
        downloads = self.cat.downloads
        if downloads is not None:  # a shard read from the bucket stays in RAM a while, for the next range of it
            live += [d.buffer for d in downloads._held.values() if d.buffer is not None]
        assert len({id(b) for b in live}) == len(live), "one buffer held twice"
        assert ram.used == sum(len(b) for b in live), f"RAM in use {ram.used} != live {sum(len(b) for b in live)}"
        pooled = {id(b) for bufs in ram._free.values() for b in bufs}
        assert not pooled & {id(b) for b in live}, "a buffer in use is in the pool of free buffers"

    @invariant()
    def membership_kept_and_not_back(self):
        for job in WORLD:
            assert len(self.members.history(job)) == self.events[job], f"{job}: membership events lost or back"

    @invariant()
    def no_errors(self):
        assert not self.errors.records, self.errors.records


Lifecycle.TestCase.settings = settings(max_examples=150, stateful_step_count=40, derandomize=True, database=None,
                                       deadline=None, suppress_health_check=list(HealthCheck))
TestLifecycle = pytest.mark.slow(Lifecycle.TestCase)


def test_a_shard_read_back_from_the_bucket_is_counted_in_ram_while_it_lingers():
    """The case the machine above found in CI: step 1 trimmed from disk, read back from the bucket (the download
    stays in RAM a while for the next range of it), and the RAM in use must count that buffer."""
    machine = Lifecycle()
    checks = [machine.no_errors, machine.nothing_deleted_left_on_disk,
                  machine.nothing_lost_nothing_back_bytes_verified, machine.observe_durable, machine.ram_accounting]
    try:
        for step in (lambda: machine.deliver(job="a", layout=0, step=1), machine.settle,
                     lambda: machine.deliver(job="a", layout=0, step=2),
                     lambda: machine.deliver(job="a", layout=0, step=3), machine.settle):
            step()
            for check in checks:
                check()
    finally:
        machine.teardown()


def test_a_rank_that_vanished_is_reported_first_over_a_peer_whose_collective_it_broke(tmp_path):
    """torch orders failures by whole seconds, and a rank killed outright has no error file: its time is when the
    launcher saw it, often the same second as (or the one after) its peer's "connection reset" error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dashrun.launch.launcher import _first_failure

    said = tmp_path / "error.json"
    now = int(time.time())
    said.write_text(json.dumps({"message": {"message": "RuntimeError: Connection reset by peer",
                                            "extraInfo": {"timestamp": str(now)}}}))
    peer = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(said))
    vanished = ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none.json"))
    vanished.timestamp = now + 1
    assert _first_failure(ChildFailedError("train.py", {0: peer, 1: vanished}))[0] == 1
    vanished.timestamp = now + 5  # seconds later: the peer's own failure came first
    assert _first_failure(ChildFailedError("train.py", {0: peer, 1: vanished}))[0] == 0
