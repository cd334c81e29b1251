"""ElasticSampler: one job-wide position, every sample of an epoch once across any sequence of world sizes.

A "job" here is one sampler per rank in this process, stepping in lockstep as DDP ranks do; a change of world
size is rank 0's state, through a checkpoint's round trip, loaded into the samplers of the new world. The
DataLoader tests use real DataLoaders, with real worker processes where they say so.
"""

import collections
import copy as copy_module
import gc
import io
import itertools
import json
import multiprocessing
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import dashrun
from dashrun.data.sampler import ElasticSampler
from dashrun.errors import UsageError
from dashrun.rank import statetree

SEED = 7


def order(n, epoch=0, seed=SEED):
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


def through_json(state):
    return json.loads(json.dumps(state))


def through_torch_save(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def through_checkpointer(state):
    """As the Checkpointer stores it: statetree's JSON skeleton (no tensors in it)."""
    skeleton, leaves = statetree.flatten(state)
    assert leaves == []
    return statetree.unflatten(through_json(skeleton), [])


def job(dataset, world, state=None, **kwargs):
    samplers = [ElasticSampler(dataset, world, rank, seed=SEED, **kwargs) for rank in range(world)]
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(state)
    return samplers


def run_steps(samplers, steps, batch):
    """Up to ``steps`` lockstep steps of ``batch`` indices per rank: [[rank 0's batch, rank 1's, ...], ...]."""
    iterators = [iter(sampler) for sampler in samplers]
    done = []
    for _ in range(steps):
        step = [list(itertools.islice(it, batch)) for it in iterators]
        if not any(step):
            break
        done.append(step)
    return done


def flat(steps):
    return [index for step in steps for batch in step for index in batch]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_fresh_epoch_is_exactly_distributed_samplers(shuffle, drop_last):
    data = list(range(23))
    for world in (1, 3, 4, 5):
        for rank in range(world):
            theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            ours = ElasticSampler(data, world, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            theirs.set_epoch(3)
            ours.set_epoch(3)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs) == ours.num_samples


@pytest.mark.parametrize("round_trip", [through_json, through_torch_save, through_checkpointer])
def test_worlds_3_2_4_1_see_every_sample_once_and_the_same_global_batches(round_trip):
    n, global_batch = 240, 12
    data, expected = list(range(n)), order(n)
    history, state = [], None
    for world, steps in ((3, 4), (2, 5), (4, 3), (1, 100)):
        samplers = job(data, world, state, global_batch_size=global_batch)
        assert samplers[0].batch_size == global_batch // world
        done = run_steps(samplers, steps, samplers[0].batch_size)
        positions = {s.state_dict()["position"] for s in samplers}
        assert len(positions) == 1                        # one value for the job, on every rank
        history += done
        state = round_trip(samplers[0].state_dict())      # rank 0's copy is what every rank of the next world gets
    assert sorted(flat(history)) == data                  # every sample of the epoch exactly once
    assert len(history) == n // global_batch
    for j, step in enumerate(history):                    # the j-th global batch does not depend on the world
        assert sorted(i for batch in step for i in batch) == sorted(expected[j * global_batch:(j + 1) * global_batch])
    assert state["position"] == n


def test_a_fixed_per_rank_batch_also_sees_every_sample_once_and_pads_only_the_last_step():
    n, batch = 101, 5
    data, history, state = list(range(n)), [], None
    for world, steps in ((3, 2), (2, 3), (4, 2), (1, 100)):
        samplers = job(data, world, state)
        history += run_steps(samplers, steps, batch)
        state = through_json(samplers[0].state_dict())
        assert state["position"] == min(n, sum(len(b) for step in history for b in step))
    assert sorted(flat(history)) == data                  # the last world is 1: nothing to pad
    history, state = [], None
    for world, steps in ((3, 2), (4, 100)):               # ends at world 4: 101 - 30 = 71 left, padded to 72
        samplers = job(data, world, state)
        history += run_steps(samplers, steps, batch)
        state = samplers[0].state_dict()
    seen = collections.Counter(flat(history))
    assert set(seen) == set(data) and sum(seen.values()) == n + 1
    assert [i for i, c in seen.items() if c == 2] == order(n)[:1] and state["position"] == n
    assert flat(history[:-1]).count(order(n)[0]) == 1     # the repeat is in the last step


def test_a_rollback_replaces_the_lost_steps():
    n, batch = 120, 4
    data = list(range(n))
    samplers = job(data, 3)
    committed = run_steps(samplers, 3, batch)
    saved = through_torch_save(samplers[0].state_dict())
    lost = run_steps(samplers, 4, batch)                  # consumed, then the node died before the next checkpoint
    assert lost and samplers[0].position == 7 * 3 * batch
    for world in (3, 2):                                  # rolled back at the old world, or at a smaller one
        rest = run_steps(job(data, world, saved), 1000, batch)
        assert sorted(flat(committed + rest)) == data


def test_the_order_is_fixed_by_seed_and_epoch_and_the_same_at_every_world():
    n = 60
    data = list(range(n))
    for epoch in (0, 1, 2):
        global_orders = []
        for world in (1, 2, 3, 4):
            samplers = job(data, world)
            for sampler in samplers:
                sampler.set_epoch(epoch)
            per_rank = [list(sampler) for sampler in samplers]
            global_orders.append([per_rank[i % world][i // world] for i in range(n)])
        assert all(o == order(n, epoch) for o in global_orders)
    assert order(n, 0) != order(n, 1) and order(n, 0) != order(n, 0, seed=SEED + 100)
    assert list(ElasticSampler(data, 1, 0, shuffle=False)) == data


def test_set_epoch_starts_a_new_epoch_at_zero_and_keeps_the_current_one():
    n = 40
    data = list(range(n))
    samplers = job(data, 2)
    run_steps(samplers, 3, 2)
    assert samplers[0].position == 12
    samplers[0].set_epoch(0)                              # a resumed script calls set_epoch(sampler.epoch): kept
    assert samplers[0].position == 12 and samplers[0].state_dict()["epoch"] == 0
    samplers[0].set_epoch(1)
    assert samplers[0].position == 0 and len(samplers[0]) == n // 2
    assert list(samplers[0]) == order(n, 1)[0::2]
    with pytest.raises(UsageError):
        samplers[0].set_epoch(-1)
    samplers[1].epoch = 1                                 # DistributedSampler users assign it: the same as set_epoch
    assert samplers[1].position == 0 and samplers[1].state_dict()["epoch"] == 1


def test_an_epoch_restored_at_its_end_yields_nothing_and_one_completed_here_begins_again():
    data = list(range(10))
    sampler = ElasticSampler(data, 2, 1, seed=SEED)
    first = list(sampler)
    assert sampler.position == 10 and len(sampler) == 5
    assert list(sampler) == first                         # as DistributedSampler without set_epoch
    restored = ElasticSampler(data, 3, 1, seed=SEED)
    restored.load_state_dict(through_json(sampler.state_dict()))
    assert len(restored) == 0 and list(restored) == []    # the epoch is done: a loop over epochs moves on
    assert len(restored) == 4 and len(list(restored)) == 4


def test_the_end_of_a_remainder_at_a_new_world_pads_or_drops_as_distributed_sampler():
    data, expected = list(range(10)), order(10)
    state = {"version": 1, "epoch": 0, "position": 3, "dataset_len": 10, "seed": SEED, "shuffle": True}
    padded = job(data, 4, state)                          # 7 left over 4 ranks: 2 each, 1 padded from the start
    assert [len(s) for s in padded] == [2, 2, 2, 2]
    got = [list(s) for s in padded]
    assert sorted(i for r in got for i in r) == sorted(expected[3:] + expected[:1])
    assert {s.position for s in padded} == {10}
    dropped = job(data, 4, state, drop_last=True)         # 1 each; the last 3 of the order are left out
    got = [list(s) for s in dropped]
    assert got == [[expected[3 + r]] for r in range(4)] and {s.position for s in dropped} == {10}
    tiny = job(data, 4, dict(state, position=8), drop_last=True)   # 2 left, 4 ranks: nothing, and the epoch ends
    assert [list(s) for s in tiny] == [[]] * 4 and {s.position for s in tiny} == {10}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_reports_what_the_loop_took_not_what_it_prefetched(workers):
    n, batch, world = 64, 4, 2
    data = list(range(n))
    samplers = job(data, world)
    loaders = [DataLoader(data, batch_size=batch, sampler=s, num_workers=workers) for s in samplers]
    iterators = [iter(loader) for loader in loaders]
    taken = []
    for step in range(1, 4):
        taken += [next(it).tolist() for it in iterators]
        assert [s.state_dict()["position"] for s in samplers] == [step * batch * world] * world
    if workers:                                           # the workers ran ahead; the position did not
        assert samplers[0]._run.pulled > 3 * batch
    state = through_json(samplers[0].state_dict())
    del iterators                                         # the loop broke off: the position stays where it was
    gc.collect()
    assert samplers[0].position == 3 * batch * world and len(samplers[0]) == (n - 24) // world
    new = job(data, 3, state)                             # resumed at world 3, also with workers
    for loader in (DataLoader(data, batch_size=batch, sampler=s, num_workers=workers) for s in new):
        taken += [b.tolist() for b in loader]
    seen = collections.Counter(i for b in taken for i in b)
    assert set(seen) == set(data) and sum(seen.values()) == n + 2     # 40 left over 3 ranks: 2 padded
    assert {s.position for s in new} == {n}
    assert not multiprocessing.active_children()


def test_a_pickled_or_copied_sampler_keeps_the_position():
    data = list(range(40))
    sampler = ElasticSampler(data, 2, 0, seed=SEED)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    it = iter(loader)
    next(it)
    for copy in (pickle.loads(pickle.dumps(sampler)), copy_module.deepcopy(sampler)):
        assert copy.state_dict() == sampler.state_dict() and copy.position == 8
        assert list(copy) == order(40)[8::2]


def test_a_loader_that_drops_its_last_partial_batch_completes_the_epoch():
    data = list(range(30))
    sampler = ElasticSampler(data, 2, 0, seed=SEED)       # 15 indices, batches of 4: 3 batches, 3 left out
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    positions = [sampler.position for _ in loader]
    assert positions == [8, 16, 30]


def test_persistent_workers_count_each_epoch():
    data = list(range(24))
    sampler = ElasticSampler(data, 2, 0, seed=SEED)
    loader = DataLoader(data, batch_size=3, sampler=sampler, num_workers=1, persistent_workers=True)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        positions, seen = [], []
        for b in loader:
            positions.append(sampler.position)
            seen += b.tolist()
        assert positions == [6, 12, 18, 24] and seen == order(24, epoch)[0::2]
    del loader
    gc.collect()
    assert not multiprocessing.active_children()


def test_an_iterator_made_before_the_restore_is_refused():
    data = list(range(20))
    sampler = ElasticSampler(data, 2, 0, seed=SEED)
    stale = iter(sampler)
    next(stale)
    sampler.load_state_dict({"version": 1, "epoch": 0, "position": 6, "dataset_len": 20, "seed": SEED,
                             "shuffle": True})
    with pytest.raises(UsageError, match="ckpt.restore"):
        next(stale)
    assert list(sampler) == order(20)[6::2]


def test_an_out_of_order_dataloader_is_refused():
    data = list(range(20))
    loader = DataLoader(data, batch_size=2, sampler=ElasticSampler(data, 1, 0), num_workers=1, in_order=False)
    with pytest.raises(UsageError, match="in order"):
        iter(loader)
    gc.collect()
    assert not multiprocessing.active_children()


def test_global_batch_size_must_split_over_the_world():
    data = list(range(10))
    assert ElasticSampler(data, 4, 0, global_batch_size=32).batch_size == 8
    with pytest.raises(UsageError, match="does not split evenly over 3 ranks") as err:
        ElasticSampler(data, 3, 0, global_batch_size=32)
    assert "hint:" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UsageError, match="global_batch_size"):
        ElasticSampler(data, 3, 0).batch_size
    for bad in ({"num_replicas": 0, "rank": 0}, {"num_replicas": 2, "rank": 2}, {"num_replicas": 2, "rank": -1}):
        with pytest.raises(UsageError):
            ElasticSampler(data, **bad)


GOOD = {"version": 1, "epoch": 2, "position": 5, "dataset_len": 10, "seed": SEED, "shuffle": True}


@pytest.mark.parametrize("state,words", [
    (dict(GOOD, dataset_len=11), "data set of 11 samples, this one has 10"),
    (dict(GOOD, position=11), "position=11"),
    (dict(GOOD, position=-1), "position=-1"),
    (dict(GOOD, position=True), "position=True"),
    (dict(GOOD, position="5"), "position='5'"),
    (dict(GOOD, position=5.0), "position=5.0"),
    (dict(GOOD, epoch=2**63), "epoch="),
    (dict(GOOD, version=2), "version=2"),
    (dict(GOOD, seed=SEED + 1), "seed 8, this sampler 7"),
    (dict(GOOD, shuffle=False), "shuffle=False"),
    (dict(GOOD, shuffle=1), "shuffle=1"),
    (dict(GOOD, extra=1), "not an ElasticSampler's"),
    ({k: v for k, v in GOOD.items() if k != "position"}, "not an ElasticSampler's"),
    ([1, 2], "not an ElasticSampler's: list"),
    ({"x" * 10_000: 1}, "not an ElasticSampler's"),
])
def test_a_bad_state_from_a_checkpoint_is_refused_in_one_line(state, words):
    sampler = ElasticSampler(list(range(10)), 2, 0, seed=SEED)
    run_steps([sampler], 1, 2)
    with pytest.raises(UsageError) as err:
        sampler.load_state_dict(state)
    message = str(err.value)
    assert words in message and "\n" not in message and len(message) < 400
    assert sampler.state_dict() == dict(GOOD, epoch=0, position=4)   # unchanged: 2 indices x 2 ranks
    sampler.load_state_dict(GOOD)
    assert sampler.state_dict() == GOOD


def test_it_is_exported_lazily_and_needs_a_world():
    assert dashrun.ElasticSampler is ElasticSampler and "ElasticSampler" in dashrun.__all__
    if not torch.distributed.is_initialized():
        with pytest.raises(UsageError, match="no process group"):
            ElasticSampler(list(range(4)))


def test_the_world_comes_from_the_process_group_by_default():
    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = ElasticSampler(list(range(6)), seed=SEED)
        assert (sampler.num_replicas, sampler.rank) == (1, 0) and list(sampler) == order(6)
    finally:
        dist.destroy_process_group()
