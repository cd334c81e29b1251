"""A job's state, restarts and speed as ``dashrun status`` shows them, from event sequences alone."""

from __future__ import annotations

import pytest

from dashrun.launch.jobstate import JobState, job_state, node_states, restarts, steps_per_second
from dashrun.wire.messages import MembershipEvent


def events(*changes: str) -> list[MembershipEvent]:
    return [MembershipEvent(float(i), "node-a", change, "", 1, 0) for i, change in enumerate(changes)]


@pytest.mark.parametrize("changes, live, state", [
    ((), None, JobState.IDLE),
    ((), 0, JobState.IDLE),
    (("joined",), None, JobState.RUNNING),         # not elastic: the launcher records its end, none yet
    (("joined",), 2, JobState.RUNNING),
    (("joined",), 0, JobState.IDLE),               # elastic, nobody heartbeats, no end recorded: killed
    (("joined", "finished"), None, JobState.FINISHED),
    (("joined", "failed"), None, JobState.FAILED),
    (("joined", "left"), None, JobState.PREEMPTED),
    (("joined", "died"), 0, JobState.PREEMPTED),
    (("joined", "left", "joined"), None, JobState.RUNNING),  # rejoined after the notice
    (("joined", "left", "joined", "finished"), None, JobState.FINISHED),
    (("joined", "failed", "joined", "finished"), None, JobState.FINISHED),
    (("joined", "finished", "joined", "failed"), None, JobState.FAILED),
    (("joined", "died"), 1, JobState.RUNNING),     # a node died, the others go on
    (("joined", "finished"), 1, JobState.RUNNING),  # relaunched, its join not recorded yet
], ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v))
def test_the_state_of_a_job_follows_its_last_event_and_its_live_members(changes, live, state):
    assert job_state(events(*changes), live) is state


def test_restarts_count_the_starts_that_follow_a_stop():
    assert restarts(events()) == 0
    assert restarts(events("joined", "joined")) == 0  # two nodes of one start
    assert restarts(events("joined", "left", "joined", "died", "joined", "finished")) == 2
    assert restarts(events("joined", "failed", "joined")) == 1


def test_steps_per_second_between_the_oldest_and_newest_checkpoints():
    assert steps_per_second([]) is None
    assert steps_per_second([{"step": 4, "committed_at": 10.0}]) is None
    assert steps_per_second([{"step": 4, "committed_at": 10.0}, {"step": 9, "committed_at": 10.0}]) is None
    assert steps_per_second([{"step": 4, "committed_at": 10.0}, {"step": 6, "committed_at": 11.0},
                             {"step": 24, "committed_at": 14.0}]) == 5.0


def test_each_node_has_the_state_of_its_last_membership_event():
    history = [MembershipEvent(float(i), node, change, "", 1, 0) for i, (node, change) in enumerate(
        [("a", "joined"), ("b", "joined"), ("c", "joined"), ("b", "left"), ("c", "died"), ("c", "joined")])]
    assert node_states(history) == {"a": "up", "b": "left", "c": "up"}
    ended = history + [MembershipEvent(9.0, "a", "finished", "", 2, 0)]
    assert node_states(ended) == {"a": "finished", "b": "left", "c": "finished"}  # the launch's end: every node up
    assert node_states([]) == {}
