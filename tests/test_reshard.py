"""Resharding's parts, without processes: which bytes of a saved piece a rank reads, how pieces fill a tensor,
and what a peer may ask for (the full paths run in tests/test_sharded.py)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dashrun.errors import ProtocolError, UnavailableError, UsageError
from dashrun.rank import sharded, statetree
from dashrun.wire import layout
from dashrun.wire.agent_messages import MAX_RANGES, RestoreRequest
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.planner import pieces, wanted


@st.composite
def boxes(draw):
    """A shape, and a box in it (offsets, lengths), each length at least 1."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    offsets = [draw(st.integers(0, n - 1)) for n in sizes]
    lengths = [draw(st.integers(1, n - o)) for n, o in zip(sizes, offsets)]
    return sizes, offsets, lengths


@settings(max_examples=300, deadline=None)
@given(boxes(), st.sampled_from([1, 2, 4, 8]))
def test_byte_runs_are_exactly_the_bytes_of_the_box(box, itemsize):
    sizes, offsets, lengths = box
    flat = torch.arange(math.prod(sizes)).view(sizes)
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        flat = flat.narrow(dim, o, n)
    expected = {i * itemsize + b for i in flat.reshape(-1).tolist() for b in range(itemsize)}
    runs = sharded.byte_runs(sizes, offsets, lengths, itemsize)
    got = [b for start, stop in runs for b in range(start, stop)]
    assert sorted(got) == sorted(expected) and len(got) == len(set(got))
    assert all(a[1] < b[0] for a, b in zip(runs, runs[1:])), "runs that touch are joined, in order"


def test_byte_runs_of_a_box_cut_in_too_many_rows_is_the_range_around_it():
    sizes, offsets, lengths = [sharded.MAX_RUNS + 10, 8], [3, 2], [sharded.MAX_RUNS + 2, 4]
    assert sharded.byte_runs(sizes, offsets, lengths, 4) == [((3 * 8 + 2) * 4, ((3 + lengths[0] - 1) * 8 + 6) * 4)]
    assert sharded.byte_runs([], [], [], 4) == [(0, 4)]  # a scalar


def saved_as(tensor: torch.Tensor, cuts: list[list[int]]) -> tuple[list[sharded.SavedPiece], torch.Tensor]:
    """``tensor`` saved as the grid of pieces that ``cuts`` (per dimension, the starts) make, in one region."""
    bounds = [list(zip(c, [*c[1:], n])) for c, n in zip(cuts, tensor.shape)]
    saved, blobs, at = [], [], 0
    import itertools

    for rank, box in enumerate(itertools.product(*bounds)):
        part = tensor
        for dim, (start, stop) in enumerate(box):
            part = part.narrow(dim, start, stop - start)
        blob = part.contiguous().reshape(-1).view(torch.uint8)
        saved.append(sharded.SavedPiece(rank, tuple(s for s, _ in box), tuple(e - s for s, e in box), at))
        blobs.append(blob)
        at += blob.numel()
    return saved, torch.cat(blobs)


@pytest.mark.parametrize("cuts", [[[0, 3, 7], [0]], [[0, 5], [0, 2, 3]], [[0], [0, 1]]])
def test_reads_planned_by_torch_fill_a_tensor_from_any_grid_of_pieces(cuts):
    source = torch.randn(11, 5)
    saved, region = saved_as(source, cuts)
    target = torch.zeros(11, 5)
    reads = sharded.plan_reads("model.w", ["float32", [11, 5]], saved, target)
    for read in reads:
        start = read.piece.at
        read.copy(region[start:start + math.prod(read.piece.sizes) * 4])
    assert torch.equal(target, source)
    read_bytes = sum(stop - start for read in reads for start, stop in read.runs())
    assert read_bytes == target.numel() * 4


def test_a_shape_or_piece_that_cannot_be_mapped_is_one_line_naming_the_key_and_both_shapes():
    saved, _ = saved_as(torch.zeros(6, 4), [[0, 3], [0]])
    with pytest.raises(UsageError, match=r"model\.layers\.0\.weight: saved shape \(6, 4\), shape here \(8, 4\)"):
        sharded.plan_reads("model.layers.0.weight", ["float32", [6, 4]], saved, torch.zeros(8, 4))
    with pytest.raises(UsageError, match="cover 12 of the 24"):
        sharded.plan_reads("w", ["float32", [6, 4]], saved[:1], torch.zeros(6, 4))
    with pytest.raises(UsageError, match="saved float32, here float64"):
        sharded.plan_reads("w", ["float32", [6, 4]], saved, torch.zeros(6, 4, dtype=torch.float64))


def test_a_sharded_placeholder_round_trips_through_the_skeleton():
    skeleton, leaves = statetree.flatten({"a": torch.ones(2)})
    tree = statetree.unflatten({"w": {"$S": 3}, "b": [{"$S": 0}]}, leaves)
    places = list(sharded.sharded_paths(tree, statetree.Sharded))
    assert [(path, leaf.index) for path, leaf in places] == [(("w",), 3), (("b", 0), 0)]


def info_of(shards: list[ShardHeader]) -> CheckpointInfo:
    return CheckpointInfo(job="j", step=1, world=len(shards), rep_total=shards[0].rep_total, layout="0" * 64,
                          committed_at=0.0, shards=tuple(shards))


def header(rank: int, private: int, pieces_len: int) -> ShardHeader:
    return ShardHeader(job="j", step=1, rank=rank, world=2, rep_total=128, rep_start=64 * rank,
                       rep_end=64 * (rank + 1), private_len=private, meta_len=100, layout="0" * 64,
                       pieces_len=pieces_len)


def test_a_node_fetches_every_layout_description_but_no_piece_of_sharded_state_until_a_rank_asks():
    info = info_of([header(0, 1000, 900), header(1, 800, 800)])
    tails, _ = layout.image_tails(info)
    got = wanted(info, tails, ranks=[1])
    shard0, shard1 = info.shards
    assert sorted((e.rank, e.start, e.stop) for e in got) == [
        (0, 0, 64), (0, 64, 64 + 100), (0, 64 + 1000, shard0.nbytes),  # replicated, own private, description
        (1, 0, 64), (1, 64 + 800, shard1.nbytes)]                        # no piece, the description
    asked = pieces(info, tails, [(1, 0, 800), (0, 150, 200)])
    assert [(e.rank, e.start, e.stop, e.at) for e in asked] == [(1, 64, 864, tails[1]), (0, 214, 264, tails[0] + 150)]
    for bad in [(2, 0, 1), (0, 0, 1001), (1, 5, 801)]:
        with pytest.raises(ProtocolError):
            pieces(info, tails, [bad])


@pytest.mark.parametrize("ranges", [
    [[0, 1]], [[0, 5, 1]], [[-1, 0, 1]], [[0, 0, True]], "x", [[0, 0, 1]] * (MAX_RANGES + 1), [[1 << 40, 0, 1]]])
def test_a_restore_request_with_malformed_ranges_is_refused(ranges):
    with pytest.raises(ProtocolError):
        RestoreRequest.from_body({"job": "j", "step": 1, "ranges": ranges})


def test_a_restore_request_carries_its_ranges_and_an_empty_list_is_not_none():
    request = RestoreRequest("j", 4, 2, 0, ((1, 0, 64),))
    assert RestoreRequest.from_body(request.to_body()) == request
    assert RestoreRequest.from_body(RestoreRequest("j", 4, ranges=()).to_body()).ranges == ()
    assert RestoreRequest.from_body(RestoreRequest("j", 4).to_body()).ranges is None
    batch = RestoreRequest("j", 4, 2, 0, ((1, 0, 64),), more=True)
    assert RestoreRequest.from_body(batch.to_body()) == batch
    with pytest.raises(ProtocolError, match="'more'"):
        RestoreRequest.from_body({**batch.to_body(), "more": 1})


@pytest.fixture
def fake_world():
    """A process group of ``world`` ranks in which this process is ``rank`` (torch's fake backend: no peers)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def dtensor(mesh_shape: tuple[int, ...], placements: list, shape: list[int]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", mesh_shape)
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    return DTensor.from_local(torch.randn(local_shape), mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


@pytest.mark.parametrize("rank, saves", [(0, [((0, 0), (3, 4))]), (1, [((3, 0), (3, 4))]), (2, []), (3, [])])
def test_a_piece_replicated_over_a_mesh_dimension_is_saved_by_its_coordinate_0_only(fake_world, rank, saves):
    from torch.distributed.tensor import Replicate, Shard

    fake_world(rank, 4)
    leaf = dtensor((2, 2), [Replicate(), Shard(0)], [6, 4])  # HSDP: replica groups of two shards
    described, pieces_, tensors = sharded.local_pieces([leaf])
    assert described == [["float32", [6, 4]]]
    assert [(p.offsets, p.sizes) for p in pieces_] == saves
    assert all(t is leaf._local_tensor for t in tensors)


def test_an_uneven_split_leaves_the_last_rank_no_piece_to_save(fake_world):
    from torch.distributed.tensor import Shard

    fake_world(3, 4)
    leaf = dtensor((4,), [Shard(0)], [3, 5])  # torch.chunk: 1, 1, 1 and nothing
    assert sharded.local_pieces([leaf])[1] == []


def test_a_dtensor_in_per_rank_state_is_refused_with_its_path(fake_world):
    from torch.distributed.tensor import Shard

    fake_world(0, 2)
    leaf = dtensor((2,), [Shard(0)], [4, 2])
    with pytest.raises(UsageError, match=r"state\.data\.w: DTensor"):
        statetree.flatten({"data": {"w": leaf}})
    skeleton, leaves = statetree.flatten({"m": {"w": leaf, "v": leaf}}, found := [])
    assert skeleton == {"m": {"w": {"$S": 0}, "v": {"$S": 0}}} and found == [leaf] and leaves == []


def test_an_export_assembles_each_tensor_whole_and_lets_each_piece_go_once_copied():
    source = torch.randn(9, 6)
    saved, region = saved_as(source, [[0, 4], [0, 3]])
    released = []
    full = sharded.assemble([["float32", [9, 6]]], {0: saved}, region, [0] * len(saved),
                            lambda start, stop: released.append((start, stop)))
    assert torch.equal(full[0], source)
    assert released == [(p.at, p.at + math.prod(p.sizes) * 4) for p in saved]


def test_an_export_of_a_step_gone_while_it_is_read_says_so_and_lets_go_of_its_memory():
    from dashrun.errors import NotFoundError
    from dashrun.launch.export import fetch_state

    info = info_of([header(0, 1000, 0), header(1, 800, 0)])

    class Client:  # a dash-memd that drops the step between LATEST and its bytes (retention, dashrun rm)
        def latest(self, job, step=None):
            return info

        def another(self):  # the export's own connections, which read the bytes
            return contextlib.nullcontext(self)

        def get_shard_checked_into(self, job, step, rank, views, offset=0, committed_at=None):
            assert views is not None  # this frame holds them (an argument), as a receive in progress does
            raise NotFoundError(f"{job} has no committed checkpoint of step {step} with rank {rank}")

    with pytest.raises(NotFoundError, match="no committed checkpoint of step 1"):
        fetch_state(Client(), "j", None)  # not a BufferError from a mapping that views still pin


def test_ranges_in_batches_are_read_again_when_the_image_they_went_into_is_replaced(monkeypatch):
    """The agent restarted (or the image expired) between two batches: the last image lacks the first batch's
    ranges, so every batch is sent again, into one image."""
    import os

    from dashrun.rank import restore
    from dashrun.wire.agent_messages import RestoreReply
    from dashrun.wire.channel import Frame
    from dashrun.wire.protocol import Kind

    monkeypatch.setattr(restore, "MAX_RANGES", 2)
    first, second = os.memfd_create("image-a"), os.memfd_create("image-b")
    served = iter([first, second, second, second])  # batch 1 into one image, batch 2 into another, then both
    sent = []

    def fake_fetch(link, request, on_wait):
        sent.append(request)
        return RestoreReply(found=True), Frame(Kind.RESTORE, {}, 0, [os.dup(next(served))])

    monkeypatch.setattr(restore, "fetch", fake_fetch)
    request = RestoreRequest("j", 4, 1, 0, ((0, 0, 8), (0, 16, 24), (1, 0, 8)))
    try:
        reply, frame = restore.fetch_ranges(None, request, lambda message: None)
        assert reply.found and os.fstat(frame.fds[0]).st_ino == os.fstat(second).st_ino
        frame.close_fds()
        assert [(len(r.ranges), r.more) for r in sent] == [(2, True), (1, False)] * 2
        served = iter([first, second] * 3)  # never one image: it gives up, with one line
        with pytest.raises(UnavailableError, match="replaced 3 times"):
            restore.fetch_ranges(None, request, lambda message: None)
    finally:
        os.close(first)
        os.close(second)
