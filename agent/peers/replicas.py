"""This node's replicas, sent in the background: each own shard the store holds goes to the node's holders.

The rank's sender (:mod:`dashrun.agent.ranks`) hands each shard of this node,
once it is in the store with its CRC-32C, to :meth:`Replicator.submit`, and
answers its rank without waiting: one thread here sends the shards, oldest
first, from the store's copy (never from the rank's segment, which the rank
reuses once answered) to the first ``replicas`` peers ``holders()`` names
that are not this node. A shard the store dropped meanwhile (a newer step was
committed) is skipped. A holder that cannot take one is logged once per
holder and kind of failure, and tried again with the next shard: the next
checkpoint's replicas heal what one missed.

``holders()`` gives (node, host, port) of the peers this node's replicas go
to, in order of preference (:mod:`dashrun.agent.peers.placement` chooses
them from dash-memd's registry; tests give them as ``--peer``).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from dashrun.wire.peer_client import PeerClient
from dashrun.agent.peers.store import Store
from dashrun.errors import DashError
from dashrun.util.problems import ProblemLog
from dashrun.wire.messages import ShardHeader

__all__ = ["Peer", "Replicator"]

log = logging.getLogger(__name__)

#: A peer agent: its node's name and where it listens.
Peer = tuple[str, str, int]


class Replicator:
    """Sends this node's shards from ``store`` to its holders, on a thread of its own."""

    def __init__(self, store: Store, node: str, replicas: int, holders: Callable[[], list[Peer]],
                 connect: Callable[[str, int], PeerClient]):
        self.store, self.node, self.replicas = store, node, replicas
        self.holders, self.connect = holders, connect
        self._queue: queue.Queue[tuple[ShardHeader, Callable[[int], None]] | None] = queue.Queue()
        self._clients: dict[tuple[str, int], PeerClient] = {}
        self._problems = ProblemLog(log)
        self._thread = threading.Thread(target=self._loop, name="agent-replicas", daemon=True)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        #: replicas delivered, by holder node (for the agent's log and tests)
        self.sent: dict[str, int] = {}

    def start(self) -> Replicator:
        self._thread.start()
        return self

    def submit(self, header: ShardHeader, done: Callable[[int], None] = lambda holders: None) -> None:
        """Send this shard of this node (held in the store with ``header.crc``) to its holders, later; ``done`` is
        told how many took it (:mod:`.delivery` counts them towards the commit)."""
        with self._lock:
            self._pending += 1
        self._queue.put((header, done))

    def wait_idle(self, timeout: float) -> bool:
        """Whether every submitted shard was dealt with within ``timeout`` seconds (for stopping, and tests)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        for client in self._clients.values():
            client.close()

    def chosen(self) -> list[Peer]:
        """The holders this node's next replicas go to."""
        return [peer for peer in self.holders() if peer[0] != self.node][:self.replicas]

    def _loop(self) -> None:
        while (queued := self._queue.get()) is not None:
            header, done = queued
            holders = 0
            try:
                holders = self._send(header)
            except Exception:  # a bug costs this shard's replicas, not the ones queued behind it
                log.exception("replicas of %s step %d, rank %d failed", header.job, header.step, header.rank)
            finally:
                done(holders)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _send(self, header: ShardHeader) -> int:
        """Send ``header``'s shard to this node's holders; how many took it."""
        holders = 0
        for node, host, port in self.chosen():
            with self.store.open(header.job, header.step, header.rank, header.crc) as opened:
                if opened is None:
                    return holders  # dropped since (a newer step is committed): nothing to send
                view, _marks, held = opened
                client = self._clients.get((host, port))
                try:
                    if client is None:
                        client = self._clients[(host, port)] = self.connect(host, port)
                    client.put_replica(held, self.node, [view], self.store.newest_committed(header.job))
                except DashError as e:
                    self._problems.problem(node, e.code.value, "replicas are not reaching %s at %s:%d: %s", node,
                                           host, port, e)
                    continue
            self._problems.ok(node)
            holders += 1
            self.sent[node] = self.sent.get(node, 0) + 1
            log.debug("%s step %d, rank %d: replica held by %s", header.job, header.step, header.rank, node)
        return holders
