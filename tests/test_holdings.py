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


def announcement(job, node, port, held, owner=None, domain=None, replicas=1) -> Holdings:
    return Holdings(job, node, "127.0.0.1", port, replicas, domain,
                    tuple(HeldShard(h, owner or node, committed=True) for h in held))


def test_holders_are_the_nodes_with_the_same_bytes_and_an_announcement_expires():
    clock = Clock()
    registry = Registry(clock=clock, ttl=10.0)
    made = shards("j", 5)
    info = info_of("j", 5, made)
    (h0, _), (h1, _) = made
    assert registry.announce(announcement("j", "a", 7001, [h0], domain={"zone": "z1", "pool": "p", "market": ""})) == []
    others = registry.announce(announcement("j", "b", 7002, [h1, h0], owner="a"))
    assert others == [Member("a", "127.0.0.1", 7001, {"zone": "z1", "pool": "p", "market": ""})]
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
    ({"domain": {"zone": "z" * 300}}, "domain.zone"),
    ({"domain": {"rack": "r"}}, "domain"),
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
    credential = Credential(memd.token).for_job(job)
    as_job = credential.file_bytes().strip()
    with memd.client() as operator, MemdClient(memd.host, memd.port, as_job, tls=TlsSettings()) as a, \
            MemdClient(memd.host, memd.port, as_job, tls=TlsSettings()) as b:
        for header, payload in made:
            operator.put_shard(header, [payload])
        assert a.announce(announcement(job, "node-a", 7001, [made[0][0]])) == []
        members = b.announce(announcement(job, "node-b", 7002, [made[1][0], made[0][0]], owner="node-a",
                                          domain={"zone": "z2", "pool": "p", "market": "spot"}))
        assert [m.node for m in members] == ["node-a"]
        info, holders = a.latest_held(job)
        assert info.step == 4
        assert holders == {0: [Holder("node-a", "127.0.0.1", 7001), Holder("node-b", "127.0.0.1", 7002)],
                           1: [Holder("node-b", "127.0.0.1", 7002)]}
        assert operator.latest(job) == info  # a client that asks LATEST as before gets the checkpoint alone
        _, _, view = operator.fleet_view(job)
        assert [(n.node, n.steps, n.domain) for n in view] == [
            ("node-a", {4: ["node-a"]}, None), ("node-b", {4: ["node-a"]}, {"zone": "z2", "pool": "p", "market": "spot"})]
        with pytest.raises(ForbiddenError):  # a job's credential announces for its own job only
            a.announce(announcement("other", "node-a", 7001, []))
        operator.record_membership(job, MembershipEvent(0.0, "node-a", "died", "gone", 1, 1))
        assert a.latest_held(job)[1] == {0: [Holder("node-b", "127.0.0.1", 7002)],
                                         1: [Holder("node-b", "127.0.0.1", 7002)]}
        status = subprocess.run([sys.executable, "-m", "dashrun", "status", job, "--memd", memd.address,
                                 "--token-file", str(memd.token_file)], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert re.search(r"^  step 4: dash-memd \((disk, )?ram\), node-b$", status.stdout, re.M), status.stdout
        assert "node-b  z2/p (spot)  replicas 1  holds node-a's (step 4)" in status.stdout
