"""Who holds what in the fleet's own RAM: each node's newest announcement (HOLDINGS), kept a short while.

A job's dash-agents announce every few seconds what they hold — their own
node's newest committed shards and copies of other nodes' — and where other
agents reach them (:class:`dashrun.wire.holdings.Holdings`). The registry keeps
each node's newest announcement for :data:`~dashrun.wire.holdings.HOLDINGS_TTL`
seconds, in RAM only: after dash-memd restarts, the agents' next
announcements fill it again. From it come the job's members (with their
failure domains, from which each agent places its copies), the nodes holding
each saved rank's shard of a checkpoint (a restore reads from them first),
and the placement ``dashrun status`` shows.

It is also where a step commits on the fleet (:meth:`Registry.committed`): with
replicas (R >= 1), a step whose every saved rank's shard is held, the same
bytes, by R+1 nodes is committed even while dash-memd does not hold it whole
— its link is thin, or it restarted and lost its RAM — and it stays
committed when holders go (a node died: what it held is what the commit was
for). After a restart of dash-memd, which forgets which steps committed so,
a step is committed again once every rank's shard has a holder and a holder
says its step was committed.

Bounded per job: at most :data:`MAX_NODES` nodes, and announcements of at most
:data:`MAX_JOB_BYTES` together (a job's credential could otherwise announce
without end); a node that left the job (a ``left`` or ``died`` membership
event) is forgotten at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from dashrun.errors import NoSpaceError
from dashrun.wire.holdings import HOLDINGS_TTL, MAX_MEMBERS, Holder, Holdings, Member
from dashrun.wire.messages import CheckpointInfo, ShardHeader, tiling_problem
from dashrun.wire.protocol import encode_body

__all__ = ["MAX_JOB_BYTES", "MAX_NODES", "Registry"]

#: Nodes of one job the registry keeps announcements of.
MAX_NODES = MAX_MEMBERS
#: Bytes of announcements (as they arrived) one job's nodes may keep in the registry together.
MAX_JOB_BYTES = 32 << 20
#: Steps committed on the fleet the registry remembers per job (the newest).
KEEP_COMMITTED = 4


@dataclasses.dataclass
class _Entry:
    holdings: Holdings
    size: int
    at: float


class Registry:
    """Each job's nodes' newest announcements; every method is safe to call from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl: float = HOLDINGS_TTL):
        self._clock = clock
        self._ttl = ttl
        self._jobs: dict[str, dict[str, _Entry]] = {}
        self._committed: dict[str, dict[int, CheckpointInfo]] = {}  # job -> step -> committed on the fleet
        self._lock = threading.Lock()

    def announce(self, holdings: Holdings) -> list[Member]:
        """Keep ``holdings`` as its node's newest; returns the job's other members. NoSpaceError when the job
        has as many nodes, or as many bytes of announcements, as it may."""
        size = len(encode_body(holdings.to_body()))
        now = self._clock()
        with self._lock:
            nodes = self._live(holdings.job, now)
            others = {node: e for node, e in nodes.items() if node != holdings.node}
            if len(others) >= MAX_NODES:
                raise NoSpaceError(f"{holdings.job} has {len(others)} nodes announcing what they hold: at most "
                                   f"{MAX_NODES}")
            if size + sum(e.size for e in others.values()) > MAX_JOB_BYTES:
                raise NoSpaceError(f"{holdings.job}'s nodes announce more than {MAX_JOB_BYTES >> 20} MiB of holdings")
            nodes[holdings.node] = _Entry(holdings, size, now)
            self._jobs[holdings.job] = nodes
            return [Member(e.holdings.node, e.holdings.host, e.holdings.port, e.holdings.domain)
                    for node, e in sorted(others.items())]

    def holders(self, info: CheckpointInfo) -> dict[int, list[Holder]]:
        """The nodes that hold each saved rank's shard of ``info`` (the same bytes: the same CRC-32C) and listen
        for their peers."""
        now = self._clock()
        wanted = {(s.rank, s.crc, s.nbytes) for s in info.shards}
        found: dict[int, list[Holder]] = {}
        with self._lock:
            for entry in self._live(info.job, now).values():
                held = entry.holdings
                if not held.port:
                    continue
                for copy in held.shards:
                    shard = copy.shard
                    if shard.step == info.step and (shard.rank, shard.crc, shard.nbytes) in wanted:
                        found.setdefault(shard.rank, []).append(Holder(held.node, held.host, held.port))
        return {rank: sorted(set(holders)) for rank, holders in sorted(found.items())}

    def committed(self, job: str, step: int | None = None, generation: int = 0) -> CheckpointInfo | None:
        """The newest step of ``job`` (or ``step``) committed on the fleet: see the module's text. A step whose
        commit rests on copies counted now needs shards of world ``generation`` or newer (the fence of
        dash-memd's own commits)."""
        now = self._clock()
        with self._lock:
            entries = list(self._live(job, now).values())
            memo = self._committed.setdefault(job, {})
            held: dict[int, dict[tuple[int, int], tuple[ShardHeader, set[str], bool]]] = {}
            replicas = min((e.holdings.replicas for e in entries), default=0)
            for entry in entries:
                for copy in entry.holdings.shards:
                    shard = copy.shard
                    key = (shard.rank, shard.crc)
                    header, nodes, said = held.setdefault(shard.step, {}).get(key, (shard, set(), False))
                    nodes.add(entry.holdings.node)
                    held[shard.step][key] = (header, nodes, said or copy.committed)
            for candidate in sorted(held, reverse=True):
                if step is not None and candidate != step or candidate in memo:
                    continue
                info = _whole(job, candidate, held[candidate], replicas, generation, time.time())
                if info is not None:
                    memo[candidate] = info
                    for old in sorted(memo)[:-KEEP_COMMITTED]:
                        del memo[old]
                    break
            if step is not None:
                return memo.get(step)
            return memo[max(memo)] if memo else None

    def view(self, job: str) -> list[dict[str, Any]]:
        """What ``dashrun status`` shows: per node, its failure domain and, per step it holds, whose shards."""
        now = self._clock()
        with self._lock:
            entries = sorted(self._live(job, now).items())
        view = []
        for node, entry in entries:
            steps: dict[int, set[str]] = {}
            for copy in entry.holdings.shards:
                steps.setdefault(copy.shard.step, set()).add(copy.owner)
            domain = entry.holdings.domain
            view.append({"node": node, "domain": domain.to_body() if domain else None,
                         "replicas": entry.holdings.replicas, "host": entry.holdings.host,
                         "port": entry.holdings.port,
                         "steps": {str(step): sorted(owners) for step, owners in sorted(steps.items())}})
        return view

    def forget(self, job: str, node: str) -> None:
        """``node`` left ``job`` (or died): what it held is gone with it."""
        with self._lock:
            nodes = self._jobs.get(job)
            if nodes is not None:
                nodes.pop(node, None)
                if not nodes:
                    del self._jobs[job]

    def delete_job(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)
            self._committed.pop(job, None)

    def delete_steps(self, job: str, steps) -> None:
        """dash-memd deleted these steps of ``job``: the fleet's commit of them is forgotten too (the copies
        go as the nodes' own retention lets them)."""
        with self._lock:
            memo = self._committed.get(job, {})
            for step in steps:
                memo.pop(step, None)

    def _live(self, job: str, now: float) -> dict[str, _Entry]:
        """``job``'s announcements young enough to stand (the older are dropped); the caller holds the lock."""
        nodes = self._jobs.get(job, {})
        live = {node: e for node, e in nodes.items() if now - e.at <= self._ttl}
        if len(live) != len(nodes):
            if live:
                self._jobs[job] = live
            else:
                self._jobs.pop(job, None)
        return live


def _whole(job: str, step: int, held: dict[tuple[int, int], tuple[ShardHeader, set[str], bool]], replicas: int,
           generation: int, now: float) -> CheckpointInfo | None:
    """Step ``step`` as one committed checkpoint, if the shards held of it make one and commit it: one shard per
    saved rank that tile the replicated state, each held by ``replicas`` + 1 nodes (``replicas`` >= 1, of world
    ``generation`` or newer), or each by one node at least and one of them known committed by its holder."""
    by_rank: dict[int, tuple[ShardHeader, set[str], bool]] = {}
    for (rank, _crc), found in held.items():
        if rank not in by_rank or len(found[1]) > len(by_rank[rank][1]):
            by_rank[rank] = found  # two copies of one rank that differ: the one more nodes hold
    first = next(iter(by_rank.values()))[0]
    world = first.world
    if sorted(by_rank) != list(range(world)):
        return None
    shards = tuple(by_rank[rank][0] for rank in range(world))
    if any(s.world != world for s in shards) or tiling_problem(shards, first.rep_total, first.layout):
        return None
    counted = replicas >= 1 and all(len(by_rank[r][1]) >= replicas + 1 and by_rank[r][0].generation >= generation
                                    for r in range(world))
    said = any(by_rank[r][2] for r in range(world))
    if not counted and not said:
        return None
    return CheckpointInfo(job, step, world, first.rep_total, first.layout, now, shards)
