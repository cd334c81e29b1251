"""torch's own dynamic rendezvous, served by a real dash-memd: the backend and store of dashrun.launch.elastic.

Nodes here are rendezvous handlers in threads of the test (the elastic
launcher runs one per node); dash-memd is a real process, over TLS. What the
fleet tests rely on is checked here, quickly: nodes meet, each round gets a
fresh TCPStore, a node that leaves does not close the rendezvous, a silent
one is found dead, and the state outlives a dash-memd restart; a whole-job delete is refused while the job's
nodes heartbeat, judged by the job's own heartbeat settings.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from conftest import wait_for
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from dashrun.launch.elastic import LATE_HEARTBEATS
from dashrun.launch.options import LaunchOptions
from dashrun.errors import ConflictError
from dashrun.launch.rendezvous import (
    RDZV_DEFAULTS,
    MemdStore,
    create_handler,
    running_elsewhere,
    state_from_wire,
    state_to_wire,
)
from dashrun.wire.heartbeats import liveness
from dashrun.wire.messages import MAX_RDZV_WAIT, JobSpec
from dashrun.wire.tls import TlsSettings


def options_for(memd, job: str) -> LaunchOptions:
    return LaunchOptions(memd=(memd.host, memd.port), token_file=memd.token_file, job_id=job,
                         tls=TlsSettings(plaintext=bool(memd.tls_args)))


def handler_for(memd, job: str, node: int, min_nodes: int = 2, max_nodes: int = 3, **conf):
    params = RendezvousParameters(backend="dashrun", endpoint=memd.address, run_id=job, min_nodes=min_nodes,
                                  max_nodes=max_nodes, local_addr=f"127.0.0.{node}",
                                  **{**RDZV_DEFAULTS, "last_call_timeout": 1, **conf})
    return create_handler(options_for(memd, job), params)


def meet(handlers) -> list:
    """next_rendezvous() on every handler at once, as the nodes' launchers do."""
    infos: list = [None] * len(handlers)
    errors: list = []

    def join(i):
        try:
            infos[i] = handlers[i].next_rendezvous()
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(info is not None for info in infos)
    return infos


@pytest.fixture
def handlers():
    made = []
    yield made
    for handler in made:
        handler._stop_heartbeats()
        if isinstance(handler._store, MemdStore):
            handler._store.close()


def test_nodes_meet_through_dash_memd_and_share_a_store(memd, handlers):
    handlers += [handler_for(memd, "meet", node) for node in (1, 2)]
    infos = meet(handlers)
    assert sorted(info.rank for info in infos) == [0, 1]
    assert {info.world_size for info in infos} == {2}
    stores = {(info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) for info in infos}
    assert len(stores) == 1  # every node was told the same TCPStore, on rank 0's node
    infos[0].store.set("hello", b"from node 1")
    assert infos[1].store.get("hello") == b"from node 1"
    assert infos[1].store.add("count", 2) == 2 and infos[0].store.add("count", 3) == 5


def test_a_node_waiting_for_others_is_woken_by_their_change_not_by_torchs_next_poll(memd, handlers):
    """Where torch's rendezvous loop sleeps a second and then reads a cached state, dashrun's waits in dash-memd
    for the state to change: the waiting node sees the others' joins as they happen."""
    handlers += [handler_for(memd, "woken", node) for node in (1, 2)]
    backend = handlers[0]._op_executor._backend
    waits: list[tuple[float, bool]] = []
    original = backend.wait_for_change

    def recorded(token, seconds):
        # Each wait stretched to the longest dash-memd holds one: only a change answers it sooner.
        started = time.monotonic()
        original(token, MAX_RDZV_WAIT)
        waits.append((time.monotonic() - started, backend.get_state()[1] != token))

    backend.wait_for_change = recorded
    first = threading.Thread(target=lambda: handlers[0].next_rendezvous())
    first.start()
    wait_for(lambda: waits, 30, "the first node to wait for a second one")  # it alone is below MIN
    infos = meet(handlers[1:])
    first.join(30)
    assert not first.is_alive() and infos[0].world_size == 2
    woken = [took for took, changed in waits if changed]
    # Answered when node 2 changed the state: a wait that ran out would have taken MAX_RDZV_WAIT at least.
    assert woken and min(woken) < MAX_RDZV_WAIT, waits


def test_a_node_that_leaves_does_not_close_the_rendezvous(memd, handlers):
    handlers += [handler_for(memd, "leave", node) for node in (1, 2, 3)]
    first = meet(handlers)
    assert {info.world_size for info in first} == {3}
    first_round = handlers[0].round
    leaving = handlers.pop(2)
    leaving.leave()
    # torch's state holder serves a state up to 1 s old from its cache
    wait_for(lambda: [node.addr for node in handlers[0].departed()] == ["127.0.0.3"], 5, "the leaver to be gone")
    second = meet(handlers)
    assert {info.world_size for info in second} == {2}
    assert handlers[0].round > first_round
    old = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in first}
    new = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in second}
    assert old.isdisjoint(new)  # a fresh TCPStore for the new world


def test_after_a_change_the_round_closes_once_every_live_node_is_in_the_first_waits_its_last_call(memd, handlers):
    """The job's first round waits out its last call for nodes booting at about the same time; a round after a
    membership change closes as soon as every node that heartbeats is in it (nobody else is coming)."""
    # A last call far longer than meet()'s 60 s for each node: a round that waited it out would not be met.
    handlers += [handler_for(memd, "last-call", node, last_call_timeout=600) for node in (1, 2, 3)]
    early = threading.Thread(target=lambda: meet(handlers[:2]))
    early.start()
    backend = handlers[0]._op_executor._backend
    state = lambda: pickle.loads(backend.get_state()[0])  # noqa: E731
    wait_for(lambda: backend.get_state() is not None and len(state().participants) == 2, 30,
             "two nodes in the first round")
    assert not state().complete  # MIN is there; the first round waits for more
    third = handlers[2].next_rendezvous()
    early.join(60)
    assert third.world_size == 3
    leaving = handlers.pop(2)
    leaving.leave()
    wait_for(lambda: handlers[0].departed(), 10, "the leaver to be gone")
    infos = meet(handlers)  # not after the 600 s last call
    assert {info.world_size for info in infos} == {2}


def test_a_silent_node_is_found_dead_within_the_heartbeat_lapse(memd, handlers):
    handlers += [handler_for(memd, "silent", node, keep_alive_interval=1, keep_alive_max_attempt=3)
                 for node in (1, 2)]
    meet(handlers)
    assert handlers[0].departed() == []  # heartbeating: alive
    handlers[1]._stop_heartbeats()  # killed: its heartbeats stop, it says nothing
    # Found dead by the lapse of its heartbeats (3 s), polled with a deadline far past it.
    gone = wait_for(lambda: handlers[0].departed(), 60, "the silent node to be found dead")
    assert [node.addr for node in gone] == ["127.0.0.2"], gone


def test_the_rendezvous_outlives_a_dash_memd_restart(memd, handlers):
    handlers += [handler_for(memd, "restart", node) for node in (1, 2)]
    meet(handlers)
    round_before = handlers[0].round
    for handler in handlers:
        handler._stop_heartbeats()
    port = memd.port
    memd.stop()
    memd.start(port=port)
    again = [handler_for(memd, "restart", node) for node in (1, 2)]
    handlers += again
    meet(again)
    assert again[0].round > round_before  # the same rendezvous went on, not a new one from round 0


def test_store_get_waits_for_another_node(memd):
    options = options_for(memd, "store")
    a, b = MemdStore(options, timeout=timedelta(seconds=20)), MemdStore(options)
    try:
        got = []
        reader = threading.Thread(target=lambda: got.append(a.get("late")))
        reader.start()
        b.set("late", b"value")
        reader.join(timeout=20)
        assert got == [b"value"]
        short = MemdStore(options, timeout=timedelta(seconds=1))
        with pytest.raises(Exception, match="not set"):
            short.get("never")
        short.close()
    finally:
        a.close()
        b.close()


def test_the_state_travels_as_checked_json_never_as_a_pickle(memd, handlers):
    handlers += [handler_for(memd, "json", node) for node in (1, 2)]
    meet(handlers)
    with memd.client() as client:
        held, _token = client.rendezvous_get("json", "json")
    state = json.loads(held)  # what dash-memd holds, and what every node reads, is JSON
    assert sorted(p[0] for p in state["participants"]) == ["127.0.0.1", "127.0.0.2"]
    round_trip = pickle.loads(state_from_wire(state_to_wire(pickle.dumps(handlers[0]._state_holder.state))))
    assert round_trip.participants == handlers[0]._state_holder.state.participants
    assert round_trip.last_heartbeats == handlers[0]._state_holder.state.last_heartbeats


@pytest.mark.parametrize("held", [
    pickle.dumps({"round": 1}),                                             # a pickle is never loaded
    b'{"round": 1}',                                                        # fields missing
    json.dumps({"round": -1, "complete": False, "closed": False, "deadline": None, "participants": [],
                "wait_list": [], "redundancy_list": [], "last_heartbeats": []}).encode(),
    json.dumps({"round": 1, "complete": False, "closed": False, "deadline": None,
                "participants": [["x" * 300, 1, 0, 0]], "wait_list": [], "redundancy_list": [],
                "last_heartbeats": []}).encode(),
    b"[" * 100 + b"]" * 100,                                                # nested too deep
])
def test_a_state_that_is_not_torchs_is_refused_in_one_line(held):
    with pytest.raises(RendezvousStateError) as caught:
        state_from_wire(held)
    assert "\n" not in str(caught.value)


def test_after_a_failure_a_late_member_is_evicted_at_once_a_live_one_never(memd, handlers):
    handlers += [handler_for(memd, "late", node) for node in (1, 2)]
    meet(handlers)
    late = timedelta(seconds=RDZV_DEFAULTS["keep_alive_interval"] * LATE_HEARTBEATS)
    assert handlers[0].evict_late(late) == []  # both heartbeat every second
    handlers[1]._stop_heartbeats()
    evicted = wait_for(lambda: handlers[0].evict_late(late), 10, "the late member to be evicted")
    assert [node.addr for node in evicted] == ["127.0.0.2"]
    assert [node.addr for node in handlers[0].departed()] == ["127.0.0.2"]


# --- a whole-job delete (dashrun rm, --fresh) while the job's nodes are alive --------------------------------


def set_member(backend, age: float, token=None):
    """Set a rendezvous state through the job's backend: one member, whose last heartbeat is ``age`` seconds old."""
    state = _RendezvousState()
    node = _NodeDesc("127.0.0.9", 4242, 0)
    state.round, state.complete = 1, True
    state.participants = {node: 0}
    state.last_heartbeats = {node: datetime.now(timezone.utc) - timedelta(seconds=age)}
    _held, token, was_set = backend.set_state(pickle.dumps(state), token)
    assert was_set
    return token


def test_a_whole_job_delete_is_refused_while_its_nodes_heartbeat_unless_forced(memd, handlers):
    handlers += [handler_for(memd, "live", node) for node in (1, 2)]
    meet(handlers)  # both nodes heartbeat every second from now on
    with memd.client() as client:
        client.put_spec("live", JobSpec(("train.py",), "/w", "n1", 1.0))
        with pytest.raises(ConflictError, match=r"live has 2 live nodes \(last heartbeat \d+s ago\): stop them "
                                                r"first, or delete it anyway with: dashrun rm \S+ --force-live"):
            client.delete("live")
        assert client.rendezvous_get("live", "live") is not None and client.get_spec("live") is not None
        assert client.delete("live", keep=1) == []  # gc deletes no job: the nodes go on
        for handler in handlers:  # still alive by their last heartbeats, but none sets the state once it is gone
            handler._stop_heartbeats()
        client.delete("live", force_live=True)
        assert client.rendezvous_get("live", "live") is None and client.get_spec("live") is None


def test_liveness_is_judged_by_the_jobs_own_keep_alive_not_the_default(memd, handlers):
    # keep_alive 10 s x 3: a member is dead only after 30 s without a heartbeat (dashrun's default: 5 s).
    handlers.append(handler_for(memd, "slow", 1, keep_alive_interval=10, keep_alive_max_attempt=3))
    backend = handlers[0]._state_holder._backend
    token = set_member(backend, age=10)
    with memd.client() as client:
        assert running_elsewhere(client, "slow", "slow")  # a node started with --fresh joins it
        with pytest.raises(ConflictError, match=r"slow has 1 live node \(last heartbeat 1\ds ago\)"):
            client.delete("slow")
        set_member(backend, age=40, token=token)  # now it is dead by the job's settings too
        assert not running_elsewhere(client, "slow", "slow")
        client.delete("slow")
        assert client.rendezvous_get("slow", "slow") is None


def test_liveness_takes_the_settings_the_state_names_and_a_closed_rendezvous_has_no_live_member():
    now = time.time()

    def state(**fields) -> bytes:
        beats = [["10.0.0.1", 7, 0, now - 10], ["10.0.0.2", 7, 0, now - 100]]
        return json.dumps({"round": 3, "closed": False, "last_heartbeats": beats, **fields}).encode()

    assert liveness(state(), now).live == 0  # no settings named: dashrun's default, dead after 5 s
    found = liveness(state(keep_alive=[10, 3]), now)
    assert (found.live, round(found.newest_age), found.keep_alive.lapse) == (1, 10, 30)
    assert liveness(state(keep_alive=[10, 3], closed=True), now).live == 0  # the job is done: its nodes stop
    for bad in ([0, 3], [10, 0], [1e9, 3], [10, 3.5], [True, 3], "10,3", [10]):
        with pytest.raises(ValueError):
            liveness(state(keep_alive=bad), now)


def test_dashrun_rm_refuses_a_live_job_and_force_live_removes_it(memd, handlers):
    handlers.append(handler_for(memd, "cli-live", 1))
    set_member(handlers[0]._state_holder._backend, age=0)
    command = [sys.executable, "-m", "dashrun", "rm", "cli-live", "--memd", memd.address, "--token-file",
               str(memd.token_file), *memd.tls_args]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "cli-live has 1 live node" in refused.stderr, refused.stderr
    assert "--force-live" in refused.stderr
    forced = subprocess.run([*command, "--force-live"], capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    with memd.client() as client:
        assert client.rendezvous_get("cli-live", "cli-live") is None
