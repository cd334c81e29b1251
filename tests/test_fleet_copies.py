"""Copies in the fleet's own RAM, placed from dash-memd's registry: real dash-agents and dash-memd on loopback.

The nodes announce what they hold; each places its replicas on a node of another failure domain that
dash-memd's answer names; ``dashrun status`` shows the placement; and after dash-memd restarts with an
empty data dir, the step the nodes hold is committed again from their announcements and a new node
restores it from their copies, none of it from dash-memd.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import psutil
from conftest import wait_for
from test_checkpointer import save_world, trained_objects

from dashrun.wire.peer_client import PeerClient
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import WaitReply, WaitRequest
from dashrun.wire.credentials import Credential
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import Kind, crc32c

JOB = "fleetcopies"


def fleet_env(node: str, domain: str, job: str = JOB) -> dict:
    """A dash-agent's environment as node ``node`` of ``job`` in failure domain ``domain``, with one replica."""
    return {"DASH_JOB_ID": job, "DASH_REPLICAS": "1", "DASH_PEER_PORT": "0", "DASH_PEER_MEMORY_LIMIT": "64MiB",
            "DASH_NODE": node, "DASH_FAILURE_DOMAIN": domain}


def holdings(memd, job: str = JOB) -> dict[str, dict[int, list[str]]]:
    """node -> step -> whose shards of it the node holds, from its newest announcement."""
    with memd.client() as client:
        return {node.node: node.steps for node in client.fleet_view(job)[2]}


def placed(agent, holder: str) -> None:
    """Wait until ``agent`` places its replicas on ``holder``: it learns the others from dash-memd's answers to
    its announcements, every 2 s, and a shard saved before sends no copy to a holder it does not know yet."""
    wait_for(lambda: f"this node's replicas go to {holder}" in agent.log(), 30, f"replicas to go to {holder}")


def test_replicas_are_placed_from_the_registry_and_restored_from_after_dash_memd_restarts_empty(
        memd_factory, agent_factory, rank_env, tmp_path):
    memd = memd_factory("--memory-limit", "256MiB")
    same_zone = agent_factory(memd, env=fleet_env("n1", "z1/p1"))
    agent_factory(memd, env=fleet_env("n2", "z1/p1"))
    agent_factory(memd, env=fleet_env("n3", "z2/p2"))
    wait_for(lambda: set(holdings(memd)) == {"n1", "n2", "n3"}, what="the three nodes to announce themselves")
    placed(same_zone, "n3")

    model, opt, sched = trained_objects()
    save_world(rank_env, same_zone, JOB, 2, 6, model, opt, sched, [3, 4])
    # n1's copies go to n3 (another zone and pool), not to n2 (its own domain); each node announces on its own
    wait_for(lambda: holdings(memd).get("n3", {}).get(6) == ["n1"] and holdings(memd).get("n1", {}).get(6),
             what="n3 to hold n1's step 6, and n1 its own")
    assert holdings(memd)["n1"] == {6: ["n1"]} and 6 not in holdings(memd)["n2"]
    with memd.client() as client:
        located = client.locate(JOB)
        info = located.info
    assert located.in_memd and {h.node for found in located.holders.values() for h in found} == {"n1", "n3"}

    status = subprocess.run([sys.executable, "-m", "dashrun", "status", JOB, "--memd", memd.address,
                             "--token-file", str(memd.token_file)], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert re.search(r"^  step 6: dash-memd \([a-z, ]+\), n1, n3$", status.stdout, re.M), status.stdout
    assert "n3  z2/p2  replicas 1  holds n1's (step 6)" in status.stdout

    # dash-memd restarts with nothing: the nodes announce again, and what they hold, committed, is the job's.
    port = memd.port
    memd.stop()
    empty = memd_factory("--memory-limit", "256MiB", data_dir=tmp_path / "empty")
    empty.stop()
    empty.start(port=port)
    with empty.client() as client:
        assert client.latest(JOB) is None  # dash-memd itself holds nothing
        wait_for(lambda: (found := client.locate(JOB)) is not None and found.info.step == 6,
                 what="the step the nodes hold to be committed again")
        located = client.locate(JOB)
    assert not located.in_memd and [s.crc for s in located.info.shards] == [s.crc for s in info.shards]

    newcomer = agent_factory(empty, env=fleet_env("n4", "z3/p3"))
    fetched = wait_for(lambda: re.search(rf"fetched {JOB} step 6 \((.*)\)", newcomer.log()),
                       what="the new node's fetch of step 6")
    assert fetched.group(1) == f"{info.nbytes} bytes from peers", fetched.group(0)


def hand_over(link: AgentLink, job: str, step: int, payload: bytes):
    """Hand the agent a fully staged shard of a world of one, as a rank does; the future of its reply."""
    fd = os.memfd_create("test-shard")
    try:
        os.write(fd, payload)
        rep = len(payload) // 2
        header = ShardHeader(job, step, 0, 1, rep, 0, rep, len(payload) - rep, 0, "ab" * 32)
        return link.request(Kind.SNAPSHOT, {"shard": header.to_body(), "ready": header.nbytes}, fds=[fd])
    finally:
        os.close(fd)


def test_a_shard_is_safe_once_a_peer_holds_it_while_dash_memd_hangs_and_dash_memd_catches_up(
        memd_factory, agent_factory):
    """The commit rule with replicas: the rank's buffer is released once this node and R peers hold its shard,
    before a hung dash-memd answers; once it answers again it gets the shard from the agent's copy."""
    memd = memd_factory("--memory-limit", "256MiB")
    job = "hung"
    env = {**fleet_env("n1", "z1/p1"), "DASH_JOB_ID": job}
    first = agent_factory(memd, env=env)
    second = agent_factory(memd, env={**env, "DASH_NODE": "n2", "DASH_FAILURE_DOMAIN": "z2/p2"})
    placed(first, "n2")
    link = AgentLink(str(first.socket_path))
    hung = psutil.Process(memd.proc.pid)
    try:
        assert hand_over(link, job, 1, os.urandom(4096)).result(timeout=60).kind == Kind.OK
        payload = os.urandom(1 << 20)
        hung.suspend()
        reply = hand_over(link, job, 2, payload).result(timeout=60)  # dash-memd answers nothing meanwhile
        assert reply.kind == Kind.OK and reply.body["committed"] is False and reply.body["crc"] == crc32c(payload)
        host, port = re.search(r"serving the job's other agents on ([\d.]+):(\d+)", second.log()).groups()
        copy = bytearray(len(payload))
        with PeerClient(host, int(port), Credential.parse(memd.token).for_job(job)) as peer:
            peer.get_into(job, 2, 0, crc32c(payload), 0, [memoryview(copy)])
        assert copy == payload
    finally:
        hung.resume()
        link.close()
    with memd.client() as client:
        info = wait_for(lambda: client.latest(job, 2), what="dash-memd to catch up from the agent's copy")
        got = bytearray(len(payload))
        client.get_shard_into(job, 2, 0, [memoryview(got)])
    assert info.shards[0].crc == crc32c(payload) and got == payload


def test_copies_that_cannot_fit_are_said_once_and_the_shards_go_to_dash_memd_alone(memd_factory, agent_factory):
    memd = memd_factory("--memory-limit", "256MiB")
    agent = agent_factory(memd, env={**fleet_env("n1", "z1"), "DASH_JOB_ID": "tight", "DASH_PEER_MEMORY_LIMIT": "1MiB"})
    link = AgentLink(str(agent.socket_path))
    try:
        for step in (1, 2):
            assert hand_over(link, "tight", step, os.urandom(512 << 10)).result(timeout=60).kind == Kind.OK
    finally:
        link.close()
    with memd.client() as client:
        assert client.latest("tight").step == 2  # delivered as without replicas
    said = [line for line in agent.log().splitlines() if "needs about" in line]
    assert len(said) == 1, said
    assert ("--replicas 1 needs about 2.0 MiB of dash-agent's memory on this node (2 steps x 2 copies x 1 rank x "
            "512.0 KiB), and --peer-memory-limit is 1.0 MiB") in said[0]


def test_a_step_dash_memd_cannot_take_is_committed_on_the_fleet_and_a_rank_waiting_for_it_hears_so(
        memd_factory, agent_factory):
    """dash-memd refuses the shard (no room): it is safe anyway once this node and its peer hold it; dash-memd's
    registry commits the step on the fleet, and a rank's WAIT for it says committed."""
    memd = memd_factory("--memory-limit", "1MiB")
    job = "nomemd"
    env = {**fleet_env("n1", "z1/p1"), "DASH_JOB_ID": job}
    first = agent_factory(memd, env=env)
    agent_factory(memd, env={**env, "DASH_NODE": "n2", "DASH_FAILURE_DOMAIN": "z2/p2"})
    placed(first, "n2")
    link = AgentLink(str(first.socket_path))
    try:
        payload = os.urandom(2 << 20)  # more than dash-memd may hold
        reply = hand_over(link, job, 3, payload).result(timeout=60)
        assert reply.kind == Kind.OK and reply.body["committed"] is False
        waited = link.call(Kind.WAIT, WaitRequest(job, 3, 30.0).to_body(), timeout=60)
        assert WaitReply.from_body(waited.body).committed
    finally:
        link.close()
    with memd.client() as client:
        located = client.locate(job)
        assert (located.info.step, located.in_memd) == (3, False)
        assert client.latest(job) is None
    assert "shards are not reaching dash-memd (the fleet's copies hold them meanwhile)" in first.log()


def test_a_restore_of_a_step_only_the_fleet_holds_waits_for_a_holder_to_announce_itself(
        memd_factory, agent_factory, rank_env, tmp_path):
    """dash-memd restarted empty, and the only node that announced itself since is the one that then dies: its
    replacement finds no holder but itself, and asks dash-memd again until the holder, silent meanwhile, is back."""
    memd = memd_factory("--memory-limit", "256MiB")
    job = "waitforholder"
    env = {**fleet_env("n1", "z1/p1"), "DASH_JOB_ID": job}
    first = agent_factory(memd, env=env)
    holder = agent_factory(memd, env={**env, "DASH_NODE": "n2", "DASH_FAILURE_DOMAIN": "z2/p2"})
    placed(first, "n2")
    model, opt, sched = trained_objects()
    save_world(rank_env, first, job, 2, 6, model, opt, sched, [3, 4])
    with memd.client() as client:
        wait_for(lambda: (found := client.fleet_view(job)[2]) and any(n.node == "n2" and 6 in n.steps for n in found),
                 what="n2 to hold n1's step 6")
        nbytes = client.latest(job).nbytes
    silent = psutil.Process(holder.proc.pid)
    port = memd.port
    memd.stop()
    silent.suspend()  # n2 says nothing to the new dash-memd for now
    try:
        empty = memd_factory("--memory-limit", "256MiB", data_dir=tmp_path / "empty")
        empty.stop()
        empty.start(port=port)
        with empty.client() as client:
            wait_for(lambda: (found := client.locate(job)) is not None and found.info.step == 6,
                     what="n1's announcement to commit step 6 on the fleet")
        first.kill()
        replacement = agent_factory(empty, env=env)
        wait_for(lambda: "is held by the fleet, and no holder of it answered yet" in replacement.log(),
                 what="the replacement to find no holder but itself")
    finally:
        silent.resume()
    fetched = wait_for(lambda: re.search(rf"fetched {job} step 6 \((.*)\)", replacement.log()),
                       what="the replacement's fetch from n2, once n2 is back")
    assert fetched.group(1) == f"{nbytes} bytes from peers", replacement.log()[-3000:]
