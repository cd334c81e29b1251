"""dash-memd's fleet view, end to end against a real dash-memd (TLS on): the rendezvous state (compare-and-set on
a fencing token, persisted), the jobs' key/value store, the world generation fence, the membership history."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for

from dashrun.errors import ConflictError, NoSpaceError, ProtocolError
from dashrun.memd.fleet.rendezvous import MAX_RUN_IDS
from dashrun.wire.memd_client import StoreTimeoutError
from dashrun.wire.messages import (
    MAX_RDZV_STATE,
    MAX_RDZV_WAIT,
    MAX_STORE_JOB_BYTES,
    MAX_STORE_KEY,
    MAX_STORE_KEYS,
    MAX_STORE_VALUE,
    MembershipEvent,
    ShardHeader,
)

LAYOUT = "ab" * 32


def dashrun_status(memd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun", "status", *args, "--memd", memd.address, "--token-file",
                           str(memd.token_file), *memd.tls_args], capture_output=True, text=True, timeout=120)


# --- the rendezvous state ----------------------------------------------------------------------


def test_rendezvous_state_is_set_by_compare_and_set_and_a_racer_with_a_stale_token_loses(memd):
    with memd.client() as a, memd.client() as b:
        assert a.rendezvous_get("rj", "run") is None
        assert a.rendezvous_set("rj", "run", b"stale", 7) is None  # a token, but no state: torch's answer
        state, first, won = a.rendezvous_set("rj", "run", b"from a", None)
        assert (state, won) == (b"from a", True) and first > 0
        # b raced a to create the state, and lost: it is told what a set
        assert b.rendezvous_set("rj", "run", b"from b", None) == (b"from a", first, False)
        assert b.rendezvous_get("rj", "run") == (b"from a", first)
        # b, now holding the current token, wins; a still holds the old one and loses
        state, second, won = b.rendezvous_set("rj", "run", b"from b", first)
        assert (state, won) == (b"from b", True) and second > first
        assert a.rendezvous_set("rj", "run", b"a again", first) == (b"from b", second, False)
        assert a.rendezvous_get("rj", "run") == (b"from b", second)
        # another run id, another job: their own states
        assert a.rendezvous_get("rj", "other") is None and a.rendezvous_get("other-job", "run") is None


def test_of_many_nodes_setting_the_state_with_the_same_token_at_once_exactly_one_wins(memd):
    with memd.client() as client:
        _, token, _ = client.rendezvous_set("race", "run", b"round 0", None)
    results: list[tuple[bytes, int, bool]] = []

    def node(i: int) -> None:
        with memd.client() as c:
            results.append(c.rendezvous_set("race", "run", f"node {i}".encode(), token))

    threads = [threading.Thread(target=node, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [r for r in results if r[2]]
    assert len(results) == 8 and len(winners) == 1
    assert all(r[:2] == winners[0][:2] for r in results)  # every loser is told the winner's state and token
    assert winners[0][1] > token


def test_rendezvous_bounds_are_refused_and_the_connection_serves_on(memd):
    with memd.client() as client:
        with pytest.raises(NoSpaceError, match="exceeds"):
            client.rendezvous_set("big", "run", b"x" * (MAX_RDZV_STATE + 1), None)
        assert client.rendezvous_set("big", "run", b"x" * MAX_RDZV_STATE, None)[2]
        for i in range(1, MAX_RUN_IDS):
            assert client.rendezvous_set("big", f"run-{i}", b"s", None)[2]
        with pytest.raises(NoSpaceError, match="run ids"):
            client.rendezvous_set("big", "one-too-many", b"s", None)
        assert client.rendezvous_get("big", "run")[0] == b"x" * MAX_RDZV_STATE


def test_a_rendezvous_read_waits_for_another_nodes_change_up_to_its_bound(memd):
    """A node polling for a change (torch's loop reads again every second) is held in dash-memd until the token
    moves: answered at once when another node sets the state, after ``wait`` when none does."""
    with memd.client() as a, memd.client() as b:
        _, first, _ = a.rendezvous_set("watch", "run", b"round 0", None)
        started = time.monotonic()
        assert b.rendezvous_get("watch", "run", unlike=first, wait=0.5) == (b"round 0", first)
        assert time.monotonic() - started >= 0.45  # held for its wait: nothing changed
        assert b.rendezvous_get("watch", "run", unlike=first + 1, wait=5) == (b"round 0", first)  # differs: now

        answers: list = []
        waiter = threading.Thread(target=lambda: answers.append(
            (b.rendezvous_get("watch", "run", first, wait=MAX_RDZV_WAIT), time.monotonic())))
        started = time.monotonic()
        waiter.start()
        _, second, _ = a.rendezvous_set("watch", "run", b"round 1", first)
        waiter.join(MAX_RDZV_WAIT + 60)
        (answer, answered_at), = answers
        # Woken by the set: dash-memd's own deadline (MAX_RDZV_WAIT from when the request reached it, after
        # `started`) would have answered no earlier than started + MAX_RDZV_WAIT.
        assert answer == (b"round 1", second) and answered_at - started < MAX_RDZV_WAIT, answered_at - started

        # a job with no state yet: a waiter is answered by the first set
        waiter = threading.Thread(target=lambda: answers.append((b.rendezvous_get("fresh", "run", None, wait=8),)))
        waiter.start()
        _, token, _ = a.rendezvous_set("fresh", "run", b"first", None)
        waiter.join(15)
        assert answers[-1][0] == (b"first", token)


def test_rendezvous_wait_fields_are_bounded_before_use(memd):
    from dashrun.wire.protocol import Kind

    with memd.client() as client:
        client.rendezvous_set("bounded", "run", b"s", None)
        for body in ({"wait": MAX_RDZV_WAIT + 1, "unlike": 1}, {"wait": -1, "unlike": 1}, {"wait": "5", "unlike": 1},
                     {"wait": 1, "unlike": -3}, {"wait": 1, "unlike": "x"}, {"wait": 1, "unlike": 1 << 70}):
            with pytest.raises(ProtocolError):
                client._request(lambda ch, body=body: ch.call(Kind.RDZV_GET, {"job": "bounded", "run_id": "run",
                                                                             **body}))
        assert client.rendezvous_get("bounded", "run")[0] == b"s"  # the connection serves on
        # The client keeps to the bound itself: dash-memd refuses a longer wait (ProtocolError, as above).
        assert client.rendezvous_get("bounded", "run", unlike=client.rendezvous_get("bounded", "run")[1],
                                     wait=MAX_RDZV_WAIT + 50)[0] == b"s"


def test_rendezvous_state_and_token_survive_a_killed_dash_memd_and_a_stale_token_still_loses(memd):
    with memd.client() as client:
        _, stale, _ = client.rendezvous_set("persist", "run", b"one", None)
        _, current, _ = client.rendezvous_set("persist", "run", b"two", stale)
    memd.kill()  # SIGKILL: no shutdown, nothing flushed by dash-memd itself
    memd.start()
    with memd.client() as client:
        assert client.rendezvous_get("persist", "run") == (b"two", current)
        assert client.rendezvous_set("persist", "run", b"stale write", stale) == (b"two", current, False)
        state, newer, won = client.rendezvous_set("persist", "run", b"three", current)
        assert (state, won) == (b"three", True) and newer > current
    memd.stop()
    memd.start()
    with memd.client() as client:
        assert client.rendezvous_get("persist", "run") == (b"three", newer)
        # dashrun rm forgets the state, but no token is ever handed out again
        client.delete("persist")
        assert client.rendezvous_get("persist", "run") is None
        assert client.rendezvous_set("persist", "run", b"old node", newer) is None
        _, fresh, won = client.rendezvous_set("persist", "run", b"new run", None)
        assert won and fresh > newer


# --- the key/value store -----------------------------------------------------------------------


def test_store_get_blocks_until_another_client_sets_the_key_without_stalling_other_clients(memd):
    got: list[bytes] = []
    errors: list[BaseException] = []

    def getter() -> None:
        try:
            with memd.client() as c:
                got.extend(c.store_multi_get("kv", ["rank0/addr", "rank0/port"], timeout=30))
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    thread = threading.Thread(target=getter)
    thread.start()
    with memd.client() as other:
        # while the getter waits, this client is served: it sets one key, which does not end the wait
        wait_for(lambda: other.store_num_keys("kv") == 0 and thread.is_alive(), 10, "the getter to be waiting")
        other.store_set("kv", "rank0/addr", b"10.0.0.1")
        assert other.ping()["pid"] > 0 and other.store_check("kv", ["rank0/addr"])
        assert not other.store_check("kv", ["rank0/addr", "rank0/port"])
        assert thread.is_alive() and not got
        other.store_set("kv", "rank0/port", b"29500")
    thread.join(30)
    assert not errors and got == [b"10.0.0.1", b"29500"]


def test_store_get_and_wait_time_out_with_store_timeout_error(memd):
    with memd.client() as client:
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="key 'never' of job kv's store not set within 0.3 s"):
            client.store_get("kv", "never", timeout=0.3)
        assert time.monotonic() - started >= 0.3
        with pytest.raises(StoreTimeoutError, match=r"2 keys \('never', 'nor-this'\)"):
            client.store_wait("kv", ["never", "nor-this"], timeout=0.1)
        client.store_set("kv", "there", b"")
        client.store_wait("kv", ["there"], timeout=0)
        assert client.store_get("kv", "there", timeout=0) == b""
        assert client.ping()  # the connection is still in step


def test_store_bounds_are_refused_not_grown_and_the_connection_serves_on(memd):
    with memd.client() as client:
        with pytest.raises(NoSpaceError, match="key"):
            client.store_set("kv", "k" * (MAX_STORE_KEY + 1), b"v")
        with pytest.raises(NoSpaceError, match="value"):
            client.store_set("kv", "k", b"v" * (MAX_STORE_VALUE + 1))
        client.store_set("kv", "é" * (MAX_STORE_KEY // 2), b"v" * MAX_STORE_VALUE)  # exactly at both bounds
        keys = [f"key-{i}" for i in range(MAX_STORE_KEYS - 1)]
        client.store_multi_set("kv", keys, [b"1"] * len(keys))
        assert client.store_num_keys("kv") == MAX_STORE_KEYS
        with pytest.raises(NoSpaceError, match="keys"):
            client.store_multi_set("kv", ["one", "two"], [b"1", b"2"])
        assert not client.store_check("kv", ["one"])  # refused whole: not even the first was set
        client.store_set("kv", "key-0", b"replacing a key needs no new one")
        assert client.store_delete_prefix("kv", "key-") == MAX_STORE_KEYS - 1
        # bytes: fill the job's store up to its bound, in requests that fit in one frame's body
        value = os.urandom(MAX_STORE_VALUE)
        count = MAX_STORE_JOB_BYTES // (MAX_STORE_VALUE + 8) - 1
        for start in range(0, count, 32):
            batch = [f"b{i:05d}" for i in range(start, min(start + 32, count))]
            client.store_multi_set("kv", batch, [value] * len(batch))
        with pytest.raises(NoSpaceError, match="bytes"):
            client.store_multi_set("kv", ["b-over-1", "b-over-2"], [value, value])
        assert client.store_get("kv", "b00007", timeout=0) == value
        assert client.store_num_keys("kv") == count + 1


def test_store_add_and_compare_set_have_tcpstore_semantics(memd):
    with memd.client() as client:
        assert client.store_add("kv", "n", 5) == 5  # missing: counted from 0
        assert client.store_add("kv", "n", -7) == -2
        assert client.store_get("kv", "n", timeout=0) == b"-2"  # decimal ASCII, as TCPStore keeps it
        client.store_set("kv", "text", b"abc")
        with pytest.raises(ConflictError, match="no decimal number"):
            client.store_add("kv", "text", 1)
        # missing key: set only if expected is empty; else TCPStore answers expected and sets nothing
        assert client.store_compare_set("kv", "cas", b"x", b"y") == b"x"
        assert not client.store_check("kv", ["cas"])
        assert client.store_compare_set("kv", "cas", b"", b"first") == b"first"
        assert client.store_compare_set("kv", "cas", b"wrong", b"second") == b"first"  # mismatch: the value held
        assert client.store_compare_set("kv", "cas", b"first", b"second") == b"second"
        assert client.store_get("kv", "cas", timeout=0) == b"second"
        assert client.store_delete("kv", "cas") and not client.store_delete("kv", "cas")
        assert client.store_num_keys("kv") == 2 and client.store_num_keys("another-job") == 0
        client.delete("kv")  # dashrun rm: the job's keys go too
        assert client.store_num_keys("kv") == 0


# --- the world generation fence --------------------------------------------------------------------


def shard(job: str, step: int, generation: int, rank: int = 0, world: int = 1) -> tuple[ShardHeader, bytes]:
    payload = os.urandom(256)
    return ShardHeader(job, step, rank, world, 256 * world, 256 * rank, 256 * (rank + 1), 0, 0, LAYOUT,
                       generation=generation), payload


def test_a_shard_of_an_older_world_generation_is_refused_current_newer_and_unfenced_ones_are_taken(memd):
    with memd.client() as client:
        assert client.generation("fenced") == 0
        assert client.set_generation("fenced", 5) == 5
        assert client.set_generation("fenced", 3) == 5  # never lowered
        header, payload = shard("fenced", 1, 3)
        with pytest.raises(ConflictError, match="shard of world generation 3, the job is at 5: this node was cut "
                                                "off from the job"):
            client.put_shard(header, [payload])
        assert client.latest("fenced") is None
        for step, generation in ((2, 5), (3, 0), (4, 6)):
            header, payload = shard("fenced", step, generation)
            assert client.put_shard(header, [payload])["committed"]
        assert client.latest("fenced").shards[0].generation == 6
        # the job moves on while a checkpoint of the old world is still arriving: it never commits
        assert client.set_generation("fenced", 7) == 7
        rank0, payload0 = shard("fenced", 9, 7, rank=0, world=2)
        assert not client.put_shard(rank0, [payload0])["committed"]
        assert client.set_generation("fenced", 8) == 8
        rank1, payload1 = shard("fenced", 9, 7, rank=1, world=2)
        with pytest.raises(ConflictError, match="generation 7, the job is at 8"):
            client.put_shard(rank1, [payload1])
        assert client.latest("fenced").step == 4
    memd.stop()
    memd.start()
    with memd.client() as client:
        assert client.generation("fenced") == 8
        header, payload = shard("fenced", 10, 7)
        with pytest.raises(ConflictError, match="cut off"):
            client.put_shard(header, [payload])


def test_a_step_sent_by_two_worlds_commits_with_the_newer_worlds_shards_alone(memd):
    """World 5's node dies while it sends step 9; world 6, of the same size, resumes and sends step 9 again."""
    with memd.client() as client:
        assert client.set_generation("worlds", 5) == 5
        stale, payload = shard("worlds", 9, 5, rank=0, world=2)
        assert not client.put_shard(stale, [payload])["committed"]
        assert client.set_generation("worlds", 6) == 6  # the fence is raised before world 6 sends
        newer = {rank: shard("worlds", 9, 6, rank=rank, world=2) for rank in (1, 0)}
        assert not client.put_shard(newer[1][0], [newer[1][1]])["committed"]  # world 5's shard leaves the step
        assert client.put_shard(newer[0][0], [newer[0][1]])["committed"]
        info = client.latest("worlds")
        assert info.step == 9 and [s.generation for s in info.shards] == [6, 6]
        got = bytearray(256)
        client.get_shard_into("worlds", 9, 0, [memoryview(got)])
        assert bytes(got) == newer[0][1]


def test_a_shard_of_a_newer_world_raises_the_fence_when_the_launchers_call_did_not(memd):
    """The launcher's set_generation failed (a warning only): the newer world's shards raise the fence."""
    with memd.client() as client:
        old, payload = shard("unfenced", 9, 5, rank=0, world=2)
        assert not client.put_shard(old, [payload])["committed"]
        for rank in (1, 0):
            header, payload = shard("unfenced", 9, 6, rank=rank, world=2)
            committed = client.put_shard(header, [payload])["committed"]
        assert committed and [s.generation for s in client.latest("unfenced").shards] == [6, 6]
        late, payload = shard("unfenced", 10, 5, rank=1, world=2)  # a zombie of world 5
        with pytest.raises(ConflictError, match="generation 5, the job is at 6"):
            client.put_shard(late, [payload])


# --- the membership history ---------------------------------------------------------------------------

T0 = 1_790_000_000.0


def history() -> list[MembershipEvent]:
    return [
        MembershipEvent(T0, "node-a", "joined", "", 1, 1, None, None),
        MembershipEvent(T0 + 1, "node-b", "joined", "", 2, 2, 0, 0),
        MembershipEvent(T0 + 2, "node-c", "joined", "", 3, 3, 200, 0),
        MembershipEvent(T0 + 60, "node-c", "left", "aws terminate notice", 2, 4, 1400, 0),
        MembershipEvent(T0 + 90, "node-b", "died", "no heartbeat for 6 s", 1, 5, 1450, 37),
    ]


def test_membership_history_round_trips_survives_a_restart_and_dashrun_status_lists_it(memd):
    events = history()
    with memd.client() as client:
        assert client.membership("elastic") == []
        for event in events:
            client.record_membership("elastic", event)
        client.set_generation("elastic", 5)
        assert client.membership("elastic") == events
    memd.kill()
    memd.start()
    with memd.client() as client:
        assert client.membership("elastic") == events

    table = dashrun_status(memd, "elastic")
    assert table.returncode == 0, table.stderr
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + 60))
    assert f"  {when}  node-c  left  (aws terminate notice)  world 3 -> 2  at step 1400, 0 steps lost" \
        in table.stdout.splitlines()
    assert "node-b  died  (no heartbeat for 6 s)  world 2 -> 1  at step 1450, 37 steps lost" in table.stdout
    assert "node-a  joined  world 1\n" in table.stdout and "world generation 5" in table.stdout
    listing = dashrun_status(memd, "elastic", "--json")
    assert listing.returncode == 0, listing.stderr
    body = json.loads(listing.stdout)
    assert body["job"] == "elastic" and body["generation"] == 5
    assert [MembershipEvent.from_body(e) for e in body["membership"]] == events
    assert json.loads(dashrun_status(memd, "--json").stdout)["jobs"] == []  # no checkpoints: not in the table
    assert "elastic: no checkpoints" in table.stdout

    with memd.client() as client:  # with a checkpoint, the job's line of the table comes first
        header, payload = shard("elastic", 1450, 5)
        assert client.put_shard(header, [payload])["committed"]
    everything = dashrun_status(memd)
    assert everything.returncode == 0 and "elastic" in everything.stdout and "membership" not in everything.stdout
    one = dashrun_status(memd, "elastic")
    assert one.returncode == 0 and one.stdout.index("1450") < one.stdout.index("membership history")
    assert json.loads(dashrun_status(memd, "elastic", "--json").stdout)["newest"]["step"] == 1450

    with memd.client() as client:
        client.delete("elastic")  # dashrun rm: gone with the job's spec and notices
        assert client.membership("elastic") == [] and client.generation("elastic") == 0
    missing = dashrun_status(memd, "elastic")
    assert missing.returncode == 1 and "knows no job" in missing.stderr


def test_membership_events_are_validated_before_use():
    good = history()[3].to_body()
    assert MembershipEvent.from_body(good) == history()[3]
    for field, bad in (("change", "vanished"), ("node", ""), ("node", "n" * 256), ("why", "x" * 501),
                       ("why", "line\nbreak"), ("world", -1), ("step", -3), ("time", float("nan")),
                       ("steps_lost", "many")):
        with pytest.raises(Exception) as caught:
            MembershipEvent.from_body({**good, field: bad})
        assert type(caught.value).__name__ == "ProtocolError", (field, bad)


# --- hostile names -------------------------------------------------------------------------------------

HOSTILE_NAMES = ["../x", "..", ".", "a/b", "", "x" * 129, "/etc", "../../../../tmp/dashrun-hostile-rdzv", "a\x00b",
                 "job\n", "-x", ".hidden", "a\\b", "é", 5, None, ["a"], {"a": 1}]


def test_hostile_job_and_run_ids_are_refused_and_create_nothing(memd, tmp_path):
    event = history()[0]
    with memd.client() as client:
        for name in HOSTILE_NAMES:
            for request in (lambda: client.rendezvous_set(name, "run", b"s", None),
                            lambda: client.rendezvous_set("job", name, b"s", None),
                            lambda: client.rendezvous_get("job", name),
                            lambda: client.set_generation(name, 3),
                            lambda: client.record_membership(name, event),
                            lambda: client.store_set(name, "k", b"v")):
                with pytest.raises(ProtocolError):
                    request()
        assert client.ping()
    assert {p.name for p in memd.data_dir.iterdir()} == {"jobs", "LOCK", "ID", "tls-identity.pem"}
    assert not list(tmp_path.rglob("*hostile*")) and not list(tmp_path.glob("x*"))
