"""``ElasticSampler``: DistributedSampler's order, with a position that survives any change of world size.

A drop-in for :class:`torch.utils.data.distributed.DistributedSampler` (same
arguments, ``set_epoch``, ``len``) with ``state_dict()``/``load_state_dict()``,
for a job whose world size changes between checkpoints.

**Order.** An epoch's order is fixed by ``seed`` and ``epoch`` alone: the same
``torch.randperm(len(dataset))`` DistributedSampler draws (or ``range`` without
``shuffle``), whatever the world size. Started at the beginning of an epoch,
every rank gets exactly the indices DistributedSampler would give it.

**Position.** The state is one number for the whole job: how many samples of
the epoch's order the job has consumed (plus the epoch, the data set's
length, seed and shuffle, to refuse a checkpoint of another data set). It does
not depend on the world size, so every rank holds the same value and rank 0's
copy, restored on a rank of any new world, resumes that rank correctly: the
Checkpointer saves it as *replicated* state. An iteration starting at
position ``p`` at world ``W`` deals the rest of the order round-robin, as
DistributedSampler deals a whole epoch: rank ``r`` gets ``order[p + r]``,
``order[p + r + W]``, ... When every rank has consumed ``k`` of its indices
(ranks step in lockstep), the job has consumed exactly ``order[p : p + k*W]``,
so the position is ``p + k*W`` on every rank. With a per-rank batch of
``G/W`` the ``j``-th global batch is ``order[p + j*G : p + (j+1)*G]`` at any
world size: only who holds which sample changes.

**What counts as consumed.** A DataLoader with workers pulls indices ahead of
the training loop (``prefetch_factor * num_workers`` batches), so counting what
the sampler handed out would run ahead of training. The position counts the
batches the DataLoader handed to the loop instead: when an iteration starts,
the sampler finds the DataLoader iterator that is pulling from it (the caller
a few frames up, once per iteration) and counts the batches that iterator's
``__next__`` returns (it swaps in a subclass of the iterator's own class that
counts after each batch). Indices per batch come from the DataLoader's batch
sampler (``batch_size``, ``drop_last``). This is exact with ``num_workers=0``
and with workers, also after the loop ended or broke off, and the loop stays
``for batch in loader:``. Requirements: the DataLoader keeps its batches in
order (``in_order=True``, the default; ``False`` is refused) and batches with
its own ``batch_size`` (a custom ``batch_sampler`` cannot be read: then, as
when the sampler is iterated by anything but a DataLoader, the indices the
sampler handed out are what counts, exact only for a consumer that does not
read ahead).

**End of the remainder.** Like DistributedSampler: without ``drop_last`` the
remainder is padded to a multiple of the world size with the first indices of
the epoch's order (at most ``W - 1`` samples seen twice, at the epoch's end);
with ``drop_last`` the last ``remainder % W`` are left out. Once every rank has
consumed its share (or the DataLoader's last full batch, with its
``drop_last``), the epoch is complete: the position is ``len(dataset)``.

**Iterations.** An iteration continues the epoch from the job's position; an
iteration abandoned mid-epoch is continued, not restarted, by the next one.
Once an epoch is complete in this process, the next iteration begins it again
(as DistributedSampler does when ``set_epoch`` is not called). An epoch
restored at its end yields nothing: ``for epoch in range(sampler.epoch, E)``
then moves on to the next epoch without seeing one twice. ``set_epoch(e)``
with a new epoch starts it at position 0; with the current epoch it keeps the
position, so a resumed script may call it as before. A DataLoader iterator
created before ``load_state_dict()`` or ``set_epoch()`` is stale: its next
pull raises (create iterators after ``ckpt.restore()``). ``len()`` is this
rank's share of the iteration under way, or of the next one.

**Batches.** ``global_batch_size=G`` keeps the global batch when the world
changes: ``batch_size`` is this rank's share ``G // W`` (``G`` must divide by
``W``). To keep the per-rank batch instead, give the DataLoader a fixed
``batch_size``: the position stays exact; the learning rate is rescaled where
the world changes (the Checkpointer's ``on_world_change`` hook).
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from dashrun.errors import UsageError

__all__ = ["STATE_VERSION", "ElasticSampler"]

#: Version of the state :meth:`ElasticSampler.state_dict` returns; another one is refused.
STATE_VERSION = 1

_STATE_KEYS = frozenset({"version", "epoch", "position", "dataset_len", "seed", "shuffle"})
_MAX_INT = 2**63 - 1
# The attribute of a DataLoader iterator naming the iteration whose batches it counts.
_RUN_ATTR = "_dashrun_elastic_run"
# How far up the stack the DataLoader iterator is looked for: __iter__ <- BatchSampler.__iter__ <- _next_index.
_FRAMES_UP = 6


class _Run:
    """One iteration of the sampler: where it started, this rank's share, and what the consumer has taken."""

    __slots__ = ("start", "share", "usable", "pulled", "batches", "batch", "loader")

    def __init__(self, start: int, share: int):
        self.start = start
        self.share = share
        self.usable = share      # indices the consumer can take: less when the loader drops a partial last batch
        self.pulled = 0          # indices handed out by the sampler
        self.batches: int | None = None   # batches handed to the loop by the DataLoader; None: no loader seen
        self.batch = 1
        self.loader: weakref.ref | None = None   # the DataLoader iterator, while it lives

    def taken(self) -> int:
        """This rank's indices that reached the training loop."""
        return self.pulled if self.batches is None else min(self.pulled, self.batches * self.batch)

    def under_way(self, n: int, world: int) -> bool:
        """Not complete, and (when a DataLoader iterates) its iterator still exists."""
        alive = self.loader is None or self.loader() is not None
        return alive and self.position(n, world) < n

    def position(self, n: int, world: int) -> int:
        taken = self.taken()
        return n if taken >= self.usable else self.start + taken * world


# counting subclass -> the DataLoader iterator class it was made from
_BASES: dict[type, type] = {}


def _counting_next(self):
    """``__next__`` of a counting DataLoader iterator: the base class's, then one more batch for the iteration."""
    data = _BASES[type(self)].__next__(self)
    run = self.__dict__.get(_RUN_ATTR)
    if run is not None and run.batches is not None:
        run.batches += 1
    return data


def _counting_class(base: type) -> type:
    """A subclass of a DataLoader iterator class whose ``__next__`` counts the batches it hands out."""
    if base in _BASES:
        return base
    for cls, made_from in _BASES.items():
        if made_from is base:
            return cls
    cls = type(base.__name__, (base,), {
        "__next__": _counting_next, "__module__": __name__,
        "__doc__": f"{base.__name__} that tells dashrun's ElasticSampler each batch it hands to the loop."})
    _BASES[cls] = base
    return cls


def _loader_iterator(frame: FrameType | None) -> tuple[Any, bool]:
    """(the DataLoader iterator among the callers from ``frame`` up, or None; whether it is inside a ``__next__``
    that will hand out a batch the counting ``__next__`` does not see: a single-process loader's first batch)."""
    for _ in range(_FRAMES_UP):
        if frame is None:
            return None, False
        it = frame.f_locals.get("self")
        if isinstance(it, _BaseDataLoaderIter):
            break
        frame = frame.f_back
    else:
        return None, False
    pending = False
    for _ in range(_FRAMES_UP):
        if frame is None:
            break
        if frame.f_code.co_name == "__next__" and frame.f_locals.get("self") is it:
            if frame.f_code is _counting_next.__code__:
                return it, False     # the counting __next__ is the outer call: it counts this batch itself
            pending = True
        frame = frame.f_back
    return it, pending


def _share(remaining: int, world: int, drop_last: bool) -> int:
    return remaining // world if drop_last else -(-remaining // world)


def _check_int(state: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = state[key]
    if type(value) is not int or not low <= value <= high:
        raise UsageError(f"sampler state from the checkpoint: {key}={value!r:.40} is not an integer in "
                         f"[{low}, {high}]", hint="the checkpoint's data state is damaged or not an ElasticSampler's")
    return value


class ElasticSampler(Sampler[int]):
    """DistributedSampler's order, with a job-wide position in ``state_dict()`` (see the module docstring).

    ``num_replicas`` and ``rank`` default to the initialised process group's.
    ``global_batch_size``, if given, must divide by ``num_replicas``; ``batch_size``
    is then this rank's share of it.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, *, global_batch_size: int | None = None):
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise UsageError("ElasticSampler: no num_replicas/rank given and no process group initialised",
                                 hint="call torch.distributed.init_process_group() first, or pass both")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if type(num_replicas) is not int or num_replicas < 1:
            raise UsageError(f"ElasticSampler: num_replicas={num_replicas!r} is not a positive integer")
        if type(rank) is not int or not 0 <= rank < num_replicas:
            raise UsageError(f"ElasticSampler: rank={rank!r} is not in [0, {num_replicas - 1}]")
        if type(seed) is not int or not -_MAX_INT <= seed <= _MAX_INT:
            raise UsageError(f"ElasticSampler: seed={seed!r} is not a 64-bit integer")
        if global_batch_size is not None:
            if type(global_batch_size) is not int or global_batch_size < 1:
                raise UsageError(f"ElasticSampler: global_batch_size={global_batch_size!r} is not a positive integer")
            if global_batch_size % num_replicas:
                raise UsageError(f"global batch of {global_batch_size} does not split evenly over {num_replicas} "
                                 "ranks", hint="choose a global batch that every world size the job may have divides "
                                 "(--nnodes MIN:MAX x --nproc-per-node), or keep a per-rank batch instead")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.global_batch_size = global_batch_size
        self._epoch = 0
        self._n = len(dataset)
        self._base = 0                    # the position while no iteration is under way
        self._run: _Run | None = None     # the newest iteration; None after set_epoch/load_state_dict

    # -- DistributedSampler's surface --------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """This rank's share of ``global_batch_size``: the DataLoader's ``batch_size``."""
        if self.global_batch_size is None:
            raise UsageError("ElasticSampler.batch_size needs global_batch_size=",
                             hint="pass ElasticSampler(..., global_batch_size=G), or give the DataLoader its own")
        return self.global_batch_size // self.num_replicas

    @property
    def epoch(self) -> int:
        """The epoch whose order is dealt; assigning it is :meth:`set_epoch`."""
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    @property
    def position(self) -> int:
        """Samples of this epoch's order the whole job has consumed (``len(dataset)`` once the epoch is complete)."""
        return self._base if self._run is None else self._run.position(self._n, self.num_replicas)

    @property
    def num_samples(self) -> int:
        """As DistributedSampler's: this rank's indices in an iteration (``len(self)``)."""
        return len(self)

    @property
    def total_size(self) -> int:
        return len(self) * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Order by ``epoch`` from now on; a new epoch starts at position 0, the current one keeps its position."""
        if type(epoch) is not int or not 0 <= epoch <= _MAX_INT:
            raise UsageError(f"ElasticSampler.set_epoch: {epoch!r} is not a non-negative integer")
        if epoch != self._epoch:
            self._epoch, self._base, self._run = epoch, 0, None

    def __len__(self) -> int:
        run = self._run
        if run is not None and run.under_way(self._n, self.num_replicas):
            return run.share
        return _share(self._n - self._next_start(), self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        run = _Run(self._next_start(), 0)
        indices = self._indices(run.start)
        run.share = run.usable = len(indices)
        self._attach_loader(run)
        self._run = run
        return self._yield(run, indices)

    # -- state ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The job's position in the epoch: the same on every rank, valid at any world size."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": self.position, "dataset_len": self._n,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s epoch and position (from a checkpoint: every field is checked before use)."""
        if not isinstance(state, Mapping) or set(state) != _STATE_KEYS:
            keys = sorted(map(str, state))[:8] if isinstance(state, Mapping) else type(state).__name__
            raise UsageError(f"sampler state from the checkpoint is not an ElasticSampler's: {keys!s:.120}",
                             hint="pass data=<the ElasticSampler> to the Checkpointer that saved it")
        _check_int(state, "version", STATE_VERSION, STATE_VERSION)
        n = _check_int(state, "dataset_len", 0, _MAX_INT)
        if n != self._n:
            raise UsageError(f"sampler state from the checkpoint is for a data set of {n} samples, this one has "
                             f"{self._n}", hint="resume with the data set the job was started with")
        if type(state["shuffle"]) is not bool or state["shuffle"] != self.shuffle:
            raise UsageError(f"sampler state from the checkpoint has shuffle={state['shuffle']!r:.20}, this sampler "
                             f"{self.shuffle}", hint="resume with the sampler's arguments the job was started with")
        seed = _check_int(state, "seed", -_MAX_INT, _MAX_INT)
        if seed != self.seed:
            raise UsageError(f"sampler state from the checkpoint has seed {seed}, this sampler {self.seed}",
                             hint="resume with the seed the job was started with")
        epoch = _check_int(state, "epoch", 0, _MAX_INT)
        position = _check_int(state, "position", 0, n)
        self._epoch, self._base, self._run = epoch, position, None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled or copied, the sampler keeps its position but not its link to a live DataLoader iterator."""
        state = self.__dict__.copy()
        state["_base"], state["_run"] = self.position, None
        return state

    # -- inside --------------------------------------------------------------------------------------------------

    def _next_start(self) -> int:
        """Where the next iteration starts: the position, or 0 once this process completed the epoch."""
        position = self.position
        return 0 if position >= self._n and self._run is not None else position

    def _indices(self, start: int) -> list[int]:
        """This rank's round-robin share of ``order[start:]``, padded or cut as DistributedSampler does."""
        n, world = self._n, self.num_replicas
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        rest = order[start:]
        total = _share(len(rest), world, self.drop_last) * world
        if total > len(rest):   # padding, from the epoch's first indices as DistributedSampler pads
            rest += (order * math.ceil((total - len(rest)) / n))[:total - len(rest)]
        return rest[self.rank:total:world]

    def _attach_loader(self, run: _Run) -> None:
        """Count what the DataLoader iterator pulling from us hands to the loop, if it is one we can read."""
        it, pending = _loader_iterator(sys._getframe(2))
        if it is None:
            return
        if getattr(it, "_in_order", True) is False:
            raise UsageError("ElasticSampler needs a DataLoader that keeps its batches in order",
                             hint="drop in_order=False from the DataLoader")
        batcher = getattr(it, "_index_sampler", None)
        if batcher is self:
            batch, drop = 1, False
        elif getattr(batcher, "sampler", None) is self and type(getattr(batcher, "batch_size", None)) is int:
            batch, drop = batcher.batch_size, bool(getattr(batcher, "drop_last", False))
        else:
            return   # a custom batch sampler: count what was handed out
        if batch < 1:
            return
        try:
            it.__class__ = _counting_class(type(it))
        except TypeError:
            return
        run.batch = batch
        if drop:
            run.usable = run.share - run.share % batch
        run.batches = 1 if pending and run.usable else 0
        run.loader = weakref.ref(it)
        setattr(it, _RUN_ATTR, run)

    def _yield(self, run: _Run, indices: list[int]) -> Iterator[int]:
        for index in indices:
            if self._run is not run:
                raise UsageError("this DataLoader iterator began before ElasticSampler.load_state_dict()/"
                                 "set_epoch() moved the sampler", hint="create the iterator (for batch in loader) "
                                 "after ckpt.restore() and set_epoch()")
            run.pulled += 1
            yield index
