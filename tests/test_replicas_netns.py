"""Copies in the fleet's own RAM where dash-memd's link is thin: a node per network namespace, dash-memd in one of
its own behind a token bucket (tc tbf) of a fraction of what the peers' links carry.

A node SIGKILLed and relaunched restores from its peers' copies, bit for bit, none of it over dash-memd's link;
dash-memd restarted with an empty data dir, then a node killed: the job goes on from the peers' copies; a rank
killed alone is restored from its own node's RAM, nothing over TCP; the copies of two nodes of one zone go to
the node of the other; an elastic job loses a node behind the thin link and goes on from the fleet's copies.

Each scenario runs twice: on loopback (always), and in namespaces (as root; skipped otherwise). The restores'
times are printed beside the time dash-memd's link needs for the same bytes (``-s`` shows them); what is
asserted is where every byte came from, from the agents' own accounts, not a stopwatch.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import psutil
import pytest
import torch
from conftest import wait_for
from runs import Cursor
from test_checkpointer import same_state, trained_objects
from test_elastic import Node, assert_each_sample_once, assert_redone_at_most, newest_step, runs_of_steps, worlds
from test_fleet_copies import fleet_env as fleet_env_of
from test_fleet_copies import holdings as holdings_of
from test_fleet_copies import placed
from test_restore_path import Reads as MemdReads
from test_restore_path import state_tensors

from dashrun.wire.peer_client import PeerClient

JOB = "copies"
#: dash-memd's link, each way, and what it carries a second (tbf's mbit are 10^6 bits).
THIN, THIN_RATE = "16mbit", 16e6 / 8
#: a restore's account in the agent's log (agent/restores.py)
FETCHED = re.compile(r"fetched (\S+) step (\d+) \((.*?)\) in ([\d.]+)s")
VARIANTS = pytest.mark.parametrize("in_namespaces", [False, True], ids=["loopback", "namespaces"])


@dataclasses.dataclass
class Site:
    """Where a test's parts run: dash-memd, and one place per node (a namespace, or None: loopback)."""

    memd: object
    places: list
    thin: object = None  # dash-memd's namespace, its link shaped both ways


def site(in_namespaces: bool, nodes: int, fleet_factory, memd_factory) -> Site:
    if not in_namespaces:
        return Site(memd_factory("--memory-limit", "256MiB"), [None] * nodes)
    fleet = fleet_factory(nodes + 1)
    thin = fleet[nodes]
    thin.shape(THIN)          # what dash-memd sends: restores
    thin.shape_inbound(THIN)  # what it receives: checkpoints
    return Site(memd_factory("--memory-limit", "256MiB", netns=thin), list(fleet.nodes[:nodes]), thin)


def fleet_env(node: str, domain: str) -> dict:
    return fleet_env_of(node, domain, JOB)


def holdings(memd) -> dict[str, dict[int, list[str]]]:
    return holdings_of(memd, JOB)


def holds(memd, node: str, owner: str, step: int) -> bool:
    return owner in holdings(memd).get(node, {}).get(step, [])


def fetches(log: str, job: str = JOB) -> list[tuple[int, str, float]]:
    """(step, where its bytes came from, seconds) of each restore an agent's log accounts for."""
    return [(int(m.group(2)), m.group(3), float(m.group(4))) for m in FETCHED.finditer(log) if m.group(1) == job]


def from_own_store(source: str) -> bool:
    """Whether a restore's account names this agent's store alone: no byte over TCP, from a peer or dash-memd."""
    return re.fullmatch(r"\d+ bytes from this agent's store", source) is not None


def big_state(seed: int = 0):
    """6 MiB of model and AdamW state: seconds on dash-memd's thin link."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def rank_on(monkeypatch):
    """``rank_on(agent, rank, world, **objects)``: a Checkpointer as the only rank of the agent's node."""
    from dashrun.rank.checkpointer import Checkpointer

    def make(agent, rank: int, world: int, **objects) -> Checkpointer:
        for name, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": 1, "DASH_JOB_ID": JOB,
                            "DASH_AGENT_SOCKET": agent.socket_path, "DASH_MEMD": agent.memd.address,
                            "DASH_TOKEN_FILE": agent.memd.token_file}.items():
            monkeypatch.setenv(name, str(value))
        return Checkpointer(interval=5, **objects)
    return make


def save(ranks, step: int) -> None:
    for ckpt in ranks:
        assert ckpt.save(step, force=True)
    assert all(ckpt.wait(timeout=60) for ckpt in ranks)


def two_nodes_saved(where: Site, agent_factory, rank_on, step: int):
    """Nodes n1 and n2 (another zone each), one rank each, step ``step`` saved and each node's copy at the other's."""
    agents = [agent_factory(where.memd, env=fleet_env(f"n{i + 1}", f"z{i + 1}/p{i + 1}"), netns=where.places[i])
              for i in range(2)]
    placed(agents[0], "n2")
    placed(agents[1], "n1")
    model, opt = big_state()
    ranks = [rank_on(agents[r], r, 2, model=model, optimizer=opt, data=Cursor(30 + r)) for r in range(2)]
    save(ranks, step)
    wait_for(lambda: holds(where.memd, "n2", "n1", step) and holds(where.memd, "n1", "n2", step), 60,
             "each node's copy to reach the other")
    return agents, ranks, model, opt


def relaunched_restores_from_peers(where: Site, agent_factory, rank_on, killed, ranks, step, nbytes, model, opt,
                                   what: str):
    """Kill node n1 (its rank and dash-agent, SIGKILL), relaunch it; its restore reads every byte from n2's copies
    and gives back what was saved, bit for bit. Returns the relaunched node's rank."""
    ranks[0].close()  # the rank goes with its node
    killed.kill()
    relaunched = agent_factory(where.memd, env=fleet_env("n1", "z1/p1"), netns=where.places[0])
    fetched = wait_for(lambda: fetches(relaunched.log()), 60, "the relaunched node's fetch, ahead of its rank")
    assert [(s, source) for s, source, _ in fetched] == [(step, f"{nbytes} bytes from peers")], relaunched.log()
    seconds = fetched[0][2]
    print(f"\n{what}: {nbytes} bytes restored from peers in {seconds:.2f}s; dash-memd's link needs "
          f"{nbytes / THIN_RATE:.2f}s at {THIN}" + ("" if where.thin else " (unshaped here, on loopback)"))
    model2, opt2 = big_state(seed=99)
    cursor = Cursor()
    rank = rank_on(relaunched, 0, 2, model=model2, optimizer=opt2, data=cursor)
    assert rank.restore() == step + 1
    assert same_state(model, model2) and same_state(opt, opt2) and cursor.position == 30
    assert [source for _, source, _ in fetches(relaunched.log())] == [f"{nbytes} bytes from peers"]
    return rank


@VARIANTS
def test_a_node_killed_and_relaunched_restores_from_its_peers_copies(in_namespaces, fleet_factory, memd_factory,
                                                                     agent_factory, rank_on):
    where = site(in_namespaces, 2, fleet_factory, memd_factory)
    agents, ranks, model, opt = two_nodes_saved(where, agent_factory, rank_on, 4)
    with where.memd.client() as client:
        info = client.locate(JOB).info
    assert info.step == 4 and info.nbytes > 6_000_000
    rank = relaunched_restores_from_peers(where, agent_factory, rank_on, agents[0], ranks, 4, info.nbytes, model,
                                          opt, "a node killed and relaunched")
    rank.close()
    ranks[1].close()


@VARIANTS
def test_the_only_rank_of_a_relaunched_node_reads_the_peers_copies_straight_into_its_tensors(
        in_namespaces, fleet_factory, memd_factory, agent_factory, rank_on, monkeypatch):
    """With no fetch ahead, the node's image holds the tails alone: its only rank reads the replicated state from
    the peer's copies itself, every byte once, into the tensors it has, none of it from dash-memd."""
    where = site(in_namespaces, 2, fleet_factory, memd_factory)
    agents, ranks, model, opt = two_nodes_saved(where, agent_factory, rank_on, 4)
    with where.memd.client() as client:
        info = client.locate(JOB).info
    ranks[0].close()
    agents[0].kill()
    relaunched = agent_factory(where.memd, env={**fleet_env("n1", "z1/p1"), "DASH_NO_PREFETCH": "1"},
                               netns=where.places[0])
    read: list[int] = []  # bytes this process (the rank) read from peers
    get_into = PeerClient.get_into

    def counted(client, job, step, rank, crc, offset, views):
        get_into(client, job, step, rank, crc, offset, views)
        read.append(sum(len(v) for v in views))
    monkeypatch.setattr(PeerClient, "get_into", counted)
    memd_reads = MemdReads(monkeypatch)
    model2, opt2 = big_state(seed=99)  # its optimizer has state: read into in place too
    before = {t.data_ptr() for t in state_tensors(model2, opt2)}
    cursor = Cursor()
    rank = rank_on(relaunched, 0, 2, model=model2, optimizer=opt2, data=cursor)
    assert rank.restore() == 5
    assert same_state(model, model2) and same_state(opt, opt2) and cursor.position == 30
    assert {t.data_ptr() for t in state_tensors(model2, opt2)} == before  # written in place
    assert info.rep_total - 64 * 1024 < sum(read) <= info.rep_total and not memd_reads.nbytes
    tails = sum(shard.nbytes - (shard.rep_end - shard.rep_start) for shard in info.shards)
    assert [source for _, source, _ in fetches(relaunched.log())] == [f"{tails} bytes from peers"]
    rank.close()
    ranks[1].close()


@VARIANTS
def test_dash_memd_restarted_empty_then_a_node_killed_the_job_goes_on_from_the_peers(
        in_namespaces, fleet_factory, memd_factory, agent_factory, rank_on, tmp_path):
    where = site(in_namespaces, 2, fleet_factory, memd_factory)
    agents, ranks, model, opt = two_nodes_saved(where, agent_factory, rank_on, 4)
    with where.memd.client() as client:
        info = client.locate(JOB).info
    port = where.memd.port
    where.memd.stop()
    empty = memd_factory("--memory-limit", "256MiB", data_dir=tmp_path / "empty", netns=where.thin)
    empty.stop()
    empty.start(port=port)  # where the nodes and ranks look for it
    where.memd = empty
    with empty.client() as client:
        assert client.latest(JOB) is None  # dash-memd holds nothing of the job
        located = wait_for(lambda: (found := client.locate(JOB)) is not None and found.info.step == 4 and found, 60,
                           "the step the nodes hold to be committed again")
    assert not located.in_memd and [s.crc for s in located.info.shards] == [s.crc for s in info.shards]
    rank = relaunched_restores_from_peers(where, agent_factory, rank_on, agents[0], ranks, 4, info.nbytes, model,
                                          opt, "dash-memd restarted empty, then a node killed")
    # torch restarts every rank of the job when one fails: the survivor's too, which restores from its own node
    ranks[1].close()
    model3, opt3 = big_state(seed=98)
    survivor = rank_on(agents[1], 1, 2, model=model3, optimizer=opt3, data=Cursor())
    assert survivor.restore() == 5 and same_state(model, model3)
    save([rank, survivor], 5)  # the job goes on
    with empty.client() as client:
        assert client.locate(JOB).info.step == 5
    rank.close()
    survivor.close()


@VARIANTS
def test_copies_of_two_nodes_of_one_zone_go_to_the_node_of_the_other(in_namespaces, fleet_factory, memd_factory,
                                                                    agent_factory, rank_on):
    where = site(in_namespaces, 3, fleet_factory, memd_factory)
    domains = {"n1": "z1/p1", "n2": "z1/p1", "n3": "z2/p2"}
    agents = [agent_factory(where.memd, env=fleet_env(node, domain), netns=place)
              for (node, domain), place in zip(domains.items(), where.places)]
    placed(agents[0], "n3")
    placed(agents[1], "n3")
    model, opt, sched = trained_objects()
    ranks = [rank_on(agents[r], r, 3, model=model, optimizer=opt, scheduler=sched, data=Cursor(r)) for r in range(3)]
    save(ranks, 6)
    for ckpt in ranks:
        ckpt.close()
    def settled() -> bool:  # n3 holds n1's and n2's step 6, and n3's own copy reached n1 or n2
        held = holdings(where.memd)
        return ({"n1", "n2"} <= set(held.get("n3", {}).get(6, []))
                and "n3" in held.get("n1", {}).get(6, []) + held.get("n2", {}).get(6, []))

    wait_for(settled, 30, "n3 to hold n1's and n2's step 6, and n1 or n2 to hold n3's")
    held = holdings(where.memd)
    # n1 and n2 share a zone and a pool: neither keeps the other's copy; n3's own goes to one of them
    assert "n2" not in held["n1"][6] and "n1" not in held["n2"][6]
    assert sorted(held["n1"][6] + held["n2"][6]) == ["n1", "n2", "n3"]
    status = subprocess.run([sys.executable, "-m", "dashrun", "status", JOB, "--memd", where.memd.address,
                             "--token-file", str(where.memd.token_file)], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "n3  z2/p2  replicas 1  holds n1's, n2's, its own (step 6)" in status.stdout, status.stdout


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def committed(memd) -> int:
    """The newest step of the job committed now, on dash-memd or on the fleet (-1: none)."""
    with memd.client() as client:
        located = client.locate(JOB)
    return -1 if located is None else located.info.step


def rank_processes(node: Node) -> list[psutil.Process]:
    return [p for p in psutil.Process(node.proc.pid).children(recursive=True)
            if any("elastic_train.py" in part for part in p.cmdline())]


def node_env(node: str, domain: str) -> dict[str, str]:
    return {"DASH_NODE": node, "DASH_FAILURE_DOMAIN": domain}


REPLICATED = ("--replicas", "1", "--peer-port", "0", "--peer-memory-limit", "64MiB", "--cloud", "none")


@pytest.mark.slow
@VARIANTS
def test_a_rank_killed_alone_is_restored_from_its_own_nodes_ram(in_namespaces, fleet_factory, memd_factory, nodes,
                                                                tmp_path):
    where = site(in_namespaces, 2, fleet_factory, memd_factory)
    out, steps = tmp_path / "out", 16
    nodes += [Node(where.memd, JOB, out, i + 1, steps, *REPLICATED, "--max-restarts", "1", nnodes="2",
                   netns=where.places[i], env=node_env(f"n{i + 1}", f"z{i + 1}/p{i + 1}")) for i in range(2)]
    wait_for(lambda: newest_step(out) >= 5 or any(n.proc.poll() is not None for n in nodes), 120,
             "the two nodes to train")
    wait_for(lambda: (step := committed(where.memd)) >= 0 and holds(where.memd, "n1", "n2", step)
             and holds(where.memd, "n2", "n1", step), 30, "each node's copy of the newest step at the other")
    (victim,) = rank_processes(nodes[0])
    killed_after = newest_step(out)
    victim.kill()  # the rank alone: its node's launcher and dash-agent stay
    for node in nodes:
        assert node.wait(120) == 0, node.log()[-3000:]
    restored = fetches(nodes[0].log())
    assert restored and fetches(nodes[1].log()), nodes[0].log()[-3000:]  # both nodes' ranks restarted, restored
    for node in nodes:  # every byte of every restore from the node's own dash-agent: nothing over TCP
        assert all(from_own_store(source) for _, source, _ in fetches(node.log())), fetches(node.log())
    print(f"\na rank killed alone: restored step {restored[0][0]} ({restored[0][1]}) in {restored[0][2]:.3f}s")
    assert_redone_at_most(out, steps, 4, killed_after)


@pytest.mark.slow
@pytest.mark.parametrize("in_namespaces", [False, True], ids=["loopback", "namespaces"])
def test_an_elastic_job_behind_a_thin_link_loses_a_node_and_goes_on_from_the_fleets_copies(
        in_namespaces, fleet_factory, memd_factory, nodes, tmp_path):
    where = site(in_namespaces, 2, fleet_factory, memd_factory)
    out, steps, interval, ballast = tmp_path / "out", 40, 4, 4.0
    script = ("--ballast-mib", str(ballast))

    def node(i: int) -> Node:
        return Node(where.memd, JOB, out, i + 1, steps, *REPLICATED, nnodes="1:2", interval=interval, delay=0.15,
                    netns=where.places[i], env=node_env(f"n{i + 1}", f"z{i + 1}/p{i + 1}"), script=script)

    nodes += [node(0), node(1)]
    wait_for(lambda: newest_step(out) >= 10 or any(n.proc.poll() is not None for n in nodes), 120,
             "the two nodes to train")
    assert worlds(out) == [2], nodes[0].log()[-3000:]
    killed_after = newest_step(out)
    nodes[1].stop()  # SIGKILL, the launcher's whole session: its ranks and dash-agent with it
    wait_for(lambda: "world 2 -> 1" in nodes[0].log() or nodes[0].proc.poll() is not None, 60,
             "the survivor to go on alone")
    grown_from = newest_step(out)
    nodes.append(node(1))  # the killed node, relaunched at once: it rejoins at a checkpoint of the smaller world
    for started in (nodes[0], nodes[2]):
        assert started.wait(120) == 0, started.log()[-3000:]
    resumed = [f for f in fetches(nodes[0].log()) if f[0] <= killed_after]
    assert resumed and all(from_own_store(source) for _, source, _ in resumed), nodes[0].log()[-3000:]
    step, source, seconds = resumed[-1]
    nbytes = int(source.split()[0])
    print(f"\nthe survivor resumed at step {step + 1} from its own store ({nbytes} bytes) in {seconds:.3f}s; "
          f"dash-memd's link needs {nbytes / THIN_RATE:.2f}s at {THIN}")
    assert worlds(out) == [2, 1, 2]
    assert_redone_at_most(out, steps, interval, killed_after)
    assert not [s for s, gens in runs_of_steps(out).items() if len(gens) > 1 and s > grown_from + 1], \
        "steps redone at the rejoin"
    assert_each_sample_once(out)
