"""Telling dash-memd what this node holds, and learning the job's other members from its answer.

Every :data:`~dashrun.wire.holdings.ANNOUNCE_PERIOD` seconds, and soon after
the node's holdings change (:meth:`Announcer.changed`: the changes of
:data:`CHANGE_GAP` seconds go in one), the agent sends
dash-memd one announcement (HOLDINGS): where its peers reach it, its failure
domain, the copies it keeps for others and every shard it holds. The answer
names the job's other members, from which the agent places its own copies
(:func:`dashrun.agent.peers.placement.choose_holders`), and dash-memd's newest
committed step, which lets the node's store drop older copies. A dash-memd
that does not answer (restarting, its link cut) is asked again next period;
after it restarts, the first announcement refills its registry
(:mod:`dashrun.memd.fleet.holdings`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from dashrun.errors import DashError
from dashrun.util.problems import ProblemLog
from dashrun.wire.holdings import ANNOUNCE_PERIOD, Announced, HeldShard, Holdings, Member
from dashrun.wire.memd_client import MemdClient

__all__ = ["CHANGE_GAP", "Announcer"]

log = logging.getLogger(__name__)

#: Seconds after an announcement before a change is announced: a checkpoint changes the holdings several times
#: (each shard arriving, held, committed, the step before it dropped), and one announcement a change costs
#: this agent and dash-memd more CPU than everything else replicas do.
CHANGE_GAP = 0.25


class Announcer:
    """A thread that announces ``held()`` for ``node`` of ``job`` and hands each answer to ``answered``."""

    def __init__(self, connect: Callable[[], MemdClient], job: str, node: str, *,
                 address: Callable[[], tuple[str, int]], held: Callable[[], list[HeldShard]],
                 answered: Callable[[Announced], None], replicas: int = 0, domain: dict[str, str] | None = None,
                 period: float = ANNOUNCE_PERIOD):
        self._connect, self.job, self.node = connect, job, node
        self._address, self._held, self._answered = address, held, answered
        self.replicas, self.domain, self.period = replicas, domain, period
        self.members: list[Member] = []
        self.committed: int | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._answers = threading.Condition()
        self._count = 0  # answers so far (guarded by _answers)
        self._thread = threading.Thread(target=self._run, name="agent-announce", daemon=True)

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def changed(self) -> None:
        """The node's holdings changed: announce them within CHANGE_GAP seconds rather than at the next period."""
        self._wake.set()

    def wait_answer(self, after: int, timeout: float) -> bool:
        """Wait until more than ``after`` answers arrived (see :attr:`answers`); whether they did in time."""
        with self._answers:
            return self._answers.wait_for(lambda: self._count > after, timeout=timeout)

    @property
    def answers(self) -> int:
        with self._answers:
            return self._count

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def announcement(self) -> Holdings:
        host, port = self._address()
        return Holdings(self.job, self.node, host, port, self.replicas, self.domain, tuple(self._held()))

    def _run(self) -> None:
        problems = ProblemLog(log)
        client: MemdClient | None = None
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    client = client or self._connect()
                    answer = client.announce(self.announcement())
                except DashError as e:
                    problems.problem("announce", e.code.value, "cannot tell dash-memd what this node holds: %s", e)
                    if client is not None:
                        client.close()
                        client = None
                else:
                    problems.ok("announce")
                    self.members, self.committed = answer.members, answer.committed
                    try:
                        self._answered(answer)
                    except Exception:  # a bug in a consumer must not end the announcements
                        log.exception("handling dash-memd's answer to an announcement failed")
                    with self._answers:
                        self._count += 1
                        self._answers.notify_all()
                if self._stopping.wait(CHANGE_GAP):
                    return
                self._wake.wait(max(0.0, self.period - CHANGE_GAP))
        finally:
            if client is not None:
                client.close()
