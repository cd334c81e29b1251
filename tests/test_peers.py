"""Replicas in the fleet's RAM: the agent's store, the peer link, and the planner's sources that read them.

In-process parts where a rule is the point (the store's policy, the bounds of
every field a peer sends, a corrupted byte caught); real dash-agent processes
on loopback where the wire and the processes are: a shard saved on one node is
held bit-identical by another, a third node restores from it, and a node
whose dash-memd is gone restores from its own store.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import socket
from unittest import mock

import pytest
from conftest import wait_for
from test_checkpointer import save_world, trained_objects

from dashrun.wire.peer_client import PeerClient
from dashrun.agent.peers.server import PeerServer, replica_get_request, replica_put_request
from dashrun.agent.peers import store as store_module
from dashrun.agent.peers.store import Store
from dashrun.errors import AuthError, ChecksumError, ConflictError, DashError, NoSpaceError, NotFoundError, \
    ProtocolError
from dashrun.wire import layout, tls
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import RestoreRequest
from dashrun.wire.auth import client_handshake
from dashrun.wire.channel import Channel
from dashrun.wire.credentials import Credential
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.planner import HeldSource, NodeCopy, PeerSource, Planner, pick_holder, wanted
from dashrun.wire.protocol import Kind, crc32c

LAYOUT = "ef" * 32
MiB = 1 << 20


def shard(job: str, step: int, rank: int, data: bytes, world: int = 1, crc: bool = True) -> ShardHeader:
    """Rank ``rank``'s shard of a checkpoint of ``world`` ranks whose every shard is replicated state alone."""
    n = len(data)
    return ShardHeader(job, step, rank, world, n * world, n * rank, n * (rank + 1), 0, 0, LAYOUT,
                       crc=crc32c(data) if crc else 0)


@pytest.fixture
def credential() -> Credential:
    return Credential.parse(secrets.token_hex(32).encode()).for_job("pj")


@pytest.fixture
def serving(credential):
    """``make(limit)``: a store served on loopback in this process, and a logged-in client of it."""
    made = []

    def make(limit: int = 64 * MiB) -> tuple[Store, PeerServer]:
        store = Store(limit)
        server = PeerServer(store, credential, "127.0.0.1", 0, auth_timeout=5.0)
        server.start()
        made.append((store, server))
        return store, server

    yield make
    for store, server in made:
        server.stop()
        store.close()


# --- the store ------------------------------------------------------------------------------------


def test_the_store_keeps_the_newest_committed_step_and_the_one_arriving_and_drops_older():
    data = os.urandom(MiB)
    store = Store(3 * MiB)

    def held() -> list[tuple[int, int, str]]:
        return [(h.header.step, h.header.rank, h.owner) for h in store.holdings()]
    try:
        store.put(shard("pj", 1, 0, data, world=2), "a", [data])
        store.put(shard("pj", 1, 1, data, world=2), "b", [data])
        store.committed("pj", 1)
        store.put(shard("pj", 2, 0, data, world=1), "a", [data])  # arriving: kept beside the committed step
        assert held() == [(1, 0, "a"), (1, 1, "b"), (2, 0, "a")]
        # Full: step 3 of node a supersedes its step 2, never committed; step 1, the newest committed, stays,
        # and so do the copies of node b, which left: its replacement may need them.
        used = store.used
        store.put(shard("pj", 3, 0, data, world=1), "a", [data])
        assert held() == [(1, 0, "a"), (1, 1, "b"), (3, 0, "a")]
        assert store.used == used  # step 2's memory was reused, none made
        # Step 3 committed (at the new world size): every copy of step 1 goes.
        store.committed("pj", 3)
        assert held() == [(3, 0, "a")]
        assert [h.committed for h in store.holdings()] == [True]
        with pytest.raises(ConflictError):
            store.put(shard("pj", 2, 0, data), "a", [data])  # older than what is committed: not kept
    finally:
        store.close()
    assert store.used == 0


def test_the_next_checkpoint_a_few_bytes_longer_or_shorter_reuses_the_memory_of_the_one_before():
    """A model's shard changes size by a few bytes between checkpoints (its layout description): the store
    writes it into the segment the superseded step left, not into fresh memory (which costs 0.6-0.8 s per GiB
    on the build VM), and its limit counts the shards' bytes."""
    store = Store(2 * MiB + 4096)
    try:
        made = []
        real = store_module._Segment

        def counted(capacity):
            made.append(capacity)
            return real(capacity)

        with mock.patch.object(store_module, "_Segment", counted):
            for step, size in enumerate((MiB, MiB + 5, MiB - 3, MiB + 17, MiB)):
                data = os.urandom(size)
                store.put(shard("pj", step, 0, data), "a", [data])  # never committed: each supersedes the last
                assert store.used <= 2 * MiB + 22
                with store.open("pj", step, 0) as (view, _, header):
                    assert bytes(view) == data and header.nbytes == size
        assert len(made) == 2  # the first two steps' segments, then only those again
        with pytest.raises(NoSpaceError):  # the limit still holds: a shard much larger needs what is held
            store.put(shard("pj", 9, 0, bytes(3 * MiB)), "a", [bytes(3 * MiB)])
    finally:
        store.close()
    assert store.used == 0


def test_a_shard_that_cannot_fit_is_refused_with_one_line_naming_the_numbers_and_the_option():
    data = os.urandom(MiB)
    store = Store(2 * MiB)
    try:
        with pytest.raises(NoSpaceError) as too_large:
            store.reserve(shard("pj", 1, 0, bytes(3 * MiB)), "a")
        assert "3.0 MiB" in str(too_large.value) and "2.0 MiB" in str(too_large.value)
        assert "--peer-memory-limit" in str(too_large.value) and "\n" not in str(too_large.value)
        store.put(shard("pj", 1, 0, data, world=3), "a", [data])
        store.committed("pj", 1)
        store.put(shard("pj", 2, 0, data, world=3), "a", [data])
        # The newest committed step and the one arriving are all it holds: nothing may go.
        with pytest.raises(NoSpaceError) as full:
            store.put(shard("pj", 2, 1, data, world=3), "a", [data])
        assert "must keep" in str(full.value) and "--peer-memory-limit" in str(full.value)
        assert len(store.holdings()) == 2
    finally:
        store.close()


def test_the_store_reads_ranges_checked_against_the_bytes_as_they_arrived():
    data = os.urandom(3 * MiB + 123)
    store = Store(8 * MiB)
    try:
        header = store.put(shard("pj", 1, 0, data), "a", [data], expected=crc32c(data))
        for start, length in [(0, len(data)), (5, 10), (MiB - 1, MiB + 2), (len(data) - 7, 7), (len(data), 0)]:
            out = bytearray(length)
            assert store.read("pj", 1, 0, header.crc, start, [memoryview(out)])
            assert bytes(out) == data[start:start + length]
        assert not store.read("pj", 1, 0, header.crc ^ 1, 0, [memoryview(bytearray(1))])  # another attempt's
        assert not store.read("pj", 2, 0, header.crc, 0, [memoryview(bytearray(1))])
        with pytest.raises(ProtocolError):
            store.read("pj", 1, 0, header.crc, len(data) - 1, [memoryview(bytearray(2))])
        with store.open("pj", 1, 0) as (view, _, _):
            view[2 * MiB + 9] ^= 0x40  # a bit flips in RAM
        for start, length in [(2 * MiB, 100), (0, len(data))]:  # an edge block, and a block inside the range
            with pytest.raises(ChecksumError):
                store.read("pj", 1, 0, header.crc, start, [memoryview(bytearray(length))])
        with pytest.raises(ChecksumError):  # a copy that does not match the checksum announced is not kept
            store.put(shard("pj", 3, 0, data), "a", [data], expected=header.crc ^ 1)
        assert [h.header.step for h in store.holdings()] == [1]
    finally:
        store.close()


# --- the peer link, in this process ------------------------------------------------------------------


def test_a_replica_is_held_bit_identical_and_read_back_by_range(serving, credential):
    store, server = serving()
    data = os.urandom(5 * MiB + 77)
    header = shard("pj", 4, 0, data)
    with PeerClient(*server.address, credential) as client:
        assert client.put_replica(header, "node-a", [data], committed=3) == header.crc
        whole = bytearray(len(data))
        client.get_into("pj", 4, 0, header.crc, 0, [memoryview(whole)])
        assert bytes(whole) == data
        part = bytearray(MiB + 3)
        client.get_into("pj", 4, 0, header.crc, MiB - 1, [memoryview(part)[:10], memoryview(part)[10:]])
        assert bytes(part) == data[MiB - 1:2 * MiB + 2]
        with pytest.raises(NotFoundError):
            client.get_into("pj", 4, 0, header.crc ^ 1, 0, [memoryview(bytearray(4))])
        with pytest.raises(ChecksumError):  # the holder checks the bytes against the header's crc
            client.put_replica(shard("pj", 5, 0, data, crc=False), "node-a", [data])
        client.ping()  # refusals leave the link in step
    assert [(h.header.step, h.owner) for h in store.holdings()] == [(4, "node-a")]


def test_a_shard_over_the_holders_limit_is_refused_before_a_byte_of_it_is_sent(serving, credential):
    store, server = serving(limit=2 * MiB)
    with PeerClient(*server.address, credential) as client:
        with pytest.raises(NoSpaceError, match=r"3\.0 MiB.*2\.0 MiB.*--peer-memory-limit"):
            client.put_replica(shard("pj", 1, 0, bytes(3 * MiB)), "node-a", [bytes(3 * MiB)])
        client.ping()
    assert store.used == 0


def test_a_byte_corrupted_at_the_holder_is_caught_by_the_reader(serving, credential):
    store, server = serving()
    data = os.urandom(3 * MiB)
    header = shard("pj", 1, 0, data)
    with PeerClient(*server.address, credential) as client:
        client.put_replica(header, "node-a", [data])
        with store.open("pj", 1, 0) as (view, _, _):
            view[MiB + 5] ^= 1  # inside a block the holder does not read again: its marks say what it was
        for start, length in [(0, len(data)), (MiB, 10)]:
            with pytest.raises(ChecksumError):
                client.get_into("pj", 1, 0, header.crc, start, [memoryview(bytearray(length))])
        client.ping()  # a fresh connection after the failed one


def test_only_the_jobs_own_credential_logs_in(serving, credential):
    _, server = serving()
    token = secrets.token_hex(32).encode()
    for other in (Credential.parse(token).for_job("pj"), Credential.parse(token).for_job("another")):
        with pytest.raises(AuthError):
            PeerClient(*server.address, other).ping()
    # The cluster's token is refused too: the agent holds one job's credential, not the token.
    with pytest.raises(AuthError), contextlib.closing(raw_connection(server)) as ch:
        client_handshake(ch, token)
    PeerClient(*server.address, credential).ping()


def raw_connection(server: PeerServer) -> Channel:
    return Channel(tls.connect(*server.address, tls.TlsSettings(), timeout=10))


def logged_in(server: PeerServer, credential: Credential) -> Channel:
    ch = raw_connection(server)
    client_handshake(ch, credential.file_bytes().strip())
    return ch


GOOD = shard("pj", 1, 0, b"x" * 10).to_body()


@pytest.mark.parametrize("body", [
    {"owner": "a"},
    {"shard": "not an object", "owner": "a"},
    {"shard": {k: v for k, v in GOOD.items() if k != "crc"}, "owner": "a"},
    {"shard": {**GOOD, "crc": 1 << 32}, "owner": "a"},
    {"shard": {**GOOD, "rank": 1}, "owner": "a"},
    {"shard": {**GOOD, "job": "../etc"}, "owner": "a"},
    {"shard": {**GOOD, "rep_end": 1 << 60, "rep_total": 1 << 60}, "owner": "a"},
    {"shard": GOOD, "owner": "x" * 256},
    {"shard": GOOD, "owner": "two words"},
    {"shard": GOOD},
    {"shard": GOOD, "owner": "a", "committed": -1},
    {"shard": GOOD, "owner": "a", "committed": True},
], ids=lambda b: str(b)[:60])
def test_replica_put_bodies_are_bounded_field_by_field(body):
    with pytest.raises(ProtocolError):
        replica_put_request(body)


@pytest.mark.parametrize("change", [
    {"job": "a b"}, {"step": -1}, {"rank": 1 << 16}, {"crc": -1}, {"crc": 1 << 32}, {"offset": 1 << 51},
    {"length": -1}, {"length": 1.5}, {"rank": None},
], ids=str)
def test_replica_get_bodies_are_bounded_field_by_field(change):
    body = {"job": "pj", "step": 1, "rank": 0, "crc": 7, "offset": 0, "length": 10, **change}
    with pytest.raises(ProtocolError):
        replica_get_request(body)


def test_hostile_requests_on_the_link_are_refused_and_the_holder_serves_on(serving, credential):
    store, server = serving(limit=4 * MiB)
    data = os.urandom(1000)
    header = shard("pj", 1, 0, data)
    with PeerClient(*server.address, credential) as client:
        client.put_replica(header, "node-a", [data])

    def refused(frames, what=DashError) -> None:
        with contextlib.closing(logged_in(server, credential)) as ch:
            for kind, body in frames[:-1]:
                ch.call(kind, body)
            kind, body = frames[-1]
            with pytest.raises(what):
                ch.call(kind, body)

    other = {**shard("other", 1, 0, data).to_body()}
    refused([(Kind.REPLICA_PUT, {"shard": other, "owner": "a"})])  # another job's shard
    refused([(Kind.REPLICA_GET, {"job": "other", "step": 1, "rank": 0, "crc": header.crc, "offset": 0,
                                 "length": 1})])
    refused([(Kind.REPLICA_GET, {"job": "pj", "step": 1, "rank": 0, "crc": header.crc, "offset": 999,
                                 "length": 2})])  # past the shard's end
    # An announced replica followed by anything but its bytes, or by more bytes than announced.
    refused([(Kind.REPLICA_PUT, {"shard": header.to_body(), "owner": "a"}), (Kind.REPLICA_GET, {})])
    with contextlib.closing(logged_in(server, credential)) as ch:
        ch.call(Kind.REPLICA_PUT, {"shard": shard("pj", 2, 0, data).to_body(), "owner": "a"})
        with pytest.raises(DashError):
            ch.call(Kind.REPLICA_PUT, {}, data=[data + b"more"])
    # Nothing is accepted before the login but a HELLO of at most 4 KiB.
    with contextlib.closing(raw_connection(server)) as ch:
        ch.send(Kind.REPLICA_GET, {"job": "pj", "step": 1, "rank": 0, "crc": header.crc, "offset": 0,
                                   "length": 1})
        with pytest.raises(DashError):
            ch.expect_reply()
    with contextlib.closing(raw_connection(server)) as ch:
        ch.send(Kind.HELLO, {"nonce": "0" * 64, "pad": "x" * 8192})
        with pytest.raises(DashError):
            ch.expect_reply()
    assert [h.header.step for h in store.holdings()] == [1]
    with PeerClient(*server.address, credential) as client:
        out = bytearray(len(data))
        client.get_into("pj", 1, 0, header.crc, 0, [memoryview(out)])
        assert bytes(out) == data


def test_connections_beyond_the_unauthenticated_budget_are_closed_at_once(credential):
    store = Store(MiB)
    server = PeerServer(store, credential, "127.0.0.1", 0, max_unauthenticated=2, auth_timeout=30.0)
    server.start()
    idle = [socket.create_connection(server.address) for _ in range(2)]
    try:
        wait_for(lambda: server._logging_in == 2, what="two idle connections taken")  # noqa: SLF001
        third = socket.create_connection(server.address)
        third.settimeout(10)
        assert third.recv(1) == b""  # closed without a byte read
        third.close()
    finally:
        for sock in idle:
            sock.close()
        server.stop()
        store.close()


# --- the planner's sources ----------------------------------------------------------------------------


def checkpoint(job: str, step: int, datas: list[bytes]) -> CheckpointInfo:
    world = len(datas)
    n = len(datas[0])
    shards = tuple(ShardHeader(job, step, r, world, n * world, n * r, n * (r + 1), 0, 0, LAYOUT,
                               crc=crc32c(d)) for r, d in enumerate(datas))
    return CheckpointInfo(job, step, world, n * world, LAYOUT, 1.0, shards)


class Bytes:
    """A last source that holds everything (as dash-memd does): the reference bytes."""

    name = "reference"

    def __init__(self, datas: list[bytes]):
        self.datas = datas

    def holds(self, info, extent) -> bool:
        return True

    def read(self, info, extents, image) -> None:
        for e in extents:
            image[e.at:e.at + e.nbytes] = self.datas[e.rank][e.start:e.stop]


def test_restore_sources_in_order_own_store_then_peers_then_dash_memd(serving, credential):
    datas = [os.urandom(2 * MiB + 11) for _ in range(3)]
    info = checkpoint("pj", 9, datas)
    own = Store(16 * MiB)
    own.put(info.shards[0], "me", [datas[0]])
    peer_a, server_a = serving()
    peer_b, server_b = serving()
    peer_a.put(info.shards[1], "n1", [datas[1]])
    peer_b.put(info.shards[1], "n1", [datas[1]])
    holders = {1: [("a", *server_a.address), ("b", *server_b.address)]}

    @contextlib.contextmanager
    def connect(peer):
        with PeerClient(peer[1], peer[2], credential) as client:
            yield client

    tails, size = layout.image_tails(info)
    image = bytearray(size)
    try:
        served = Planner([NodeCopy(), HeldSource(own), PeerSource(holders, connect, "me"), Bytes(datas)]).read(
            info, wanted(info, tails, None), memoryview(image))
        assert served == {"this agent's store": len(datas[0]), "peers": len(datas[1]), "reference": len(datas[2])}
        assert bytes(image[:info.rep_total]) == b"".join(datas)
        # A holder whose copy went bad: its pieces come from the other holder; both bad: from the next source.
        for store in (peer_a, peer_b):
            with store.open("pj", 9, 1) as (view, _, _):
                view[MiB + 1] ^= 1
            image[:] = bytes(size)
            served = Planner([HeldSource(own), PeerSource(holders, connect, "me"), Bytes(datas)]).read(
                info, wanted(info, tails, None), memoryview(image))
            assert bytes(image[:info.rep_total]) == b"".join(datas)
        assert served["reference"] == len(datas[1]) + len(datas[2])
        # A store that dropped the shard since the plan was made: the next source serves it.
        own.committed("pj", 10)
        assert not HeldSource(own).holds(info, wanted(info, tails, None)[0])
    finally:
        own.close()


def test_restoring_nodes_spread_over_the_holders():
    holders = [(f"h{i}", "127.0.0.1", 7000 + i) for i in range(4)]
    firsts = [pick_holder(f"node-{n}", 3, holders)[0] for n in range(64)]
    assert {h[0] for h in firsts} == {h[0] for h in holders}
    assert max(firsts.count(h) for h in holders) < 32
    assert sorted(pick_holder("node-1", 3, holders)) == sorted(holders)
    assert pick_holder("x", 0, []) == []


# --- real dash-agents on loopback ----------------------------------------------------------------------


def peer_address(agent) -> tuple[str, int]:
    found = wait_for(lambda: re.search(r"serving the job's other agents on ([\d.]+):(\d+)", agent.log()),
                     what="the agent's peer address in its log")
    return found.group(1), int(found.group(2))


def test_shards_saved_on_one_node_are_held_by_its_peer_restored_from_it_and_from_the_nodes_own_store(
        memd, agent_factory, rank_env):
    """Node b listens; node a (--peer b) saves a world of two ranks: b holds both shards bit-identical, read back
    over the peer link; node c (--peer b) restores them from b; with dash-memd gone, node a restores from its
    own store. A wrong credential is refused by a real agent."""
    job = {"DASH_JOB_ID": "pj", "DASH_REPLICAS": "1", "DASH_PEER_PORT": "0", "DASH_PEER_MEMORY_LIMIT": "64MiB"}
    node_b = agent_factory(memd, env=job)
    b_host, b_port = peer_address(node_b)
    assert b_host == "127.0.0.1"  # where its link to dash-memd goes out from
    given = {**job, "DASH_PEERS": f"{b_host}:{b_port}"}
    node_a = agent_factory(memd, env=given)
    model, opt, sched = trained_objects()
    save_world(rank_env, node_a, "pj", 2, 6, model, opt, sched, [3, 4])
    with memd.client() as client:
        info = client.latest("pj")
        saved = []
        for s in info.shards:
            saved.append(bytearray(s.nbytes))
            client.get_shard_into("pj", 6, s.rank, [memoryview(saved[-1])])
    credential = Credential.parse(memd.token).for_job("pj")

    def held_by_b(rank: int) -> bool:
        got = bytearray(len(saved[rank]))
        try:
            with PeerClient(b_host, b_port, credential) as client:
                client.get_into("pj", 6, rank, info.shards[rank].crc, 0, [memoryview(got)])
        except NotFoundError:
            return False
        return got == saved[rank]
    for rank in range(2):
        wait_for(lambda: held_by_b(rank), what=f"node b to hold rank {rank}'s shard")
    with pytest.raises(AuthError):
        PeerClient(b_host, b_port, Credential.parse(memd.token).for_job("other")).ping()
    with pytest.raises(AuthError):
        PeerClient(b_host, b_port, Credential.parse(secrets.token_hex(32).encode()).for_job("pj")).ping()

    # Node c fetches the job's newest checkpoint as it starts: from node b, none of it from dash-memd.
    node_c = agent_factory(memd, env=given)
    fetched = wait_for(lambda: re.search(r"fetched pj step 6 \((.*)\)", node_c.log()), what="node c's fetch")
    assert fetched.group(1) == f"{info.nbytes} bytes from peers", fetched.group(0)

    # dash-memd is gone after the commit: node a restores from its own store, without the network.
    tails, size = layout.image_tails(info)
    memd.kill()
    link = AgentLink(str(node_a.socket_path))
    try:
        # (A rank that would read dash-memd directly is given the image: dash-memd is not the only holder.)
        reply = link.call(Kind.RESTORE, RestoreRequest("pj", None, 2, 0, direct=True).to_body(), timeout=60)
        try:
            assert reply.body["found"] and len(reply.fds) == 1 and not reply.body.get("direct")
            with mmap.mmap(reply.fds[0], size, prot=mmap.PROT_READ) as image:
                for s, tail in zip(info.shards, tails):
                    rep = s.rep_end - s.rep_start
                    assert image[s.rep_start:s.rep_end] == saved[s.rank][:rep]
                    assert image[tail:tail + s.nbytes - rep] == saved[s.rank][rep:]
        finally:
            reply.close_fds()
    finally:
        link.close()
    lines = [line for line in node_a.log().splitlines() if "fetched pj step 6" in line]
    assert f"({info.nbytes} bytes from this agent's store)" in lines[-1], lines[-1]


# --- the sender of this node's replicas, and the agent's options ---------------------------------------


def test_replicas_go_to_the_holders_named_and_a_holder_that_is_down_costs_only_itself(serving, credential):
    from dashrun.agent.peers.replicas import Replicator

    holder_store, holder = serving()
    own = Store(16 * MiB)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = ("down", "127.0.0.1", unused.getsockname()[1])  # nobody listens there
    holders = [("me", "127.0.0.1", 1), down, ("up", *holder.address)]
    sender = Replicator(own, "me", 2, lambda: holders,
                        lambda host, port: PeerClient(host, port, credential, connect_timeout=2.0)).start()
    try:
        assert sender.chosen() == [down, ("up", *holder.address)]  # never itself
        data = os.urandom(2 * MiB)
        first = own.put(shard("pj", 1, 0, data), "me", [data])
        own.committed("pj", 1)
        sender.submit(first)
        assert sender.wait_idle(30)
        assert sender.sent == {"up": 1}
        assert [(h.header.step, h.owner) for h in holder_store.holdings()] == [(1, "me")]
        # The next step's replica says which step is committed: the holder lets the older one go.
        second = own.put(shard("pj", 2, 0, data), "me", [data])
        own.committed("pj", 2)
        sender.submit(second)
        assert sender.wait_idle(30)
        assert [(h.header.step, h.committed) for h in holder_store.holdings()] == [(2, True)]
        # A shard the store dropped before its turn is not sent.
        sender.submit(first)
        assert sender.wait_idle(30) and sender.sent == {"up": 2}
    finally:
        sender.stop()
        own.close()


def test_the_agent_keeps_no_shards_unless_asked_and_refuses_what_cannot_work(credential):
    from dashrun.agent.config import DEFAULT_PEER_MEMORY, AgentConfig
    from dashrun.errors import UsageError

    base = {"memd_host": "127.0.0.1", "memd_port": 7070, "token": b"t" * 64}
    assert AgentConfig(**base).store_limit == 0  # no replicas: nothing kept, nothing served (as before)
    assert AgentConfig(**base, replicas=1).store_limit == DEFAULT_PEER_MEMORY
    assert AgentConfig(**base, peer_memory_limit=MiB).store_limit == MiB  # its own snapshot alone
    for bad in ({"replicas": -1}, {"peer_port": 70000}, {"peer_memory_limit": -1}):
        with pytest.raises(UsageError):
            AgentConfig(**base, **bad)
    store = Store(MiB)
    first = PeerServer(store, credential, "127.0.0.1", 0)
    first.start()
    try:
        with pytest.raises(UsageError, match=r"cannot listen for its peers on 127\.0\.0\.1:\d+.*--peer-port"):
            PeerServer(store, credential, "127.0.0.1", first.address[1]).start()
    finally:
        first.stop()
        store.close()
