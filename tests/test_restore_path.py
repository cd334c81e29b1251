"""The restore path: byte ranges from dash-memd, the source planner, fetching ahead of the ranks, loading."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import wait_for
from runs import Cursor
from test_checkpointer import fresh_objects, same_state, save_world, trained_objects

from dashrun.agent.restores import ClientPool
from dashrun.errors import NotFoundError, ProtocolError, UnavailableError
from dashrun.wire import layout, planner
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import RestoreRequest
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import ShardHeader
from dashrun.wire.planner import PIECE, Extent, MemdSource, NodeCopy, Planner, Scatter, replicated_span, wanted
from dashrun.wire.protocol import Kind

LAYOUT = "ab" * 32


def one_rank_checkpoint(client, job: str, payload: bytes, layout: str = LAYOUT) -> None:
    header = ShardHeader(job, 1, 0, 1, len(payload), 0, len(payload), 0, 0, layout)
    assert client.put_shard(header, [payload])["committed"]


def test_byte_ranges_of_a_shard(memd):
    payload = os.urandom(3 << 20)
    with memd.client() as client:
        one_rank_checkpoint(client, "ranges", payload)
        for start, length in [(0, 1), (12345, 1 << 20), (len(payload) - 7, 7), (len(payload), 0)]:
            got = bytearray(length)
            client.get_shard_into("ranges", 1, 0, [memoryview(got)], offset=start)
            assert bytes(got) == payload[start:start + length]
        whole = bytearray(len(payload))
        client.get_shard_into("ranges", 1, 0, [memoryview(whole)])
        assert bytes(whole) == payload
        for start, length in [(len(payload) + 1, 0), (len(payload) - 7, 8)]:
            with pytest.raises(ProtocolError):
                client.get_shard_into("ranges", 1, 0, [memoryview(bytearray(length))], offset=start)
        assert client.ping()  # refused requests leave dash-memd serving


def test_a_read_in_pieces_never_mixes_two_attempts_at_one_step(memd):
    """A step committed again (a new attempt at it, of another layout, replaces the one before) while a restore
    reads it in pieces: every further piece of the attempt it began with is refused, by range or through the
    source planner, into one buffer or scattered (as a rank's direct read)."""
    first, second = os.urandom(3 << 20), os.urandom(3 << 20)
    with memd.client() as client:
        one_rank_checkpoint(client, "again", first)
        before = client.latest("again")
        got = bytearray(1 << 20)
        client.get_shard_into("again", 1, 0, [memoryview(got)], offset=5, committed_at=before.committed_at)
        assert bytes(got) == first[5:5 + len(got)]
        one_rank_checkpoint(client, "again", second, layout="cd" * 32)
        after = client.latest("again")
        assert after.committed_at != before.committed_at
        for offset in (None, 1 << 20):
            with pytest.raises(NotFoundError, match="committed again"):
                client.get_shard_into("again", 1, 0, [memoryview(got)], offset=offset,
                                      committed_at=before.committed_at)
    halves = Scatter([(0, memoryview(bytearray(1 << 19))), (1 << 19, memoryview(bytearray(1 << 19)))])
    for into in (memoryview(got), halves):
        with pytest.raises(NotFoundError):
            Planner([MemdSource(memd.client)]).read(before, replicated_span(before, 0, 1 << 20), into)
    Planner([MemdSource(memd.client)]).read(after, replicated_span(after, 0, 1 << 20), halves)
    assert b"".join(bytes(v) for v in halves.views(0, 1 << 20)) == second[:1 << 20]


def test_a_scatter_gives_each_range_the_memory_of_the_places_it_spans():
    one, two, three = bytearray(b"a" * 10), bytearray(b"b" * 5), bytearray(b"c" * 8)
    into = Scatter([(0, memoryview(one)), (10, memoryview(two)), (20, memoryview(three))])  # 15-20: no place
    assert [bytes(v) for v in into.views(3, 13)] == [b"a" * 7, b"b" * 3]
    assert [bytes(v) for v in into.views(20, 28)] == [b"c" * 8]
    assert into.views(0, 0) == []
    for start, stop in [(12, 21), (14, 16), (27, 29), (-1, 2)]:  # through the hole, past the end, before it
        with pytest.raises(ProtocolError, match="no place"):
            into.views(start, stop)
    into.views(0, 15)[1][:] = b"xxxxx"
    assert two == bytearray(b"xxxxx")  # the memory itself, not a copy
    with pytest.raises(ProtocolError, match="overlap"):
        Scatter([(0, memoryview(one)), (9, memoryview(two))])


def test_a_large_shard_is_read_in_pieces_over_several_streams_into_place(memd):
    payload = os.urandom(2 * PIECE + 12345)
    with memd.client() as client:
        one_rank_checkpoint(client, "pieces", payload)
        info = client.latest("pieces")
    tails, size = layout.image_tails(info)
    into = bytearray(size)
    served = Planner([MemdSource(memd.client, streams=3)]).read(info, wanted(info, tails, None), memoryview(into))
    assert served == {"dash-memd": len(payload)}
    assert bytes(into[:len(payload)]) == payload


def test_a_node_fetches_the_replicated_state_and_only_its_own_ranks_private_parts(stack, rank_env, monkeypatch):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "sparse", 4, 6, model, opt, sched, [10, 11, 12, 13])
    with memd.client() as client:
        info = client.latest("sparse")
    tails, _ = layout.image_tails(info)
    extents = wanted(info, tails, range(2, 4))
    tail_ranks = {e.rank for e in extents if e.at >= tails[0]}
    assert tail_ranks == {0, 2, 3}  # rank 0's describes the replicated state
    assert sum(e.nbytes for e in extents) < info.nbytes
    assert sum(e.nbytes for e in wanted(info, tails, None)) == info.nbytes

    # What this node holds is not read again; the rest comes from dash-memd.
    into = bytearray(layout.image_tails(info)[1])
    held = NodeCopy(extents)
    served = Planner([held, MemdSource(memd.client)]).read(info, wanted(info, tails, None), memoryview(into))
    assert served == {"this node": sum(e.nbytes for e in extents),
                      "dash-memd": info.nbytes - sum(e.nbytes for e in extents)}

    # A node whose ranks are 2 and 3 fetches the replicated state and the private parts of 0, 2 and 3; a
    # request for ranks 0 and 1 then fetches only rank 1's part into the same image.
    link = AgentLink(str(agent.socket_path))
    for first in (2, 0):
        reply = link.call(Kind.RESTORE, RestoreRequest("sparse", None, 2, first).to_body(), timeout=30)
        reply.close_fds()
    link.close()
    fetches = [line for line in agent.log().splitlines() if "fetched sparse step 6" in line]
    private = [s.nbytes - (s.rep_end - s.rep_start) for s in info.shards]
    assert len(fetches) == 2, fetches
    assert f"({info.rep_total + private[0] + private[2] + private[3]} bytes from dash-memd)" in fetches[0]
    assert f"({private[1]} bytes from dash-memd)" in fetches[1]

    # Rank 1 of a node running ranks 0 and 1 restores from an image without the other node's parts.
    monkeypatch.setenv("LOCAL_RANK", "1")
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "sparse", 1, 4, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ckpt.local_world = 2
    assert ckpt.restore() == 7
    ckpt.close()
    assert same_state(model, model2) and same_state(opt, opt2)
    assert ckpt.objects["data"].position == 11
    last = [line for line in agent.log().splitlines() if "fetched sparse step 6" in line][-1]
    assert f"({info.rep_total + private[0] + private[1]} bytes from dash-memd)" in last


def test_the_agent_fetches_the_newest_checkpoint_before_its_ranks_ask(memd, agent_factory, rank_env):
    """Started for a job, dash-agent fetches the job's newest checkpoint at once; the rank's restore() is
    served from that image, without reading it again."""
    first = agent_factory(memd)
    model, opt, sched = trained_objects()
    save_world(rank_env, first, "ahead", 1, 3, model, opt, sched, [7])
    first.stop()
    agent = agent_factory(memd, {"DASH_JOB_ID": "ahead"})
    wait_for(lambda: "fetched ahead step 3" in agent.log(), 30, "the agent to fetch ahead of its ranks")
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "ahead", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    assert ckpt.restore() == 4
    ckpt.close()
    assert same_state(model, model2) and same_state(opt, opt2) and ckpt.objects["data"].position == 7
    assert agent.log().count("fetched ahead step 3") == 1  # the rank was served what was fetched ahead


def test_a_fetch_ahead_that_dash_memd_dies_in_leaves_the_ranks_restore_to_fetch_again(memd, agent_factory,
                                                                                     rank_env, monkeypatch):
    first = agent_factory(memd)
    model, opt, sched = trained_objects()
    save_world(rank_env, first, "ahead-crash", 1, 3, model, opt, sched, [7])
    first.stop()
    memd.stop()
    monkeypatch.setenv("DASH_CRASH_AT", "channel.mid_data")  # dies once the first piece of a shard is sent
    memd.start()
    monkeypatch.delenv("DASH_CRASH_AT")
    agent = agent_factory(memd, {"DASH_JOB_ID": "ahead-crash"})
    wait_for(lambda: "ahead of its ranks" in agent.log(), 30, "the fetch ahead to fail")
    assert memd.proc.wait(10) != 0
    memd.start()
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "ahead-crash", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    assert ckpt.restore() == 4
    ckpt.close()
    assert same_state(model, model2) and same_state(opt, opt2) and ckpt.objects["data"].position == 7


def test_restored_optimizer_state_trains_on_and_never_alters_the_image(stack, rank_env):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "train-on", 1, 3, model, opt, sched, [0])
    results = []
    for _ in range(2):  # the second restore reads the same image after the first trained on from it
        model2, opt2, sched2 = fresh_objects()
        ckpt = rank_env(agent, "train-on", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
        assert ckpt.restore() == 4
        assert same_state(opt, opt2)
        torch.manual_seed(5)
        for _ in range(2):
            model2(torch.randn(16, 64)).pow(2).mean().backward()
            opt2.step()
        results.append(model2.state_dict())
        ckpt.close()
    assert not same_state(model, model2)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_extent_split_covers_the_range_in_order():
    extent = Extent(rank=2, start=10, stop=10 + 2 * PIECE + 5, at=1000)
    pieces = extent.split(PIECE)
    assert [p.nbytes for p in pieces] == [PIECE, PIECE, 5]
    assert pieces[0].start == 10 and pieces[-1].stop == extent.stop
    assert all(p.at - extent.at == p.start - extent.start for p in pieces)


def test_a_client_kept_past_dash_memds_idle_timeout_reconnects_by_itself(memd_factory):
    memd = memd_factory("--idle-timeout", "0.5")
    with memd.client() as client:
        assert client.ping()
        wait_for(lambda: not client.idle_and_open(), 10, "dash-memd to close the idle connection")
        assert client.ping()  # not an error: the closed connection is replaced before the request
        assert client.latest("nothing") is None


def test_the_agent_keeps_its_connections_to_dash_memd_between_restores_but_not_dead_ones(memd):
    made = []

    def make():
        made.append(memd.client())
        return made[-1]

    pool = ClientPool(make, most=2)
    for _ in range(3):
        with pool.client() as client:
            assert client.ping()
    assert len(made) == 1  # logged in once
    memd.stop()
    memd.start(memd.port)  # closes every connection it had
    wait_for(lambda: not made[0].idle_and_open(), 10, "the closed connection to read as closed")
    with pool.client() as client:
        assert client.ping()  # not the dead one
    assert len(made) == 2
    pool.close()


def state_tensors(model, opt) -> list[torch.Tensor]:
    return list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()]


class Reads:
    """The ranges this process reads from dash-memd (a rank's direct read), counted as they are asked for."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.calls: list[tuple[int, int]] = []
        self.looked_up: list[tuple] = []
        real_get, real_latest = MemdClient.get_shard_into, MemdClient.latest
        reads = self

        def get_shard_into(self, job, step, rank, views, **kwargs):
            reads.calls.append((rank, sum(len(v) for v in views)))
            if fail_at is not None and len(reads.calls) == fail_at:
                raise UnavailableError("dash-memd went away")
            return real_get(self, job, step, rank, views, **kwargs)

        def latest(self, *args):
            reads.looked_up.append(args)
            return real_latest(self, *args)

        monkeypatch.setattr(MemdClient, "get_shard_into", get_shard_into)
        monkeypatch.setattr(MemdClient, "latest", latest)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.calls)


@pytest.mark.parametrize("with_state", [True, False], ids=["optimizer-state-exists", "no-optimizer-state"])
def test_the_only_rank_of_a_node_reads_the_state_straight_into_the_tensors_it_has(stack, rank_env, monkeypatch,
                                                                                  caplog, with_state):
    """A rank alone on its node reads the replicated state from dash-memd itself, straight into its own tensors:
    the node's image holds the tails alone, every replicated byte is read once (by this process, in pieces that
    split leaves, over several connections, the checkpoint looked up by no piece), the parameters (and the
    optimizer state, where there is one) are the same tensors after as before, and the state equals the saved
    one."""
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "direct", 2, 6, model, opt, sched, [3, 4])  # the replicated state spans 2 shards
    with memd.client() as client:
        info = client.latest("direct")
    monkeypatch.setattr(planner, "PIECE", 4096 + 64)  # pieces smaller than a leaf and not aligned to one
    model2, opt2, sched2 = trained_objects(seed=99, steps=1 if with_state else 0)
    before = {t.data_ptr() for t in state_tensors(model2, opt2)}
    assert bool(opt2.state) == with_state
    ckpt = rank_env(agent, "direct", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    reads = Reads(monkeypatch)
    assert ckpt.restore() == 7
    ckpt.close()
    assert same_state(model, model2) and same_state(opt, opt2) and ckpt.objects["data"].position == 3
    assert "from the node's image" not in caplog.text  # read directly, not by the way back
    after = {t.data_ptr() for t in state_tensors(model2, opt2)}
    assert {t.data_ptr() for t in model2.state_dict().values()} <= before  # the parameters were written in place
    assert (after == before) == with_state  # so was the optimizer's state, where it had one
    assert {rank for rank, _ in reads.calls} == {0, 1} and len(reads.calls) > 4 and not reads.looked_up
    assert info.rep_total - 64 * 1024 < reads.nbytes <= info.rep_total  # the leaves once, and not much between
    fetched = [line for line in agent.log().splitlines() if "fetched direct step 6" in line]
    tails = sum(s.nbytes - (s.rep_end - s.rep_start) for s in info.shards)
    assert len(fetches := fetched) == 1 and f"({tails} bytes from dash-memd)" in fetches[0]  # no replicated bytes
    torch.manual_seed(5)  # and it trains on
    model2(torch.randn(16, 64)).pow(2).mean().backward()
    opt2.step()


def test_a_rank_that_is_not_told_where_dash_memd_is_maps_the_node_image(stack, rank_env, monkeypatch):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "untold", 1, 2, model, opt, sched, [0])
    model2, opt2, sched2 = trained_objects(seed=99, steps=1)
    ckpt = rank_env(agent, "untold", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    monkeypatch.delenv("DASH_MEMD")
    reads = Reads(monkeypatch)
    assert ckpt.restore() == 3
    ckpt.close()
    assert same_state(model, model2) and same_state(opt, opt2) and not reads.calls
    with memd.client() as client:
        nbytes = client.latest("untold").nbytes
    assert any(f"({nbytes} bytes from dash-memd)" in line for line in agent.log().splitlines())


def test_a_rank_of_a_node_of_several_maps_the_node_image_instead(stack, rank_env):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "shared", 1, 2, model, opt, sched, [0])
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "shared", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    ckpt.local_world = 2  # a node of two ranks: one download for both
    assert ckpt.restore() == 3
    ckpt.close()
    assert same_state(model, model2) and same_state(opt, opt2)
    with memd.client() as client:
        nbytes = client.latest("shared").nbytes
    assert any(f"({nbytes} bytes from dash-memd)" in line for line in agent.log().splitlines())


def test_a_direct_read_that_fails_loads_the_checkpoint_from_the_node_image(stack, rank_env, monkeypatch, caplog):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "fallback", 1, 2, model, opt, sched, [0])
    monkeypatch.setattr(planner, "PIECE", 4096)
    model2, opt2, sched2 = trained_objects(seed=99, steps=1)
    ckpt = rank_env(agent, "fallback", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    reads = Reads(monkeypatch, fail_at=3)  # some pieces are in place, then dash-memd "goes away" from this rank
    assert ckpt.restore() == 3
    ckpt.close()
    assert len(reads.calls) >= 3 and same_state(model, model2) and same_state(opt, opt2)
    assert "loading it from the node's image" in caplog.text


def test_only_a_node_of_one_rank_without_a_gpu_skips_the_fetch_ahead():
    from dashrun.launch.launcher import fetch_ahead

    assert fetch_ahead(2) and fetch_ahead(8)  # one download into the image serves every local rank
    assert fetch_ahead(1) == torch.cuda.is_available()  # alone on a CPU, the rank reads straight into its tensors


def test_an_export_reads_every_byte_once_through_the_planner_over_connections_of_its_own(stack, rank_env,
                                                                                       monkeypatch):
    """``dashrun export`` reads as a restore does: every byte of the step once, in pieces over several connections
    (not the caller's), telling its progress up to the checkpoint's size."""
    from dashrun.launch import export

    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "exported", 2, 6, model, opt, sched, [3, 4])
    monkeypatch.setattr(planner, "PIECE", 4096)
    made = []
    real_another = MemdClient.another

    def another(self):
        made.append(real_another(self))
        return made[-1]

    monkeypatch.setattr(MemdClient, "another", another)
    told = []
    with memd.client() as client:
        info = client.latest("exported")
        reads = Reads(monkeypatch)
        _, state = export.fetch_state(client, "exported", None, lambda done, total: told.append((done, total)))
    assert reads.nbytes == info.nbytes and len(reads.calls) > 2 * len(info.shards)
    assert len(made) >= 2 and client not in made
    assert told[-1] == (info.nbytes, info.nbytes) and [d for d, _ in told] == sorted(d for d, _ in told)
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in state["model"].items())
    assert [state["per_rank"][r]["data"]["position"] for r in ("0", "1")] == [3, 4]


@pytest.mark.parametrize("failure", ["dash-memd gone", "connection reset"])
def test_an_export_that_fails_mid_read_says_why_and_not_that_its_image_could_not_close(stack, rank_env,
                                                                                       monkeypatch, failure):
    """A read that fails part-way (dash-memd killed, a link reset) raises that failure, even when the frames of
    its chain still hold views of the export's image: never a BufferError of closing the image instead."""
    from dashrun.launch import export

    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "cut", 2, 6, model, opt, sched, [3, 4])
    monkeypatch.setattr(planner, "PIECE", 4096)
    real_read = MemdClient.get_shard_checked_into
    calls = []

    def read(self, job, step, rank, views, **kw):
        calls.append(views)
        if len(calls) < 3:
            return real_read(self, job, step, rank, views, **kw)
        if failure == "connection reset":
            raise ConnectionResetError(104, "Connection reset by peer")
        try:
            raise OSError(32, "Broken pipe")
        except OSError as e:
            raise UnavailableError("dash-memd closed the connection") from e

    monkeypatch.setattr(MemdClient, "get_shard_checked_into", read)
    expected = UnavailableError if failure == "dash-memd gone" else ConnectionResetError
    with memd.client() as client, pytest.raises(expected) as raised:
        export.fetch_state(client, "cut", None)
    assert not isinstance(raised.value, BufferError) and len(calls) >= 3
