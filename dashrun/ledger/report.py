"""``dashrun report JOB``: what a job's run on Spot nodes cost and saved, from what dash-memd recorded of it.

Read from the job's membership events (who joined, left after a notice,
died, finished) and its run history (:mod:`dashrun.wire.history`: the steps
of its snapshots over time, the steps redone, the restores, each node's
failure domain):

- node time: each node from its ``joined`` to its ``left`` (notice),
  ``died`` (killed), ``finished`` or ``failed``; a node that joins again
  with no end recorded (its launcher was killed with it) ended at the last
  thing heard of the job before that; one still running, now.
- the node time per step: between consecutive snapshots of one run (the same
  world, the step rising, no membership change between), node-seconds over
  steps. Useful time is the steps done at that rate; goodput is useful ÷
  node time.
- time lost (node-seconds): ``redone`` (steps trained again after a
  rollback), ``restore`` (the ranks' restores, as rank 0 timed them, times
  the largest world's nodes), ``other`` (start-up, rendezvous, checkpoints, waiting, and steps
  lost after a run's last snapshot).
- with prices: the node-hours of each instance type and market at their
  price; the on-demand comparison is the useful work on as many on-demand
  nodes as the job's largest world, at the same speed, with nothing lost.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Sequence

from dashrun.errors import UsageError
from dashrun.wire.domain import FailureDomain
from dashrun.wire.history import RunHistory
from dashrun.wire.messages import MembershipEvent

__all__ = ["UNKNOWN", "Stay", "compute", "stays"]

UNKNOWN = "unknown"
_ENDS = {"left": "notice", "died": "killed", "finished": "finished", "failed": "failed"}


@dataclasses.dataclass(frozen=True)
class Stay:
    """One node's time in the job: from ``start`` to ``end`` (epoch seconds), ended by ``why``."""

    node: str
    start: float
    end: float
    why: str
    instance_type: str
    market: str

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def _domains(events: Sequence[MembershipEvent], history: RunHistory | None) -> dict[str, FailureDomain]:
    """Each node's failure domain. Agents name their node by its host name and the membership by its address,
    which may differ: one node left unmatched on each side is taken to be the same."""
    known = dict(history.domains) if history else {}
    nodes = {e.node for e in events}
    missing = sorted(nodes - known.keys())
    spare = sorted(known.keys() - nodes)
    if len(missing) == 1 and len(spare) == 1:
        known[missing[0]] = known[spare[0]]
    return known


def _kind(domain: FailureDomain | None, default_type: str | None, default_market: str | None) -> tuple[str, str]:
    if domain is not None and domain.market and domain.pool.endswith(":" + domain.market):
        return domain.pool[:-len(domain.market) - 1], domain.market
    return default_type or UNKNOWN, (domain.market if domain is not None and domain.market else
                                     default_market or UNKNOWN)


def stays(events: Sequence[MembershipEvent], history: RunHistory | None, now: float, running: bool,
          instance_type: str | None = None, market: str | None = None) -> list[Stay]:
    """Every node's stays in the job (see the module's doc); ``instance_type``/``market`` for nodes whose
    agents announced none."""
    domains = _domains(events, history)
    heard = sorted([e.time for e in events] + [p[0] for p in (history.points if history else ())])
    open_: dict[str, float] = {}
    out: list[Stay] = []

    def close(node: str, end: float, why: str) -> None:
        kind, bought = _kind(domains.get(node), instance_type, market)
        out.append(Stay(node, open_.pop(node), end, why, kind, bought))

    for event in events:
        if event.change == "joined":
            if event.node in open_:  # joined again, no end recorded: it went with its launcher
                before = [t for t in heard if open_[event.node] <= t < event.time]
                close(event.node, before[-1] if before else open_[event.node], "killed")
            open_[event.node] = event.time
        elif event.node in open_:
            close(event.node, event.time, _ENDS[event.change])
    last = heard[-1] if heard else now
    for node in list(open_):
        close(node, now if running else last, "running" if running else "killed")
    return sorted(out, key=lambda s: (s.start, s.node))


def _nodes_at(found: Sequence[Stay], when: float) -> int:
    return sum(s.start <= when <= s.end for s in found)


def _node_seconds_per_step(events: Sequence[MembershipEvent], history: RunHistory | None,
                           found: Sequence[Stay]) -> float | None:
    if history is None:
        return None
    changes = sorted(e.time for e in events if e.change in ("joined", "left", "died"))
    seconds = steps = 0.0
    points = list(history.points)
    for (t0, s0, w0), (t1, s1, w1) in zip(points, points[1:]):
        if s1 > s0 and w1 == w0 and t1 > t0 and not any(t0 < c <= t1 for c in changes):
            seconds += (t1 - t0) * max(1, _nodes_at(found, t1))
            steps += s1 - s0
    return seconds / steps if steps else None


def compute(job: str, events: Sequence[MembershipEvent], history: RunHistory | None, *, running: bool,
            prices: dict[tuple[str, str], float] | None = None, on_demand: str | None = None,
            instance_type: str | None = None, market: str | None = None, now: float | None = None) -> dict:
    """The report's object (``dashrun report --json``; the contract in docs/cost.md)."""
    now = time.time() if now is None else now
    found = stays(events, history, now, running, instance_type, market)
    if not found and history is None:
        raise UsageError(f"dash-memd has no run history of job {job!r}", hint="see the jobs with: dashrun status")
    node_seconds = sum(s.seconds for s in found)
    by_type: dict[str, float] = defaultdict(float)
    by_market: dict[str, float] = defaultdict(float)
    by_both: dict[str, float] = defaultdict(float)
    for stay in found:
        by_type[stay.instance_type] += stay.seconds / 3600
        by_market[stay.market] += stay.seconds / 3600
        by_both[f"{stay.instance_type}:{stay.market}"] += stay.seconds / 3600
    steps_done = history.steps_done if history else 0
    finished_at = [e.step for e in events if e.change == "finished" and e.step is not None]
    steps_done = max([steps_done, *(step + 1 for step in finished_at)])
    redone = history.redone if history else 0
    per_step = _node_seconds_per_step(events, history, found)
    largest = max([_nodes_at(found, s.start) for s in found] or [1])
    useful = steps_done * per_step if per_step is not None else 0.0
    restore = (history.restore_s * largest) if history else 0.0
    lost_redone = redone * per_step if per_step is not None else 0.0
    start = min((s.start for s in found), default=now)
    end = max((s.end for s in found), default=now)
    report = {
        "job": job, "steps_done": steps_done, "steps_redone": redone,
        "node_hours": {"total": node_seconds / 3600, "by_instance_type": dict(by_type),
                       "by_market": dict(by_market), "by_instance_type_and_market": dict(by_both)},
        "goodput": min(1.0, useful / node_seconds) if node_seconds > 0 else 0.0,
        "time_lost_s": {"redone": lost_redone, "restore": restore,
                        "other": max(0.0, node_seconds - useful - lost_redone - restore)},
        "node_seconds_per_step": per_step, "wall_s": max(0.0, end - start), "largest_world": largest,
        "restores": history.restores if history else 0,
        "preemptions": {"notice": sum(s.why == "notice" for s in found),
                        "killed": sum(s.why == "killed" for s in found)},
        "nodes": [dataclasses.asdict(s) for s in found],
        "points": [list(p) for p in history.points] if history else [],
    }
    if prices is not None:
        missing = sorted({k for k in by_both if tuple(k.rsplit(":", 1)) not in prices})
        if missing:
            raise UsageError(f"the price file has no price of {', '.join(missing)}",
                             hint="add a line instance_type,market,usd_per_hour for each (a node's type unknown "
                                  "to dash-memd: name it with --instance-type and --market)")
        report["cost_usd"] = sum(hours * prices[tuple(k.rsplit(":", 1))] for k, hours in by_both.items())
        if on_demand is not None:
            price = prices.get((on_demand, "on-demand"))
            if price is None:
                raise UsageError(f"the price file has no on-demand price of {on_demand}",
                                 hint=f"add the line {on_demand},on-demand,USD_PER_HOUR")
            report["on_demand_hours"] = useful / largest / 3600
            report["on_demand_cost_usd"] = useful / 3600 * price
            report["on_demand_instance_type"] = on_demand
    elif on_demand is not None:
        raise UsageError("--compare-on-demand needs --prices FILE", hint="a CSV of instance_type,market,usd_per_hour")
    return report
