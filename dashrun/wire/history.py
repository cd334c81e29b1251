"""A job's run history beside its membership events: its steps over time, the steps redone after rollbacks,
the time its ranks spent restoring, and each node's failure domain (instance type, zone, market).

dash-memd keeps one :class:`RunHistory` per job with the job's membership
record (:mod:`dashrun.memd.fleet.membership`) and sends it in the MEMBERSHIP
reply; ``dashrun report`` computes node-hours, goodput and cost from the two
(:mod:`dashrun.ledger.report`).

What it counts comes from what the ranks report with each snapshot (rank 0's
shard stands for its world): the snapshot's step, and the restore that began
the ranks' run (:class:`Restored`: the step they went on from, -1 for none,
how long it took, and when). A run that went on from step ``c`` redoes the
steps after ``c`` that an earlier run had snapshotted already: a snapshot of
step ``s`` in it counts the steps of ``(c, s]`` at or below the job's highest
snapshotted step from before that run, each once. Steps done and lost after
a run's last snapshot are not seen (a rank reports nothing between snapshots).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from dashrun.errors import ProtocolError
from dashrun.wire.domain import FailureDomain
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import MAX_STEP, MAX_WORLD, field_float, field_int

__all__ = ["MAX_HISTORY_NODES", "MAX_POINTS", "Restored", "RunHistory"]

#: Snapshots kept per job for the report's plot (the newest); the counts cover every one.
MAX_POINTS = 4096
#: Nodes whose failure domain is kept per job.
MAX_HISTORY_NODES = 1024
#: Restores remembered, so that each is counted once however many snapshots report it.
_SEEN_RESTORES = 64
_MAX_SECONDS = 1e7
_MAX_TIME = 1e11


@dataclasses.dataclass(frozen=True)
class Restored:
    """How the rank's run began: it restored ``step`` (-1: none was committed) in ``seconds``, at ``at`` (epoch
    seconds, the rank's clock: also what tells two restores of the same step apart)."""

    step: int
    seconds: float
    at: float

    def to_body(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_body(cls, body: Any) -> Restored:
        if not isinstance(body, dict):
            raise ProtocolError("field 'restored' must be an object")
        return cls(step=field_int(body, "step", -1, MAX_STEP), seconds=field_float(body, "seconds", 0.0, _MAX_SECONDS),
                   at=field_float(body, "at", 0.0, _MAX_TIME))


class RunHistory:
    """One job's counts (see the module's doc). Not thread-safe: its owner holds a lock around it."""

    def __init__(self) -> None:
        self.high = -1             # the highest step snapshotted so far
        self.redone = 0
        self.restores = 0
        self.restore_s = 0.0
        self.points: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=MAX_POINTS)
        self.domains: dict[str, FailureDomain] = {}
        self._run_from = -1        # the step the current run went on from
        self._run_high = -1        # the job's highest snapshotted step when it began
        self._run_last = -1        # the run's newest snapshotted step
        self._seen: collections.deque[float] = collections.deque(maxlen=_SEEN_RESTORES)

    @property
    def steps_done(self) -> int:
        return self.high + 1

    def note_snapshot(self, header: ShardHeader, restored: Restored | None, now: float) -> bool:
        """Count a snapshot a rank reported; whether anything changed (only rank 0's count, once per step)."""
        if header.rank != 0:
            return False
        changed = False
        if restored is not None and restored.at not in self._seen:
            self._seen.append(restored.at)
            self.restores += restored.step >= 0  # a run that found nothing to restore restored nothing
            self.restore_s += restored.seconds
            self._run_from, self._run_high, self._run_last = restored.step, self.high, restored.step
            changed = True
        if header.step == self._run_last and not changed:
            return False  # a snapshot of this step counted already
        start = max(self._run_last, self._run_from)
        upto = min(header.step, self._run_high)
        if upto > start:
            self.redone += upto - start
        self._run_last = max(self._run_last, header.step)
        self.high = max(self.high, header.step)
        self.points.append((now, header.step, header.world))
        return True

    def note_domain(self, node: str, domain: FailureDomain | None) -> bool:
        """Keep ``node``'s failure domain (as its agent announced it); whether it is new."""
        if domain is None or not domain.known or self.domains.get(node) == domain:
            return False
        if node not in self.domains and len(self.domains) >= MAX_HISTORY_NODES:
            return False
        self.domains[node] = domain
        return True

    def extend(self, later: RunHistory) -> None:
        """Add what ``later`` counted after this history's end: a dash-memd that started without this one (its
        data dir lost) and took it back from the bucket afterwards. A rollback in ``later`` is measured against
        the higher of the two histories' steps from then on only."""
        if later._seen or later.points:  # the run going on now is later's
            self._run_from, self._run_last = later._run_from, later._run_last
            self._run_high = max(self.high, later._run_high)
        self.redone += later.redone
        self.restores += later.restores
        self.restore_s += later.restore_s
        self.high = max(self.high, later.high)
        self.points.extend(later.points)
        for node, domain in later.domains.items():
            if node in self.domains or len(self.domains) < MAX_HISTORY_NODES:
                self.domains[node] = domain
        self._seen.extend(at for at in later._seen if at not in self._seen)

    def to_body(self) -> dict[str, Any]:
        return {"high": self.high, "redone": self.redone, "restores": self.restores, "restore_s": self.restore_s,
                "points": [list(p) for p in self.points],
                "domains": {node: d.to_body() for node, d in self.domains.items()},
                "run": [self._run_from, self._run_high, self._run_last], "seen": list(self._seen)}

    @classmethod
    def from_body(cls, body: Any) -> RunHistory:
        if not isinstance(body, dict):
            raise ProtocolError("a run history must be an object")
        history = cls()
        history.high = field_int(body, "high", -1, MAX_STEP)
        history.redone = field_int(body, "redone", 0, MAX_STEP)
        history.restores = field_int(body, "restores", 0, MAX_STEP)
        history.restore_s = field_float(body, "restore_s", 0.0, _MAX_TIME)
        points, domains = body.get("points", []), body.get("domains", {})
        run, seen = body.get("run", [-1, -1, -1]), body.get("seen", [])
        if not isinstance(points, list) or len(points) > MAX_POINTS:
            raise ProtocolError(f"a run history holds at most {MAX_POINTS} points")
        if not isinstance(domains, dict) or len(domains) > MAX_HISTORY_NODES:
            raise ProtocolError(f"a run history holds at most {MAX_HISTORY_NODES} nodes")
        if not isinstance(seen, list) or len(seen) > _SEEN_RESTORES or not _numbers(seen, 0, _MAX_TIME):
            raise ProtocolError("malformed run history: its restores")
        if not isinstance(run, list) or len(run) != 3 or not _numbers(run, -1, MAX_STEP, whole=True):
            raise ProtocolError("malformed run history: its run")
        for point in points:
            if (not isinstance(point, list) or len(point) != 3 or not _numbers(point[:1], 0, _MAX_TIME)
                    or not _numbers(point[1:2], 0, MAX_STEP, whole=True)
                    or not _numbers(point[2:], 0, MAX_WORLD, whole=True)):
                raise ProtocolError("malformed run history: a point must be [time, step, world]")
            history.points.append((float(point[0]), point[1], point[2]))
        for node, domain in domains.items():
            if not isinstance(node, str) or not 0 < len(node) <= 255 or not node.isprintable():
                raise ProtocolError("malformed run history: a node's name")
            history.domains[node] = FailureDomain.from_body(domain)
        history._run_from, history._run_high, history._run_last = run
        history._seen.extend(float(at) for at in seen)
        return history


def _numbers(values: list, lo: float, hi: float, whole: bool = False) -> bool:
    kinds = (int,) if whole else (int, float)
    return all(isinstance(v, kinds) and not isinstance(v, bool) and lo <= v <= hi and math.isfinite(v)
               for v in values)
