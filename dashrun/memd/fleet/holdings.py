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
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.protocol import encode_body

__all__ = ["MAX_JOB_BYTES", "MAX_NODES", "Registry"]

#: Nodes of one job the registry keeps announcements of.
MAX_NODES = MAX_MEMBERS
#: Bytes of announcements (as they arrived) one job's nodes may keep in the registry together.
MAX_JOB_BYTES = 32 << 20


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
            view.append({"node": node, "domain": entry.holdings.domain, "replicas": entry.holdings.replicas,
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
