"""``dashrun sim``: a discrete-event simulation of a job on Spot nodes, to choose its checkpoint interval.

The model (docs/cost.md says it in full):

- The job has ``steps`` steps of ``step_time`` seconds at ``max_nodes``
  nodes (a world of ``w`` nodes takes ``step_time * max_nodes / w``: the same
  work on fewer nodes). It checkpoints after every ``I``-th step (``I``: the
  interval in seconds over the step time, at least 1), each checkpoint adding
  ``checkpoint_cost`` seconds; it starts ``startup`` seconds after its nodes.
- A node of the world that is taken back rolls the job back to its newest
  checkpoint (the steps since are lost) unless it had a notice long enough for
  an emergency checkpoint; either way the job restarts, ``restore_time``
  seconds, in the world that is left, and waits while it has fewer than
  ``min_nodes``. A node that arrives joins at the next checkpoint, which costs
  a restart too.
- Nodes live as the preemption model draws: exponential lifetimes of mean
  ``mtbf`` (each node's), an hourly hazard table, a lifetime cap (GCE's
  24 h), alone or a cap with one of the others; a node taken back is replaced
  ``replace_time`` seconds later. Or a replayed trace of ``time,node,event``,
  which says when each node goes and comes.

Every random draw comes from the seed: node slot ``s`` of run ``r`` draws from
its own generator seeded with ``(seed, r, s)``, so every interval of a sweep
meets the same preemptions (common random numbers: the curve over intervals
is smooth where the runs' noise would hide its minimum). With no preemptions
a run takes exactly ``startup + steps * step_time + checkpoints *
checkpoint_cost``.

The recommended interval is the minimum of ``a/τ + b·τ + c`` fitted (least
squares) to the sweep's mean times: near the optimum the simulated times differ
by less than their noise, and the fit smooths it; where the fit has no minimum
(no preemptions) it is the swept interval of the least mean time.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from typing import Iterable, Sequence

from dashrun.errors import UsageError

__all__ = ["JOIN_EVENTS", "KILL_EVENTS", "MAX_HAZARD_HOURS", "NOTICE_EVENTS", "Lifetimes", "Outcome", "Point",
           "SimConfig", "Sweep", "TraceEvent", "simulate", "sweep", "sweep_intervals", "young_daly"]

#: Hours of a hazard table at most.
MAX_HAZARD_HOURS = 100_000
#: Node losses one run may take before it is called hopeless (a job that never outruns its preemptions).
MAX_LOSSES = 1_000_000
#: How a trace may name a node's going (``notice``: it had one, and checkpointed) and coming.
NOTICE_EVENTS = frozenset({"notice", "left"})
KILL_EVENTS = frozenset({"killed", "died", "preempted"})
JOIN_EVENTS = frozenset({"joined", "join"})


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    time: float
    node: str
    event: str


@dataclasses.dataclass(frozen=True)
class Lifetimes:
    """A preemption model: how long a node lives once it runs. ``mtbf`` or ``hazard`` (probability of being taken
    in each hour of a node's life; the last hour's repeats), capped by ``max_lifetime``; none of them: forever."""

    mtbf: float | None = None
    hazard: tuple[float, ...] = ()
    max_lifetime: float | None = None

    def __post_init__(self) -> None:
        if self.mtbf is not None and self.hazard:
            raise UsageError("--mtbf and --hazard are two preemption models", hint="give one of them")
        for name in ("mtbf", "max_lifetime"):
            value = getattr(self, name)
            if value is not None and not (0 < value < math.inf):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds")

    @property
    def preempts(self) -> bool:
        return self.mtbf is not None or any(p > 0 for p in self.hazard) or self.max_lifetime is not None

    def draw(self, rng: random.Random) -> float:
        life = math.inf
        if self.mtbf is not None:
            life = rng.expovariate(1.0 / self.mtbf)
        elif self.hazard:
            life = _hazard_lifetime(self.hazard, rng)
        return life if self.max_lifetime is None else min(life, self.max_lifetime)


def _hazard_lifetime(hazard: Sequence[float], rng: random.Random) -> float:
    for hour in range(MAX_HAZARD_HOURS * 10):
        p = hazard[min(hour, len(hazard) - 1)]
        if hour >= len(hazard) - 1 and p <= 0:
            return math.inf
        if rng.random() < p:
            return (hour + rng.random()) * 3600.0
    return math.inf


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One job to simulate. Times in seconds; ``price_per_hour`` in USD per node-hour (None: no cost)."""

    steps: int
    step_time: float
    checkpoint_cost: float = 0.0
    restore_time: float = 0.0
    min_nodes: int = 1
    max_nodes: int = 1
    startup: float = 0.0
    replace_time: float = 0.0
    notice: float = 0.0
    price_per_hour: float | None = None
    lifetimes: Lifetimes = Lifetimes()
    trace: tuple[TraceEvent, ...] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= 10**12:
            raise UsageError("--steps must be a whole number from 1 to 10^12")
        if not 0 < self.step_time < math.inf:
            raise UsageError("--step-time must be a positive number of seconds")
        for name in ("checkpoint_cost", "restore_time", "startup", "replace_time", "notice"):
            if not 0 <= getattr(self, name) < math.inf:
                raise UsageError(f"--{name.replace('_', '-')} must be a number of seconds, 0 or more")
        if not 1 <= self.min_nodes <= self.max_nodes <= 100_000:
            raise UsageError(f"--nodes {self.min_nodes}:{self.max_nodes} is not MIN:MAX with 1 <= MIN <= MAX")
        if self.price_per_hour is not None and not 0 <= self.price_per_hour < math.inf:
            raise UsageError("--price must be USD per node-hour, 0 or more")
        if self.trace is not None and self.lifetimes.preempts:
            raise UsageError("--trace replays the preemptions: it takes no --mtbf, --hazard or --max-lifetime",
                             hint="give the trace, or a model")

    @property
    def preempts(self) -> bool:
        return self.trace is not None or self.lifetimes.preempts

    def interval_steps(self, interval_s: float) -> int:
        return max(1, min(self.steps, round(interval_s / self.step_time)))

    def plain_time(self, interval_steps: int) -> float:
        """The run's length with no preemptions."""
        return self.startup + self.steps * self.step_time + (self.steps // interval_steps) * self.checkpoint_cost


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One simulated run."""

    time_s: float
    node_seconds: float
    steps_lost: int
    preemptions: int


# --- one run ---------------------------------------------------------------------------------------


class _Run:
    """One run of ``config`` at a checkpoint every ``every`` steps (see the module's doc for the model)."""

    def __init__(self, config: SimConfig, every: int, seed: int, run: int):
        self.c, self.every = config, every
        self.seed, self.run = seed, run
        self.events: list[tuple[float, int, str, str, bool]] = []  # (time, seq, "loss"|"arrive", node, noticed)
        self.seq = 0
        self.alive: dict[str, float] = {}         # node -> when this life of it began
        self.lives: list[tuple[float, float]] = []  # (began, ended) of every life that ended
        self.world: list[str] = []
        self.spares: list[str] = []
        self.rngs: dict[str, random.Random] = {}

    # nodes

    def _push(self, when: float, kind: str, node: str, noticed: bool = False) -> None:
        heapq.heappush(self.events, (when, self.seq, kind, node, noticed))
        self.seq += 1

    def _arrive(self, node: str, now: float) -> None:
        self.alive[node] = now
        if self.c.trace is None:
            rng = self.rngs.setdefault(node, random.Random(f"{self.seed}/{self.run}/{node}"))
            life = self.c.lifetimes.draw(rng)
            if life < math.inf:
                self._push(now + life, "loss", node, self.c.notice >= self.c.checkpoint_cost and self.c.notice > 0)

    def _depart(self, node: str, now: float) -> None:
        self.lives.append((self.alive.pop(node), now))
        if self.c.trace is None:
            self._push(now + self.c.replace_time, "arrive", node)

    def _start_fleet(self) -> None:
        if self.c.trace is None:
            for slot in range(self.c.max_nodes):
                self._arrive(str(slot), 0.0)
            self.world = [str(slot) for slot in range(self.c.max_nodes)]
            return
        first: dict[str, TraceEvent] = {}
        for event in self.c.trace:
            first.setdefault(event.node, event)
        for node, event in first.items():
            # its first word is that it went, or that it joined at 0: it ran from the start
            if event.event not in JOIN_EVENTS or event.time == 0:
                self.alive[node] = 0.0
        for event in self.c.trace:
            joins = event.event in JOIN_EVENTS
            if joins and event.time == 0 and first[event.node] is event:
                continue
            self._push(event.time, "arrive" if joins else "loss", event.node, event.event in NOTICE_EVENTS)
        nodes = sorted(self.alive)
        self.world, self.spares = nodes[:self.c.max_nodes], nodes[self.c.max_nodes:]

    # the job's progress, in closed form between events

    def _step_time(self) -> float:
        w = len(self.world)
        return self.c.step_time if w == self.c.max_nodes else self.c.step_time * self.c.max_nodes / w

    def _finish(self, ready: float, k: int) -> float:
        c = self.c
        return ready + (c.steps - k) * self._step_time() + (c.steps // self.every - k // self.every) * c.checkpoint_cost

    def _advance(self, k: int, elapsed: float) -> tuple[int, int]:
        """(steps done, newest checkpointed step) ``elapsed`` seconds after the job went on from step ``k``."""
        c, every, tw = self.c, self.every, self._step_time()
        s, committed, left = k, k, elapsed
        period = every * tw + c.checkpoint_cost
        while s < c.steps:
            if s % every == 0 and s + every <= c.steps and left >= period:  # whole periods at once
                n = min(int(left // period), (c.steps - s) // every)
                s += n * every
                committed = s
                left -= n * period
                continue
            nxt = min((s // every + 1) * every, c.steps)
            span = (nxt - s) * tw
            if left < span:
                return s + min(nxt - s - 1, int(left // tw)), committed
            left -= span
            s = nxt
            if s % every == 0:
                if left < c.checkpoint_cost:
                    return s, committed
                left -= c.checkpoint_cost
                committed = s
        return s, committed

    def _boundary(self, ready: float, k: int, after: float) -> tuple[float, int] | None:
        """The first checkpoint that completes at or after ``after``: (when, its step); None if none does."""
        c, tw = self.c, self._step_time()
        first = (k // self.every + 1) * self.every
        if first > c.steps:
            return None
        done = ready + (first - k) * tw + c.checkpoint_cost
        if done < after:
            period = self.every * tw + c.checkpoint_cost
            n = math.ceil((after - done) / period)
            done, first = done + n * period, first + n * self.every
            if first > c.steps:
                return None
        return done, first

    def go(self) -> Outcome:
        c = self.c
        self._start_fleet()
        k, lost, losses = 0, 0, 0
        ready: float | None = c.startup if len(self.world) >= c.min_nodes else None  # None: waiting for nodes
        now = 0.0
        while True:
            finish = self._finish(ready, k) if ready is not None else math.inf
            join = None
            if ready is not None and self.spares and len(self.world) < c.max_nodes:
                join = self._boundary(ready, k, max(now, ready))
            event_at = self.events[0][0] if self.events else math.inf
            if finish < math.inf and finish <= event_at and (join is None or finish <= join[0]):
                return self._outcome(finish, lost, losses)
            if join is not None and join[0] < event_at:
                now, k = join
                room = c.max_nodes - len(self.world)
                self.world += self.spares[:room]
                del self.spares[:room]
                ready = now + c.restore_time
                continue
            if not self.events:
                raise UsageError(f"the job never has {c.min_nodes} nodes again: it cannot finish",
                                 hint="a trace needs nodes that join after the ones it takes")
            now, _, kind, node, noticed = heapq.heappop(self.events)
            if kind == "arrive":
                if node in self.alive:
                    continue
                self._arrive(node, now)
                self.spares.append(node)
                if ready is None and len(self.world) < c.max_nodes:
                    self.world.append(self.spares.pop())
                    if len(self.world) >= c.min_nodes:
                        ready = now + c.restore_time
                continue
            if node not in self.alive:
                continue
            self._depart(node, now)
            if node in self.spares:
                self.spares.remove(node)
                continue
            losses += 1
            if losses > MAX_LOSSES:
                raise UsageError(f"the job loses more than {MAX_LOSSES} nodes without finishing",
                                 hint="preemptions come faster than it can checkpoint: a longer MTBF, or shorter "
                                      "steps")
            if ready is not None and now > ready:
                done, committed = self._advance(k, now - ready)
                if noticed:
                    committed = done  # an emergency checkpoint within the notice
                lost += done - committed
                k = committed
            self.world.remove(node)
            while self.spares and len(self.world) < c.max_nodes:
                self.world.append(self.spares.pop(0))
            ready = now + c.restore_time if len(self.world) >= c.min_nodes else None

    def _outcome(self, end: float, lost: int, losses: int) -> Outcome:
        seconds = sum(min(ended, end) - began for began, ended in self.lives if began < end)
        seconds += sum(end - began for began in self.alive.values() if began < end)
        return Outcome(end, seconds, lost, losses)


def simulate(config: SimConfig, interval_steps: int, seed: int = 0, run: int = 0) -> Outcome:
    """One run of ``config`` checkpointing every ``interval_steps`` steps, its draws from ``seed`` and ``run``."""
    return _Run(config, interval_steps, seed, run).go()


# --- a sweep ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """The mean of ``runs`` runs at one interval."""

    interval_s: float
    interval_steps: int
    time_s: float
    cost_usd: float | None
    goodput: float
    steps_lost: float
    preemptions: float

    def to_body(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Sweep:
    points: tuple[Point, ...]
    recommended_interval_s: float
    young_daly_s: float | None
    runs: int
    seed: int

    def to_body(self) -> dict:
        return {"intervals": [p.to_body() for p in self.points], "recommended_interval_s": self.recommended_interval_s,
                "young_daly_s": self.young_daly_s, "runs": self.runs, "seed": self.seed}


def young_daly(config: SimConfig) -> float | None:
    """Young/Daly's √(2·C·MTBF) with the job's MTBF (each node's over the number of nodes); None where the model
    has no MTBF or checkpoints cost nothing."""
    if config.lifetimes.mtbf is None or config.trace is not None or config.checkpoint_cost <= 0:
        return None
    return math.sqrt(2 * config.checkpoint_cost * config.lifetimes.mtbf / config.max_nodes)


def sweep_intervals(config: SimConfig, seed: int = 0, count: int = 17) -> list[float]:
    """The intervals swept when none is given: around Young/Daly's with the job's MTBF (estimated from the model
    or the trace), else from 10 steps to the whole run."""
    plain = config.steps * config.step_time
    mtbf = _job_mtbf(config, seed)
    if mtbf is not None and config.checkpoint_cost > 0:
        centre = math.sqrt(2 * config.checkpoint_cost * mtbf)
        low, high = centre / 4, centre * 4
    else:
        low, high = 10 * config.step_time, plain
    low = max(config.step_time, min(low, plain))
    high = max(low, min(high, plain))
    return sorted({low * (high / low) ** (i / (count - 1)) for i in range(count)})


def _job_mtbf(config: SimConfig, seed: int) -> float | None:
    if config.trace is not None:
        losses = sum(1 for e in config.trace if e.event not in JOIN_EVENTS)
        span = max((e.time for e in config.trace), default=0.0)
        return span / losses if losses and span > 0 else None
    if not config.lifetimes.preempts:
        return None
    rng = random.Random(f"{seed}/mtbf")
    draws = [min(config.lifetimes.draw(rng), 1e9) for _ in range(2000)]
    return sum(draws) / len(draws) / config.max_nodes


def sweep(config: SimConfig, intervals: Iterable[float], *, runs: int = 20, seed: int = 0) -> Sweep:
    """Simulate ``runs`` runs at each interval (seconds; intervals that round to the same number of steps are
    one) and recommend one."""
    if not 1 <= runs <= 100_000:
        raise UsageError("--runs must be from 1 to 100000")
    every = sorted({config.interval_steps(s) for s in intervals})
    if not every:
        raise UsageError("no checkpoint interval to simulate")
    runs = runs if config.preempts and config.trace is None else 1  # nothing random: one run says it all
    useful = config.steps * config.step_time * config.max_nodes
    points = []
    for steps in every:
        outcomes = [simulate(config, steps, seed, run) for run in range(runs)]
        time_s = sum(o.time_s for o in outcomes) / runs
        node_seconds = sum(o.node_seconds for o in outcomes) / runs
        points.append(Point(
            interval_s=steps * config.step_time, interval_steps=steps, time_s=time_s,
            cost_usd=None if config.price_per_hour is None else node_seconds / 3600 * config.price_per_hour,
            goodput=min(1.0, useful / node_seconds) if node_seconds > 0 else 0.0,
            steps_lost=sum(o.steps_lost for o in outcomes) / runs,
            preemptions=sum(o.preemptions for o in outcomes) / runs))
    return Sweep(tuple(points), _recommend(points), young_daly(config), runs, seed)


def _recommend(points: Sequence[Point]) -> float:
    best = min(points, key=lambda p: (p.time_s, -p.interval_s))
    if len(points) < 3:
        return best.interval_s
    fitted = _fit(points)
    if fitted is None:
        return best.interval_s
    a, b = fitted
    low, high = points[0].interval_s, points[-1].interval_s
    return min(high, max(low, math.sqrt(a / b)))


def _fit(points: Sequence[Point]) -> tuple[float, float] | None:
    """(a, b) of time ≈ a/τ + b·τ + c by least squares; None where that curve has no minimum."""
    rows = [(1 / p.interval_s, p.interval_s, 1.0) for p in points]
    ys = [p.time_s for p in points]
    # normal equations, 3×3, solved by Cramer's rule
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
    det = _det3(m)
    if det == 0 or not math.isfinite(det):
        return None
    a = _det3([[v[i] if j == 0 else m[i][j] for j in range(3)] for i in range(3)]) / det
    b = _det3([[v[i] if j == 1 else m[i][j] for j in range(3)] for i in range(3)]) / det
    return (a, b) if a > 0 and b > 0 else None


def _det3(m: Sequence[Sequence[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
