"""What ``save()`` captures, and the shared buffer a shard is staged into.

:func:`capture` is the synchronous part of a save: it takes every object's
``state_dict()`` and this rank's RNG states, splits them into the
*replicated* state (alike on every rank) and the *private* state
(``per_rank`` objects and ``$rng``), and copies at once the leaves that may
change before the next ``optimizer.step()`` (module buffers change in the
forward pass, for example). Parameters and optimizer state change only in
``optimizer.step()``, so they stay live in the :class:`Snapshot` and the
stager (:mod:`dashrun.rank.stager`) copies them beside the next
forward/backward.

Module buffers (BatchNorm statistics, for example) are not alike on every
rank: each rank updates them in its own forward pass. They leave the
replicated state (their keys stay, holding None, so the state dict keeps its
order) and go to the private state under :data:`BUFFERS`: rank 0's only —
the rank DDP broadcasts buffers from, and the safe choice for a module
without DDP — unless nothing makes them alike again: a
``DistributedDataParallel`` with ``broadcast_buffers=False``, or a sharded
model (FSDP2, tensor parallel), whose buffers every rank saves as its own.
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import mmap
import os
import random
import sys
import threading
import weakref
from typing import Any, Collection, Mapping

import torch

from dashrun.rank import sharded, statetree
from dashrun.util.files import unmap
from dashrun.wire.history import Restored
from dashrun.wire.messages import ShardHeader

__all__ = ["BUFFERS", "SaveStats", "SharedBuffer", "Snapshot", "buffers_per_rank", "capture", "capture_rng",
           "stable_storages"]

#: The key of the private state that holds module buffers: {object name: {state_dict key: tensor}}.
BUFFERS = "$buffers"


@dataclasses.dataclass
class SaveStats:
    snapshots: int = 0   # snapshots started
    skipped: int = 0     # due, but both buffers were still in flight
    stored: int = 0      # shards stored in dash-memd
    failed: int = 0      # shards handed over but not stored
    stall_s: float = 0.0        # total time save() and the optimizer hook blocked training
    last_stall_s: float = 0.0   # the same, for the most recent snapshot


class SharedBuffer:
    """A reusable staging buffer in a memfd: this rank writes it, the agent reads it by descriptor."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.fd = os.memfd_create("dashrun-stage", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self._map = mmap.mmap(self.fd, capacity)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.busy = False
        self._pinned = False
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # Pinned, so device-to-host copies run asynchronously at full speed.
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), capacity, 0)
            self._pinned = int(err) == 0

    def write(self, offset: int, data: bytes) -> None:
        self._map[offset:offset + len(data)] = data

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        unmap(self._map)
        os.close(self.fd)


@dataclasses.dataclass
class Snapshot:
    """One checkpoint of this rank, from ``save()`` (capture) through the stager to dash-memd."""

    step: int
    buffer_index: int
    # What save() captured: trees with leaf indices, and leaves; leaves that could change before the next
    # optimizer.step() are already private copies, the others (parameters, optimizer state) still live.
    rep_tree: Any
    rep_leaves: list[Any]
    priv_tree: Any
    priv_leaves: list[Any]
    # Sharded state (DTensors): every rank's description of each leaf, this rank's pieces and their tensors.
    sharded: list[list[Any]] = dataclasses.field(default_factory=list)
    pieces: list[sharded.Piece] = dataclasses.field(default_factory=list)
    piece_leaves: list[Any] = dataclasses.field(default_factory=list)
    header: ShardHeader | None = None
    buffer: SharedBuffer | None = None
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    handed: threading.Event = dataclasses.field(default_factory=threading.Event)  # result is set (or failed)
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)  # counted stored or failed
    awaited: bool = False  # the optimizer hook has waited for the copy
    emergency: bool = False  # taken because of an interruption notice
    restored: Restored | None = None  # how this rank's run began (its restore), reported with the snapshot
    gpu_ready: Any = None  # CUDA event: the optimizer step that produced this state is done
    gpu_done: Any = None   # CUDA event the compute stream waits on before the next optimizer.step()
    result: concurrent.futures.Future | None = None


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: Python's, torch's, numpy's if it is loaded, CUDA's if it is in use."""
    version, internal, gauss = random.getstate()
    # 625 integers as one tensor, not 625 JSON numbers: this runs inside save(), and through an array, 5x faster
    # than torch.tensor of the tuple.
    internal_tensor = torch.frombuffer(array.array("q", internal), dtype=torch.int64)
    state: dict[str, Any] = {"python": (version, internal_tensor, gauss),
                             "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_initialized():  # (is_available() is slow, and an uninitialised CUDA has no RNG in use)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def stable_storages(objects: Mapping[str, Any]) -> set[int]:
    """Storages that only ``optimizer.step()`` changes: parameters and optimizer state."""
    stable = set()
    for obj in objects.values():
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                stable.update(sharded.local_of(p).untyped_storage().data_ptr() for p in group["params"])
            for per_param in obj.state.values():
                stable.update(sharded.local_of(t).untyped_storage().data_ptr() for t in per_param.values()
                              if isinstance(t, torch.Tensor))
    stable.discard(0)
    return stable


def buffers_per_rank(module: torch.nn.Module) -> bool:
    """Whether every rank keeps its own buffers of ``module``: nothing makes them alike at the next forward —
    DDP that does not broadcast them, or a sharded model (FSDP2, tensor parallel), whose plain buffers each rank
    updates alone."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return not getattr(module, "broadcast_buffers", True)
    return _sharded_module(module)


def _sharded_module(module: torch.nn.Module) -> bool:
    known = _sharded_modules.get(module)
    if known is None:  # once per module, not a walk of every parameter in each save()
        known = _sharded_modules[module] = any(sharded.is_sharded(p) for p in module.parameters())
    return known


#: Whether each module's parameters are DTensors (sharding a module happens before its Checkpointer exists).
_sharded_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: Each module's buffer names, with the state_dict keys they were found for: walking every submodule in each
#: save() costs about a third of state_dict() itself, and a module's buffers rarely change.
_buffer_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _split_buffers(module: torch.nn.Module, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``state`` with None for each buffer, the buffers): buffers by their state_dict keys, in order."""
    keys = tuple(state)
    known = _buffer_names.get(module)
    if known is None or known[0] != keys:
        # Every name of every buffer (a buffer registered twice has two); persistent=False ones are not in state.
        known = _buffer_names[module] = (keys, frozenset(name for name, _ in module.named_buffers(
            remove_duplicate=False)))
    names = known[1]
    held = {key: value for key, value in state.items() if key in names}
    if not held:
        return state, held
    return {key: None if key in held else value for key, value in state.items()}, held


def _keeps_vars(module: torch.nn.Module) -> bool:
    """Whether save() takes ``module.state_dict(keep_vars=True)``: its parameters themselves, not a detached
    copy of each, which for a DTensor goes through its dispatch (about 10 µs a parameter, a quarter of capturing an
    FSDP2 model's state). Only for a sharded module whose class leaves ``state_dict`` as torch has it; the stager
    reads every tensor detached."""
    return type(module).state_dict is torch.nn.Module.state_dict and _sharded_module(module)


def capture(step: int, buffer_index: int, objects: Mapping[str, Any], per_rank: Collection[str], *,
            rank: int = 0, emergency: bool = False, owners: Mapping[str, torch.nn.Module] | None = None) -> Snapshot:
    """The synchronous part of save(): state dicts, RNG, and private copies of what may change soon.

    ``owners`` maps an optimizer of DTensor parameters to their module (see :func:`dashrun.rank.sharded.owners`).
    """
    replicated, buffers = {}, {}
    for name, obj in objects.items():
        if name in per_rank:
            continue
        if isinstance(obj, torch.nn.Module) and _keeps_vars(obj):
            state = obj.state_dict(keep_vars=True)
        else:
            state = sharded.state_dict_of(obj, (owners or {}).get(name))
        if isinstance(obj, torch.nn.Module):
            state, held = _split_buffers(obj, state)
            if held and (rank == 0 or buffers_per_rank(obj)):
                buffers[name] = held
        replicated[name] = state
    private = {name: objects[name].state_dict() for name in sorted(per_rank)}
    if buffers:
        private[BUFFERS] = buffers
    private["$rng"] = capture_rng()
    dtensors: list[Any] = []
    rep_tree, rep_leaves = statetree.flatten(replicated, dtensors)
    priv_tree, priv_leaves = statetree.flatten(private)
    described, pieces, piece_leaves = sharded.local_pieces(dtensors) if dtensors else ([], [], [])
    stable = stable_storages(objects)

    def settled(leaf):  # module buffers change in forward, for example: copy them now
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in stable:
            return leaf.detach().clone()
        return leaf

    snapshot = Snapshot(step, buffer_index, rep_tree, [settled(x) for x in rep_leaves],
                        priv_tree, [settled(x) for x in priv_leaves], described, pieces,
                        [settled(x) for x in piece_leaves], emergency=emergency)
    leaves = (*snapshot.rep_leaves, *snapshot.priv_leaves, *snapshot.piece_leaves)
    if any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves):
        # The side stream starts after the optimizer step that produced this state.
        snapshot.gpu_done = torch.cuda.Event()
        snapshot.gpu_ready = torch.cuda.Event()
        snapshot.gpu_ready.record(torch.cuda.current_stream())
    return snapshot
