"""Bounds on what one side can make another hold: the LIST reply, a rank's pending requests, the agent's threads.

A dash-memd with thousands of jobs still answers ``dashrun status`` and
``ls``, a page at a time, each page within the protocol's MAX_BODY; a job's
summary names a bounded number of nodes, and only nodes whose shard was taken.
A rank's link to its agent forgets the requests it gave up on and holds a
bounded number; the agent runs a bounded number of RESTORE and WAIT threads and
refuses more with BusyError. Against real dash-memd processes where the wire is
the point, in-process parts where a count is.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import wait_for

from dashrun.agent import ranks, service
from dashrun.agent.config import AgentConfig
from dashrun.agent.service import AgentServer
from dashrun.errors import BusyError, NoSpaceError, UnavailableError
from dashrun.memd.store.catalogue import Catalogue
from dashrun.memd.store.listing import KEEP_NODES, LIST_NODES
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.util.daemon import private_listener
from dashrun.wire import agent_link, tls
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import WaitRequest
from dashrun.wire.auth import client_handshake
from dashrun.wire.channel import Channel
from dashrun.wire.messages import JobSpec, ShardHeader
from dashrun.wire.protocol import MAX_BODY, Kind, encode_body

LAYOUT = "cd" * 32


def dashrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun", *args], capture_output=True, text=True, timeout=300)


def one_rank_shard(job: str, step: int, rank: int = 0, world: int = 1, nbytes: int = 64) -> ShardHeader:
    """Rank ``rank``'s shard of a checkpoint whose replicated state (``nbytes`` per rank) the ranks split evenly."""
    return ShardHeader(job, step, rank, world, nbytes * world, nbytes * rank, nbytes * (rank + 1), 0, 0, LAYOUT)


# --- LIST: paged, each page bounded ------------------------------------------------------------------


@pytest.mark.slow
def test_status_and_ls_page_through_thousands_of_jobs_with_long_specs(memd):
    """2,000 jobs with 4 KiB launch specs: 8 MiB of summaries, twice MAX_BODY. Each LIST reply is a page within
    the bound, the pages follow each other in job-id order and together hold every job, once; ``dashrun status``
    shows them all and ``dashrun ls JOB`` asks for its job alone."""
    count = 2000
    argv = ("train.py", *(f"--option-{i}={'v' * 40}" for i in range(80)))
    with memd.client(timeout=30) as client:
        for i in range(count):
            client.put_spec(f"job-{i:05d}", JobSpec(argv, "/work", "node-a", 1e9 + i))

    sock = tls.connect(memd.host, memd.port, tls.TlsSettings(plaintext=bool(memd.tls_args)), timeout=30)
    ch = Channel(sock)
    try:
        ch.settimeout(30)
        client_handshake(ch, memd.token)
        listed, sizes, after = [], [], None
        while True:
            reply = ch.call(Kind.LIST, {"after": after}).body
            sizes.append(len(encode_body(reply)))
            listed += [job["job"] for job in reply["jobs"]]
            assert reply["total"] == count
            if reply["next"] is None:
                break
            assert reply["next"] == listed[-1]
            after = reply["next"]
    finally:
        ch.close()
    assert listed == [f"job-{i:05d}" for i in range(count)]
    assert len(sizes) > 1 and max(sizes) < MAX_BODY
    assert sum(sizes) > MAX_BODY  # what one reply would have had to carry

    args = ["--memd", memd.address, "--token-file", str(memd.token_file), *memd.tls_args]
    status = dashrun("status", *args, "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    jobs = json.loads(status.stdout)["jobs"]
    assert len(jobs) == count and jobs[0]["job"] == f"job-{count - 1:05d}"  # the newest first
    assert jobs[0]["spec"]["argv"] == list(argv)
    table = dashrun("status", *args)
    assert table.returncode == 0 and "job-01234" in table.stdout, table.stderr[-2000:]
    one = dashrun("ls", "job-01234", *args, "--json")
    assert one.returncode == 0 and json.loads(one.stdout)["job"] == "job-01234", one.stderr[-2000:]
    with memd.client() as client:
        assert [j["job"] for j in client.list("job-00007")["jobs"]] == ["job-00007"]
        assert client.list("nobody")["jobs"] == []
        capped = client.list(most=150)
        assert len(capped["jobs"]) == 150 and capped["jobs_left"] == count - 150


def test_a_job_lists_its_most_recent_nodes_and_only_those_whose_shard_was_taken(memd):
    """A shard announced but refused (too large for dash-memd's RAM) names no node; of a job's many nodes its
    summary names the LIST_NODES that sent one most recently, and counts the others."""
    world = LIST_NODES + 36
    with memd.client() as client:
        too_big = ShardHeader("wide", 1, 0, world, 1 << 40, 0, 1 << 40, 0, 0, LAYOUT)
        with pytest.raises(NoSpaceError):
            client.put_shard(too_big, [b""], node="ghost")
        for rank in range(world):
            client.put_shard(one_rank_shard("wide", 2, rank, world), [os.urandom(64)], node=f"node-{rank:03d}")
        (job,) = client.list("wide")["jobs"]
    assert job["newest"]["step"] == 2
    assert sorted(job["nodes"]) == [f"node-{rank:03d}" for rank in range(world - LIST_NODES, world)]
    assert job["nodes_more"] == world - LIST_NODES


def test_a_job_remembers_a_bounded_number_of_nodes(tmp_path):
    """Nodes beyond KEEP_NODES push the least recent out: what dash-memd holds per job does not grow."""
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "disk"))
    cat.put_spec("j", JobSpec(("train.py",), "/work", "node-a", 1e9))
    for i in range(KEEP_NODES + 500):
        cat.node_seen("j", f"node-{i:05d}")
    cat.node_seen("j", "node-00499")  # seen again: the most recent now, so it stays
    (summary,) = cat.jobs()
    assert summary["nodes_more"] == KEEP_NODES - LIST_NODES
    assert "node-00499" in summary["nodes"] and f"node-{KEEP_NODES + 499:05d}" in summary["nodes"]


# --- a rank's link to its agent --------------------------------------------------------------------


class FakeAgent:
    """A Unix socket a rank's AgentLink connects to; the test reads its requests and answers them (or not)."""

    def __init__(self, path):
        self.path = str(path)
        self._listener = private_listener(path)
        self._accepted: list[Channel] = []

    def accept(self) -> Channel:
        self._listener.settimeout(10)
        sock, _ = self._listener.accept()
        ch = Channel(sock)
        ch.settimeout(10)
        self._accepted.append(ch)
        return ch

    def close(self) -> None:
        for ch in self._accepted:
            ch.close()
        self._listener.close()


@pytest.fixture
def fake_agent(short_tmp):
    agent = FakeAgent(short_tmp / "fake.sock")
    yield agent
    agent.close()


def test_a_request_that_timed_out_leaves_nothing_behind_and_its_late_reply_is_dropped(fake_agent):
    link = AgentLink(fake_agent.path)
    r, w = os.pipe()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asked = pool.submit(link.call, Kind.PING, timeout=0.2)
            agent = fake_agent.accept()
            late = agent.recv()
            with pytest.raises(UnavailableError, match="did not answer PING"):
                asked.result(10)
        assert link._pending == {}
        # The late reply, with a descriptor as a RESTORE's carries: dropped, the descriptor closed.
        agent.send(Kind.OK, {"id": late.body["id"], "late": True}, fds=[r])
        os.close(r)
        r = None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(link.call, Kind.PING, timeout=10)
            second = agent.recv()
            agent.send(Kind.OK, {"id": second.body["id"]})
            assert "late" not in answer.result(10).body and link._pending == {}
        with pytest.raises(BrokenPipeError):  # the link closed its copy of the late reply's descriptor
            os.write(w, b"x")
    finally:
        for fd in (r, w):
            if fd is not None:
                os.close(fd)
        link.close()


def test_a_link_holds_a_bounded_number_of_requests_waiting_for_the_agent(fake_agent, monkeypatch):
    monkeypatch.setattr(agent_link, "MAX_PENDING", 3)
    link = AgentLink(fake_agent.path)
    try:
        first = link.request(Kind.PING)
        agent = fake_agent.accept()
        waiting = [first, link.request(Kind.PING), link.request(Kind.PING)]
        refused = link.request(Kind.PING)
        assert isinstance(refused.exception(0), BusyError) and refused.answered  # never sent: nothing is lent
        assert all(not f.done() for f in waiting)
        assert link.forget(waiting[0]) and isinstance(waiting[0].exception(0), UnavailableError)
        taken = link.request(Kind.PING)  # room again
        ids = [agent.recv().body["id"] for _ in range(4)]
        assert ids == [f.request_id for f in (*waiting, taken)]
        for request_id in ids:
            agent.send(Kind.OK, {"id": request_id})
        assert all(f.result(10).kind == Kind.OK for f in (*waiting[1:], taken))
        wait_for(lambda: link._pending == {}, 10, "every answered request forgotten")
    finally:
        link.close()


# --- the agent's helper threads ----------------------------------------------------------------------


def helper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "agent-wait" and t.is_alive()]


def test_the_agent_runs_a_bounded_number_of_restores_and_waits_and_refuses_more(memd, short_tmp, monkeypatch):
    """WAITs beyond a connection's MAX_RANK_HELPERS, or beyond the agent's MAX_HELPERS over all connections, are
    refused at once with BusyError and start no thread; once the running ones end, there is room again."""
    monkeypatch.setattr(ranks, "MAX_RANK_HELPERS", 2)
    monkeypatch.setattr(service, "MAX_HELPERS", 3)  # the agent's count, made with its server
    monkeypatch.setattr(ranks, "MAX_HELPERS", 3)  # what its refusal says
    config = AgentConfig(memd.host, memd.port, memd.token, socket_path=short_tmp / "agent.sock", prefetch=False,
                         tls=tls.TlsSettings(plaintext=bool(memd.tls_args)))
    agent = AgentServer(config)
    agent.start()
    links = [AgentLink(str(config.socket_path)), AgentLink(str(config.socket_path))]
    try:
        wait = WaitRequest("held", 1, 60.0).to_body()
        first = [links[0].request(Kind.WAIT, wait) for _ in range(4)]
        assert [isinstance(f.exception(10), BusyError) for f in first[2:]] == [True, True]
        second = [links[1].request(Kind.WAIT, wait) for _ in range(2)]
        assert isinstance(second[1].exception(10), BusyError)
        assert "dash-agent runs 3 RESTORE and WAIT requests" in str(second[1].exception())
        # Each connection's requests are dispatched in order: the refusals came after the others started.
        assert len(helper_threads()) == 3 and not any(f.done() for f in (*first[:2], second[0]))
        with memd.client() as client:
            assert client.put_shard(one_rank_shard("held", 1), [os.urandom(64)])["committed"]
        assert all(f.result(30).body["committed"] for f in (*first[:2], second[0]))
        wait_for(lambda: not helper_threads(), 30, "the helper threads to end")
        again = [link.request(Kind.WAIT, wait) for link in (links[0], links[0], links[1])]
        assert all(f.result(30).body["committed"] for f in again)  # room again, on both connections
    finally:
        for link in links:
            link.close()
        agent.stop()
