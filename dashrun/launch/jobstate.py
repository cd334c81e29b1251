"""A job's state as ``dashrun status`` shows it, read from the facts dash-memd holds: its membership history
(:class:`~dashrun.wire.messages.MembershipEvent`, which the launcher ends with ``finished`` or ``failed``) and
how many of its nodes heartbeat in its rendezvous now."""

from __future__ import annotations

import enum
from typing import Sequence

from dashrun.wire.messages import MembershipEvent

__all__ = ["JobState", "job_state", "node_states", "restarts", "steps_per_second"]

#: A node's state as its last membership event says it: up (joined), left (its notice), died (gone without one).
NODE_STATES = {"joined": "up", "left": "left", "died": "died"}


class JobState(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    PREEMPTED = "preempted"
    FAILED = "failed"
    IDLE = "idle"


def job_state(events: Sequence[MembershipEvent], live: int | None) -> JobState:
    """The state of a job whose membership history is ``events`` (oldest first) and of whose rendezvous ``live``
    members heartbeat now (None: it has no rendezvous in dash-memd, as a job that is not elastic has none).

    * running: a member heartbeats now; or, without a rendezvous to tell, the last event is a node that joined
      (the launcher records its end, so a launch that recorded none is taken to be running).
    * finished / failed: the last event is a launch that ended, its ranks exiting 0 / non-zero.
    * preempted: the last event is a node that left (its notice) or died (gone without one), and no node
      joined since: the job shrank to nothing, and can be resumed from its newest checkpoint.
    * idle: nothing recorded, or a node joined and no member heartbeats now and no end was recorded (the
      launcher was killed, say).
    """
    if live:
        return JobState.RUNNING
    if not events:
        return JobState.IDLE
    last = events[-1].change
    if last == "finished":
        return JobState.FINISHED
    if last == "failed":
        return JobState.FAILED
    if last in ("left", "died"):
        return JobState.PREEMPTED
    return JobState.RUNNING if live is None else JobState.IDLE


def restarts(events: Sequence[MembershipEvent]) -> int:
    """How often the job was started again after it had stopped: the ``joined`` events that follow a ``left``,
    ``died``, ``finished`` or ``failed`` one (a resume after a preemption, a relaunch after a failure)."""
    count, stopped = 0, False
    for event in events:
        if event.change == "joined":
            count += stopped
            stopped = False
        else:
            stopped = True
    return count


def steps_per_second(checkpoints: Sequence[dict]) -> float | None:
    """The job's training speed between its oldest and newest listed checkpoints (as LIST gives them, oldest
    first); None with fewer than two, or none apart in time."""
    if len(checkpoints) < 2:
        return None
    first, last = checkpoints[0], checkpoints[-1]
    seconds = last["committed_at"] - first["committed_at"]
    return (last["step"] - first["step"]) / seconds if seconds > 0 else None


def node_states(events: Sequence[MembershipEvent]) -> dict[str, str]:
    """Each node's state by its last ``joined``, ``left`` or ``died`` event (:data:`NODE_STATES`), in the order
    the nodes first appear; a launch's end (``finished``, ``failed``) leaves every node that was up in that
    state."""
    states: dict[str, str] = {}
    for event in events:
        if event.change in NODE_STATES:
            states[event.node] = NODE_STATES[event.change]
        elif event.change in ("finished", "failed"):
            states = {node: event.change if state == "up" else state for node, state in states.items()}
    return states
