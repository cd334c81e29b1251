"""What each node holds in its own RAM, as dash-memd's registry keeps it: announcements, holders, bounds."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from dashrun.errors import ForbiddenError, NoSpaceError, ProtocolError
from dashrun.memd.fleet import holdings as registry_module
from dashrun.memd.fleet.holdings import Registry
from dashrun.wire import holdings
from dashrun.wire.credentials import Credential
from dashrun.wire.domain import FailureDomain
from dashrun.wire.holdings import HeldShard, Holder, Holdings, Member, NodeView
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo, MembershipEvent, ShardHeader
from dashrun.wire.protocol import crc32c
from dashrun.wire.tls import TlsSettings

LAYOUT = "ab" * 32


def shards(job: str, step: int, world: int = 2, size: int = 4096) -> list[tuple[ShardHeader, bytes]]:
    """A checkpoint of ``world`` ranks whose shards are each a slice of replicated state and some private bytes."""
    made = []
    for rank in range(world):
        payload = os.urandom(size)
        rep = size // 2
        header = ShardHeader(job, step, rank, world, rep * world, rep * rank, rep * (rank + 1), size - rep, 0, LAYOUT,
                             crc=crc32c(payload))
        made.append((header, payload))
    return made


def info_of(job: str, step: int, made) -> CheckpointInfo:
    return CheckpointInfo(job, step, len(made), made[0][0].rep_total, LAYOUT, 1.0, tuple(h for h, _ in made))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def announcement(job, node, port, held, owner=None, domain=None, replicas=1, committed=False) -> Holdings:
    return Holdings(job, node, "127.0.0.1", port, replicas, domain,
                    tuple(HeldShard(h, owner or node, committed) for h in held))


def test_holders_are_the_nodes_with_the_same_bytes_and_an_announcement_expires():
    clock = Clock()
    registry = Registry(clock=clock, ttl=10.0)
    made = shards("j", 5)
    info = info_of("j", 5, made)
    (h0, _), (h1, _) = made
    assert registry.announce(announcement("j", "a", 7001, [h0], domain=FailureDomain("z1", "p"))) \
        == []
    others = registry.announce(announcement("j", "b", 7002, [h1, h0], owner="a"))
    assert others == [Member("a", "127.0.0.1", 7001, FailureDomain("z1", "p"))]
    stale = dataclasses.replace(h1, crc=h1.crc ^ 1)  # other bytes of the same rank: not a holder of these
    registry.announce(announcement("j", "c", 7003, [stale]))
    registry.announce(announcement("j", "d", 0, [h0]))  # holds it but takes no peers
    assert registry.holders(info) == {0: [Holder("a", "127.0.0.1", 7001), Holder("b", "127.0.0.1", 7002)],
                                      1: [Holder("b", "127.0.0.1", 7002)]}
    assert registry.holders(info_of("j", 6, shards("j", 6))) == {}
    clock.now += 9.0
    registry.announce(announcement("j", "b", 7002, [h1]))  # b again; a's is 9 s old
    clock.now += 2.0  # a's announcement is 11 s old now
    assert registry.holders(info) == {1: [Holder("b", "127.0.0.1", 7002)]}
    assert [n["node"] for n in registry.view("j")] == ["b"]


def test_a_node_that_left_holds_nothing_and_the_view_names_whose_shards():
    registry = Registry()
    made = shards("j", 3)
    registry.announce(announcement("j", "a", 7001, [made[0][0]]))
    registry.announce(announcement("j", "b", 7002, [made[1][0], made[0][0]], owner="a"))
    view = {n["node"]: n for n in registry.view("j")}
    assert view["b"]["steps"] == {"3": ["a"]} and view["a"]["replicas"] == 1
    assert NodeView.from_body(view["b"]).steps == {3: ["a"]}
    registry.forget("j", "a")
    assert registry.holders(info_of("j", 3, made)) == {0: [Holder("b", "127.0.0.1", 7002)],
                                                        1: [Holder("b", "127.0.0.1", 7002)]}
    registry.delete_job("j")
    assert registry.view("j") == []


def test_a_job_announces_a_bounded_number_of_nodes_and_bytes(monkeypatch):
    registry = Registry()
    monkeypatch.setattr(registry_module, "MAX_NODES", 3)
    for node in "abc":
        registry.announce(announcement("j", node, 7000, []))
    with pytest.raises(NoSpaceError, match="at most 3"):
        registry.announce(announcement("j", "d", 7000, []))
    registry.announce(announcement("j", "c", 7001, []))  # a node announcing again is no new node
    registry.announce(announcement("other", "d", 7000, []))  # another job's count is its own
    monkeypatch.setattr(registry_module, "MAX_JOB_BYTES", 4000)
    with pytest.raises(NoSpaceError, match="MiB of holdings"):
        registry.announce(announcement("other", "e", 7000, [h for h, _ in shards("other", 1, world=16)]))


@pytest.mark.parametrize("change, problem", [
    ({"shards": [{"shard": {}}] * (holdings.MAX_HELD + 1)}, "at most"),
    ({"node": ""}, "node"),
    ({"node": "a\nb"}, "node"),
    ({"host": "a b"}, "host"),
    ({"host": "x" * 300}, "host"),
    ({"port": 70000}, "port"),
    ({"replicas": -1}, "replicas"),
    ({"domain": {"zone": "z" * 300}}, "zone"),
    ({"domain": {"zone": "a b"}}, "domain"),
    ({"domain": "zone-a"}, "domain"),
    ({"shards": [{"shard": "x"}]}, "held shard"),
])
def test_an_announcement_is_checked_field_by_field(change, problem):
    body = announcement("j", "a", 7001, [shards("j", 1)[0][0]]).to_body()
    body.update(change)
    with pytest.raises(ProtocolError, match=problem):
        Holdings.from_body(body)


def test_an_announcement_names_shards_of_its_own_job_only():
    body = announcement("j", "a", 7001, [shards("k", 1)[0][0]]).to_body()
    body["job"] = "j"
    with pytest.raises(ProtocolError, match="own job"):
        Holdings.from_body(body)


def test_holders_in_a_reply_are_checked():
    assert holdings.holders_from_body({"1": [["b", "10.0.0.2", 7071]]}, 2) == {1: [Holder("b", "10.0.0.2", 7071)]}
    for bad in ({"2": [["b", "h", 1]]}, {"x": []}, {"0": [["b", "h", 0]]}, {"0": [["b", "h"]]}, ["b"]):
        with pytest.raises(ProtocolError):
            holdings.holders_from_body(bad, 2)


def test_dash_memd_names_the_holders_of_the_checkpoint_a_restore_asks_for(memd):
    job = "held"
    made = shards(job, 4)
    as_job = Credential(memd.token).for_job(job).file_bytes().strip()
    with memd.client() as operator, MemdClient(memd.host, memd.port, as_job, tls=TlsSettings()) as a, \
            MemdClient(memd.host, memd.port, as_job, tls=TlsSettings()) as b:
        for header, payload in made:
            operator.put_shard(header, [payload])
        assert a.announce(announcement(job, "node-a", 7001, [made[0][0]])).members == []
        answer = b.announce(announcement(job, "node-b", 7002, [made[1][0], made[0][0]], owner="node-a",
                                         domain=FailureDomain.parse("z2/p:spot")))
        assert [m.node for m in answer.members] == ["node-a"] and answer.committed == 4
        located = a.locate(job)
        assert located.info.step == 4 and located.in_memd
        assert located.holders == {0: [Holder("node-a", "127.0.0.1", 7001), Holder("node-b", "127.0.0.1", 7002)],
                                   1: [Holder("node-b", "127.0.0.1", 7002)]}
        assert operator.latest(job) == located.info  # a client that asks LATEST as before gets the checkpoint alone
        _, _, view = operator.fleet_view(job)
        assert [(n.node, n.steps, n.domain) for n in view] == [
            ("node-a", {4: ["node-a"]}, None), ("node-b", {4: ["node-a"]}, FailureDomain.parse("z2/p:spot"))]
        with pytest.raises(ForbiddenError):  # a job's credential announces for its own job only
            a.announce(announcement("other", "node-a", 7001, []))
        operator.record_membership(job, MembershipEvent(0.0, "node-a", "died", "gone", 1, 1))
        assert a.locate(job).holders == {0: [Holder("node-b", "127.0.0.1", 7002)],
                                         1: [Holder("node-b", "127.0.0.1", 7002)]}
        status = subprocess.run([sys.executable, "-m", "dashrun", "status", job, "--memd", memd.address,
                                 "--token-file", str(memd.token_file)], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert re.search(r"^  step 4: dash-memd \((disk, )?ram\), node-b$", status.stdout, re.M), status.stdout
        assert "node-b  z2/p:spot  replicas 1  holds node-a's (step 4)" in status.stdout


# --- the commit on the fleet ------------------------------------------------------------------


def both_hold_both(registry, job, made, replicas=1, committed=False, nodes=("a", "b")):
    """Each of ``nodes`` holds every shard of ``made`` (its own and copies of the others')."""
    for i, node in enumerate(nodes):
        registry.announce(Holdings(job, node, "127.0.0.1", 7001 + i, replicas, None, tuple(
            HeldShard(h, nodes[h.rank % len(nodes)], committed) for h, _ in made)))


def test_a_step_held_by_r_plus_1_nodes_is_committed_and_stays_so_when_a_holder_goes():
    registry = Registry()
    made = shards("j", 7)
    registry.announce(announcement("j", "a", 7001, [made[0][0]], replicas=1))
    registry.announce(announcement("j", "b", 7002, [made[1][0], made[0][0]], owner="a", replicas=1))
    assert registry.committed("j") is None  # rank 1's shard is on one node only
    registry.announce(announcement("j", "a", 7001, [made[0][0], made[1][0]], replicas=1))
    info = registry.committed("j")
    assert (info.step, info.world, [s.crc for s in info.shards]) == (7, 2, [h.crc for h, _ in made])
    registry.forget("j", "b")
    assert registry.committed("j") == info and registry.committed("j", 7) == info
    assert registry.committed("j", 6) is None
    registry.delete_steps("j", [7])
    assert registry.committed("j") is None


def test_no_commit_rests_on_one_node_alone_or_on_an_older_world():
    registry = Registry()
    made = shards("j", 3)
    both_hold_both(registry, "j", made, replicas=0)  # no replicas: each node's copies are its own business
    assert registry.committed("j") is None
    registry = Registry()
    both_hold_both(registry, "j", made, replicas=1)
    assert registry.committed("j", generation=1) is None  # shards of world 0, and the job is in world 1 now
    assert registry.committed("j", generation=0).step == 3


def test_after_a_restart_a_step_its_holders_know_committed_is_committed_again():
    made = shards("j", 9)
    registry = Registry()  # dash-memd restarted: it remembers nothing
    registry.announce(announcement("j", "b", 7002, [h for h, _ in made], owner="a", replicas=1, committed=True))
    assert registry.committed("j").step == 9  # one holder, which knows the step committed (announcement's flag)
    registry = Registry()
    both_hold_both(registry, "j", made[:1], replicas=1, committed=True)
    assert registry.committed("j") is None  # rank 1's shard is nowhere: not a checkpoint


def test_shards_that_do_not_make_one_checkpoint_commit_nothing():
    registry = Registry()
    made = shards("j", 2)
    other_layout = dataclasses.replace(made[1][0], layout="cd" * 32)
    both_hold_both(registry, "j", [made[0], (other_layout, b"")], replicas=1)
    assert registry.committed("j") is None


def test_dash_memd_answers_a_step_committed_on_the_fleet_that_it_does_not_hold(memd):
    job = "onfleet"
    made = shards(job, 12)
    as_job = Credential(memd.token).for_job(job).file_bytes().strip()
    with MemdClient(memd.host, memd.port, as_job, tls=TlsSettings()) as client:
        assert client.locate(job) is None
        for i, node in enumerate(("a", "b")):
            answer = client.announce(Holdings(job, node, "127.0.0.1", 7001 + i, 1, None,
                                              tuple(HeldShard(h, "ab"[h.rank]) for h, _ in made)))
        assert answer.committed == 12
        located = client.locate(job)
        assert (located.info.step, located.in_memd) == (12, False)
        assert client.latest(job) is None  # a reader of dash-memd alone is not given what it cannot read there
        assert located.holders[1] == [Holder("a", "127.0.0.1", 7001), Holder("b", "127.0.0.1", 7002)]
        for header, payload in made[:1]:  # dash-memd catching up: one shard of two is no checkpoint of its own
            client.put_shard(header, [payload])
        assert client.locate(job).in_memd is False
        client.put_shard(*[made[1][0], [made[1][1]]])
        located = client.locate(job)
        assert (located.info.step, located.in_memd) == (12, True)
