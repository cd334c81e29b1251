"""Which members of a job's rendezvous are alive, judged by the job's own heartbeat settings.

torch's dynamic rendezvous state travels to dash-memd as JSON
(:func:`dashrun.launch.rendezvous.state_to_wire`); its ``last_heartbeats``
list each member's newest heartbeat as ``[addr, pid, local_id, epoch
seconds]``. Every set of the state also carries the sending node's heartbeat
settings under :data:`KEEP_ALIVE` (``--rdzv-conf keep_alive_interval`` and
``keep_alive_max_attempt``), so that whoever reads the state judges liveness
as the job's nodes do: dash-memd refusing to delete a job that runs, and a
node launched with ``--fresh`` deciding to join it rather than start over.

torch's rule: a member is dead once ``keep_alive_interval *
keep_alive_max_attempt`` seconds passed since its last heartbeat. Like torch,
this compares times stamped by the nodes' clocks with the reader's: the
clocks must agree within a fraction of that lapse. A closed rendezvous (the
job is done, or failed for good: its nodes stop) has no live member. A state
that names no settings was set by a dashrun that sent none, with dashrun's
defaults (:data:`DEFAULT_KEEP_ALIVE`). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses

from dashrun.util.boundedjson import loads_bounded

__all__ = ["DEFAULT_KEEP_ALIVE", "KEEP_ALIVE", "MAX_ATTEMPTS", "MAX_INTERVAL", "MAX_NODES", "KeepAlive", "Liveness",
           "liveness"]

#: The key of the heartbeat settings in the state's JSON: ``[keep_alive_interval, keep_alive_max_attempt]``.
KEEP_ALIVE = "keep_alive"
#: Bounds on the settings a state may name (a day between heartbeats, a thousand missed ones).
MAX_INTERVAL = 86400.0
MAX_ATTEMPTS = 1000
#: Most nodes in each list of a rendezvous state.
MAX_NODES = 4096


@dataclasses.dataclass(frozen=True)
class KeepAlive:
    """A job's heartbeat settings: a member heartbeats every ``interval`` seconds, and is dead after missing
    ``max_attempt`` of them. Raises ValueError outside the bounds."""

    interval: float
    max_attempt: int

    def __post_init__(self):
        if type(self.interval) not in (int, float) or not 0 < self.interval <= MAX_INTERVAL:
            raise ValueError(f"a keep-alive interval of {self.interval!r}: 0 to {MAX_INTERVAL:.0f} seconds expected")
        if type(self.max_attempt) is not int or not 1 <= self.max_attempt <= MAX_ATTEMPTS:
            raise ValueError(f"{self.max_attempt!r} keep-alive attempts: 1 to {MAX_ATTEMPTS} expected")

    @classmethod
    def bounded(cls, interval: float, max_attempt: int) -> KeepAlive:
        """Settings as a node was given them (whole numbers >= 1, unbounded), brought within the bounds."""
        return cls(float(min(max(interval, 1), MAX_INTERVAL)), int(min(max(max_attempt, 1), MAX_ATTEMPTS)))

    @property
    def lapse(self) -> float:
        """Seconds without a heartbeat after which a member is dead."""
        return self.interval * self.max_attempt

    def to_wire(self) -> list:
        return [self.interval, self.max_attempt]

    @classmethod
    def from_wire(cls, value) -> KeepAlive:
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError(f"field {KEEP_ALIVE!r} must be [interval, max_attempt]")
        return cls(value[0], value[1])


#: dashrun's own settings (``dashrun.launch.rendezvous.RDZV_DEFAULTS``): a member is dead after 5 s.
DEFAULT_KEEP_ALIVE = KeepAlive(1.0, 5)


@dataclasses.dataclass(frozen=True)
class Liveness:
    """What one rendezvous state says of its members at a moment: how many heartbeat within the lapse (none once
    the rendezvous is closed), and how long ago the newest heartbeat of any member was (None: no heartbeat)."""

    live: int
    newest_age: float | None
    keep_alive: KeepAlive


def liveness(state: bytes, now: float) -> Liveness:
    """Judge the members of a rendezvous state (its JSON) at ``now`` (epoch seconds). ValueError if it is not a
    state dashrun set (nobody can rendezvous on it then, so it protects nobody)."""
    raw = loads_bounded(state, max_depth=4)
    if not isinstance(raw, dict):
        raise ValueError("a rendezvous state must be an object")
    keep_alive = KeepAlive.from_wire(raw[KEEP_ALIVE]) if KEEP_ALIVE in raw else DEFAULT_KEEP_ALIVE
    beats = raw.get("last_heartbeats")
    if not isinstance(beats, list) or len(beats) > MAX_NODES:
        raise ValueError(f"'last_heartbeats' must be a list of at most {MAX_NODES} nodes")
    ages = []
    for beat in beats:
        if not isinstance(beat, list) or len(beat) != 4 or type(beat[3]) not in (int, float) \
                or not 0 <= beat[3] < 1e11:
            raise ValueError("a heartbeat must be [addr, pid, local_id, time]")
        ages.append(max(0.0, now - beat[3]))  # a node's clock a little ahead: a heartbeat just now
    live = 0 if raw.get("closed") is True else sum(age <= keep_alive.lapse for age in ages)
    return Liveness(live, min(ages, default=None), keep_alive)
