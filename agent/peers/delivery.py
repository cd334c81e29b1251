"""A shard's delivery with replicas: safe once dash-memd stored it, or once this node and R peers hold it.

With ``--replicas R``, the rank's sender (:mod:`dashrun.agent.ranks`) first
waits for the node's own copy of the shard (:mod:`.own`): from then on the
rank's segment is no longer read. It then hands the shard, as the store
holds it, to the replicas' sender (:mod:`.replicas`) and to this module's
:class:`MemdFeed`, which streams it to dash-memd *from the store's copy*, and
answers the rank — "your buffer may be reused" — at the first of:
dash-memd stored and verified it, or R peers hold it (:class:`Outcome`). So a
dash-memd behind a thin link, restarting, or having lost its memory costs the
training step nothing more: dash-memd catches up from the agent in the
background, shard after shard in the order they were handed over, and one
the store dropped meanwhile (a newer step committed) is skipped: dash-memd
gets the newer one. The step itself is committed, in dash-memd's registry,
once every shard is held by R+1 nodes (:mod:`dashrun.memd.fleet.holdings`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from dashrun.agent.peers.store import Store
from dashrun.errors import ConflictError, DashError, NotFoundError, UnavailableError
from dashrun.util.problems import ProblemLog
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import ShardHeader

__all__ = ["MemdFeed", "Outcome", "wait_committed"]

#: Seconds between looks at the fleet's commits while waiting for one of dash-memd's.
FLEET_LOOK = 0.5

log = logging.getLogger(__name__)


class Outcome:
    """How one shard's delivery stands: dash-memd's answer (or failure) and how many peers took a copy."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self._cond = threading.Condition()
        self.memd: dict[str, Any] | None = None  # dash-memd's answer, once it stored the shard
        self.memd_error: BaseException | None = None
        self.peers: int | None = None  # peers holding a copy, once the replicas' sender is done with it

    def stored(self, answer: dict[str, Any]) -> None:
        with self._cond:
            self.memd = answer
            self._cond.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._cond:
            self.memd_error = error
            self._cond.notify_all()

    def replicated(self, holders: int) -> None:
        with self._cond:
            self.peers = holders
            self._cond.notify_all()

    def wait(self) -> dict[str, Any] | None:
        """Block until the shard is safe: dash-memd's answer, or None when R peers hold it (before dash-memd
        answered). Raises dash-memd's error when it failed and the peers did not make up for it."""
        with self._cond:
            self._cond.wait_for(self._settled)
            if self.memd is not None:
                return self.memd
            if self.peers is not None and self.peers >= self.replicas:
                return None
            raise self.memd_error

    def _settled(self) -> bool:
        held = self.peers is not None and self.peers >= self.replicas
        return self.memd is not None or held or (self.memd_error is not None and self.peers is not None)


@dataclasses.dataclass
class _Job:
    header: ShardHeader  # as the store holds it: crc set
    outcome: Outcome


class MemdFeed:
    """One rank's shards, from the store's copies to dash-memd, in order, on a thread and a connection of its own
    (``connect`` makes it); ``node`` is this node's name, as dash-memd lists it."""

    def __init__(self, store: Store, connect: Callable[[], MemdClient], node: str,
                 stored: Callable[[ShardHeader, dict[str, Any]], None] = lambda header, answer: None):
        self.store, self._connect, self.node, self._stored = store, connect, node, stored
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._client: MemdClient | None = None
        self._problems = ProblemLog(log)
        self._thread = threading.Thread(target=self._loop, name="agent-memd-feed", daemon=True)
        self._thread.start()

    def submit(self, header: ShardHeader, outcome: Outcome) -> None:
        self._queue.put(_Job(header, outcome))

    def close(self, timeout: float) -> None:
        """Deliver what is queued (within ``timeout`` seconds), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        try:
            while (job := self._queue.get()) is not None:
                try:
                    answer = self._put(job.header)
                except NotFoundError as e:  # dropped from the store: a newer step is committed, dash-memd gets it
                    log.debug("%s", e)
                    job.outcome.failed(e)
                except DashError as e:
                    self._problems.problem(job.header.job, e.code.value, "%s: shards are not reaching dash-memd "
                                           "(the fleet's copies hold them meanwhile): %s", job.header.job, e)
                    job.outcome.failed(e)
                except Exception as e:  # a bug costs this shard's copy in dash-memd, not the ones behind it
                    log.exception("%s step %d, rank %d: feeding dash-memd failed", job.header.job, job.header.step,
                                  job.header.rank)
                    job.outcome.failed(e)
                else:
                    self._problems.ok(job.header.job)
                    job.outcome.stored(answer)
                    self._stored(job.header, answer)
        finally:
            if self._client is not None:
                self._client.close()

    def _put(self, held: ShardHeader) -> dict[str, Any]:
        announced = dataclasses.replace(held, crc=0)  # a shard is announced unverified; its checksum follows
        with self.store.open(held.job, held.step, held.rank, held.crc) as opened:
            if opened is None:
                raise NotFoundError(f"{held.job} step {held.step}, rank {held.rank}'s shard left this agent's store "
                                    "before dash-memd took it (a newer step is committed)")
            view = opened[0]
            for attempt in (1, 2):
                if self._client is None:
                    self._client = self._connect()
                try:
                    return self._client.put_shard(announced, [view], node=self.node, crc=lambda: held.crc)
                except UnavailableError:
                    self._client.close()
                    self._client = None
                    if attempt == 2:
                        raise
                except ConflictError:
                    # Refused as held already: an earlier try got through before its connection broke.
                    info = self._client.latest(held.job, held.step)
                    if info is not None and info.step == held.step and held.rank < len(info.shards) \
                            and info.shards[held.rank].crc == held.crc:
                        return {"committed": True, "crc": held.crc}
                    raise
        raise AssertionError("unreachable")


def wait_committed(client: MemdClient, job: str, step: int, timeout: float, fleet: bool) -> bool:
    """Whether ``job``'s ``step`` is committed within ``timeout`` seconds: in dash-memd, or (``fleet``) on the
    fleet — every shard held by R+1 nodes — which a rank waiting for its checkpoint (a notice's, say) may take
    as well, while dash-memd catches up."""
    if not fleet:
        return client.wait(job, step, timeout)
    deadline = time.monotonic() + timeout
    while True:
        located = client.locate(job, step)
        if located is not None and located.info.step == step:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if client.wait(job, step, min(FLEET_LOOK, left)):
            return True
