"""Sharded state (DTensor: FSDP2, tensor parallel, 2-D meshes): each rank saves its own pieces, restore reshards.

At ``save()`` a DTensor of the state is a *sharded leaf*: the description
every rank shares holds its dtype and global shape (``{"$S": index}`` in the
tree, see :func:`dashrun.rank.statetree.flatten`), and each rank puts its
local piece in its own part of the shard, with the piece's offsets and sizes
in the global tensor as torch describes them (``DTensor.__create_chunk_list__``,
the description torch.distributed.checkpoint saves). A piece replicated over
a mesh dimension (HSDP's replica groups, a replicated TP weight) is saved by
coordinate 0 of that dimension only.

At ``restore()`` each rank asks its current DTensors which pieces of the
global tensors it holds, and torch's own resharding rule
(``create_read_items_for_chunk_list``, which ``torch.distributed.checkpoint``
loads with) says which byte ranges of which saved pieces they overlap. Only
those ranges are fetched (see :func:`byte_runs`), then copied into place.

An optimizer whose parameters are DTensors is saved and loaded through
``torch.distributed.checkpoint.state_dict`` (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``): its state is keyed by parameter name, so it
reshards with the parameters, and comes back in the optimizer as it had it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import sys
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from dashrun.errors import UsageError

__all__ = ["MAX_RUNS", "Piece", "Read", "SavedPiece", "assemble", "byte_runs", "is_sharded", "joined", "load_state",
           "local_pieces", "owners", "plan_reads", "state_dict_of"]

#: Most byte ranges one saved piece is read in (a column band of a row-major piece is a range per row); beyond
#: that the smallest range covering them is read. A restore sends any number of them, in batches.
MAX_RUNS = 16384


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor where nothing uses it)."""
    module = type(value).__module__
    return module.startswith("torch.distributed.tensor") and type(value).__name__ == "DTensor"


def local_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's bytes: a DTensor's local piece, a plain tensor itself."""
    return value._local_tensor if is_sharded(value) else value


@dataclasses.dataclass(frozen=True)
class Piece:
    """This rank's piece of sharded leaf ``index``, at ``offsets`` with ``sizes`` in the global tensor."""

    index: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def local_pieces(leaves: Sequence[Any]) -> tuple[list[list[Any]], list[Piece], list[torch.Tensor]]:
    """(every rank's description of the sharded leaves, the pieces this rank saves, their local tensors)."""
    described, pieces, tensors = [], [], []
    for index, leaf in enumerate(leaves):
        described.append([str(leaf.dtype).removeprefix("torch."), list(leaf.shape)])
        local = leaf._local_tensor  # (to_local() is an autograd function: slower, and the same tensor here)
        for offsets, sizes in _saved_chunks(leaf):
            if sizes != tuple(local.shape):
                raise UsageError(f"cannot checkpoint a DTensor whose local piece {tuple(local.shape)} is not its "
                                 f"chunk {sizes}", hint="dashrun saves one piece per rank")
            pieces.append(Piece(index, offsets, sizes))
            tensors.append(local)
    return described, pieces, tensors


#: id(DTensorSpec) -> (the spec, its hash, the chunks this rank saves of a DTensor of it): a save asks for every
#: leaf, and torch's answer, the same each time, costs about as much as the rest of capturing it. A parameter or
#: optimizer state keeps its spec from one step to the next; the spec is held, so its id names no other meanwhile,
#: and its hash (which torch keeps, and forgets when a field of the spec is set) tells if it was changed in place.
_chunk_cache: dict[int, tuple[Any, int, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}


def _saved_chunks(leaf: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of each chunk of ``leaf`` this rank saves: none where it is not in the leaf's mesh,
    where it holds a replica (coordinate 0 of a replicated mesh dimension saves it) or an empty piece."""
    spec = leaf._spec
    known = _chunk_cache.get(id(spec))
    if known is not None and known[0] is spec and known[1] == hash(spec):
        return known[2]
    chunks = []
    coordinate = leaf.device_mesh.get_coordinate()
    if coordinate is not None and not any(c != 0 for c, p in zip(coordinate, leaf.placements)
                                          if p.is_replicate() or p.is_partial()):
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in leaf.__create_chunk_list__()
                  if math.prod(c.sizes)]  # an uneven split leaves some ranks nothing
    if len(_chunk_cache) > 4096:  # meshes come and go (an elastic restart makes new ones): forget old ones
        _chunk_cache.clear()
    _chunk_cache[id(spec)] = (spec, hash(spec), chunks)
    return chunks


# --- which state a sharded object saves --------------------------------------------------------------------


def owners(objects: Mapping[str, Any]) -> dict[str, torch.nn.Module]:
    """Optimizers whose parameters are DTensors, each with the module (of ``objects``) those parameters are of."""
    modules = [obj for obj in objects.values() if isinstance(obj, torch.nn.Module)]
    found = {}
    for name, obj in objects.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = [p for group in obj.param_groups for p in group["params"]]
        if not any(is_sharded(p) for p in params):
            continue
        mine = {id(p) for p in params}
        module = next((m for m in modules if any(id(p) in mine for p in m.parameters())), None)
        if module is None:
            raise UsageError(f"{name}= holds DTensor parameters of no module given to the Checkpointer",
                             hint="pass the sharded model too, e.g. Checkpointer(model=model, optimizer=optimizer)")
        found[name] = module
    return found


def state_dict_of(obj: Any, owner: torch.nn.Module | None) -> Any:
    """What ``save()`` takes of ``obj``: an optimizer of DTensors by parameter name, anything else as it says.

    ``get_optimizer_state_dict`` answers with ``obj.state_dict()``, each parameter's number replaced by its
    name in ``owner``; working the names out again costs half of a sharded save()'s time on the training thread.
    So torch is asked once, and while the optimizer has state and the same parameters of the same module, the
    names it gave are put on ``obj.state_dict()`` (see :data:`_optimizer_names`)."""
    if owner is None:
        return obj.state_dict()
    params = [p for group in obj.param_groups for p in group["params"]]
    known = _optimizer_names.get(obj)
    if (known is not None and known[0] is owner and obj.state and len(known[1]) == len(params)
            and all(map(operator.is_, known[1], params))):
        return _named(obj.state_dict(), known[2])
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(owner, obj)
    names = [name for group in state["param_groups"] for name in group["params"]]
    # Names that torch derives only from the module's structure: not where FSDP1 flattens parameters (its optimizer
    # state is rewritten, not renamed), nor where a parameter has none.
    if len(names) == len(params) and not _has_fsdp1(owner):
        _optimizer_names[obj] = (owner, tuple(params), names)
    return state


#: Per optimizer of DTensors: (its module, its parameters in order, the name ``get_optimizer_state_dict`` gave each).
_optimizer_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _named(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name as ``get_optimizer_state_dict`` keys it."""
    return {"state": {names[number]: value for number, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[number] for number in group["params"]]}
                             for group in state["param_groups"]]}


def _has_fsdp1(module: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    return fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in module.modules())


def load_state(obj: Any, owner: torch.nn.Module | None, state: Any) -> None:
    if owner is None:
        obj.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(owner, obj, state)


# --- restore: what to read, and copying it --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavedPiece:
    """A piece saved by rank ``rank`` at byte ``at`` of its private part (see :mod:`dashrun.rank.stager`)."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: int


@dataclasses.dataclass
class Read:
    """Bytes of one saved piece that one local tensor needs: ``lengths`` from ``source_offsets`` of the piece
    to ``dest_offsets`` of ``dest``."""

    piece: SavedPiece
    dtype: torch.dtype
    dest: torch.Tensor
    dest_offsets: tuple[int, ...]
    source_offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def runs(self) -> list[tuple[int, int]]:
        """The byte ranges of the piece's private part this read needs."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return [(self.piece.at + start, self.piece.at + stop)
                for start, stop in byte_runs(self.piece.sizes, self.source_offsets, self.lengths, itemsize)]

    def copy(self, piece_bytes: torch.Tensor) -> None:
        """Copy from the piece's bytes (uint8, the whole piece) into ``dest``."""
        source = piece_bytes.view(self.dtype).view(self.piece.sizes)
        dest = self.dest
        for dim, (s, d, n) in enumerate(zip(self.source_offsets, self.dest_offsets, self.lengths)):
            source = source.narrow(dim, s, n)
            dest = dest.narrow(dim, d, n)
        dest.copy_(source)


def byte_runs(sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
              itemsize: int) -> list[tuple[int, int]]:
    """The contiguous byte ranges of the box ``offsets``/``lengths`` in a row-major array of ``sizes``.

    A box that spans whole rows is one range; one cut across an inner dimension is one range per row of
    the outer ones (joined where they touch), at most :data:`MAX_RUNS`, beyond which the smallest range
    covering the box is returned instead.
    """
    if not sizes:
        return [(0, itemsize)]
    if any(n == 0 for n in lengths):
        return []
    strides = [itemsize * math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    # The box is contiguous from the last dimension it does not span whole, inwards.
    inner = len(sizes) - 1
    while inner > 0 and lengths[inner] == sizes[inner] and offsets[inner] == 0:
        inner -= 1
    block = lengths[inner] * strides[inner]
    outer = [range(offsets[d], offsets[d] + lengths[d]) for d in range(inner)]
    count = math.prod(len(r) for r in outer)
    base = offsets[inner] * strides[inner]
    if count > MAX_RUNS:
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides)) + itemsize
        return [(first, last)]
    runs: list[tuple[int, int]] = []
    for index in itertools.product(*outer):
        start = base + sum(i * s for i, s in zip(index, strides))
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + block)
        else:
            runs.append((start, start + block))
    return runs


def joined(runs: Sequence[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """``runs`` sorted, with those that overlap, touch or lie at most ``gap`` bytes apart joined into one (a
    read of the gap costs less than a request more)."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(runs):
        if out and start - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _chunks_of(target: torch.Tensor):
    """The pieces of the global tensor ``target`` holds here (a plain tensor holds all of it)."""
    if is_sharded(target):
        return target.__create_chunk_list__()
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=target.shape)]


def plan_reads(path: str, described: Sequence[Any], saved: Sequence[SavedPiece], target: Any) -> list[Read]:
    """The reads that fill ``target`` (this rank's tensor at ``path``) from a sharded leaf's saved pieces."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    dtype_name, shape = described
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"checkpoint holds an unknown tensor dtype {dtype_name!r} at {path}")
    if not isinstance(target, torch.Tensor):
        raise UsageError(f"cannot restore {path}: saved a tensor of shape {tuple(shape)}, "
                         f"the state here holds a {type(target).__name__}")
    if tuple(target.shape) != tuple(shape):
        raise UsageError(f"cannot restore {path}: saved shape {tuple(shape)}, shape here {tuple(target.shape)}",
                         hint="the model must have the same global shapes as the one that saved it")
    if target.dtype != dtype:
        raise UsageError(f"cannot restore {path}: saved {dtype_name}, here {str(target.dtype).removeprefix('torch.')}")
    metadata = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                     [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in saved])
    local = local_of(target)
    reads = []
    for item in create_read_items_for_chunk_list(path, metadata, _chunks_of(target)):
        reads.append(Read(saved[item.storage_index.index], dtype, local, tuple(item.dest_offsets),
                          tuple(item.storage_offsets), tuple(item.lengths)))
    covered = sum(math.prod(r.lengths) for r in reads)
    if covered != local.numel():
        raise UsageError(f"cannot restore {path}: the saved pieces cover {covered} of the {local.numel()} elements "
                         "this rank holds", hint="the checkpoint lacks a piece of this tensor")
    return reads


def sharded_paths(tree: Any, placeholder: type) -> Iterator[tuple[tuple, Any]]:
    """(path, placeholder) of every sharded leaf in a restored tree, in order."""
    if isinstance(tree, placeholder):
        yield (), tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            for path, leaf in sharded_paths(value, placeholder):
                yield (key, *path), leaf
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            for path, leaf in sharded_paths(value, placeholder):
                yield (i, *path), leaf


def lookup(tree: Any, path: tuple) -> Any:
    for key in path:
        try:
            tree = tree[key]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


def replace(tree: Any, path: tuple, value: Any) -> Any:
    """``tree`` with ``value`` at ``path`` (tuples rebuilt, lists and dicts changed in place)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        return tuple(replace(v, rest, value) if i == key else v for i, v in enumerate(tree))
    tree[key] = replace(tree[key], rest, value)
    return tree


def dotted(name: str, path: tuple) -> str:
    return ".".join([name, *(str(k) for k in path)])


def assemble(described: Sequence[Any], saved: Mapping[int, list[SavedPiece]], region: torch.Tensor,
             tails: Sequence[int], release: Callable[[int, int], None] | None = None) -> list[torch.Tensor]:
    """Every sharded leaf as one full tensor, from all of its saved pieces in the image ``region`` whose saved
    ranks' private parts start at ``tails`` (``dashrun export``). ``release(start, stop)`` is told each range of
    the image once it is copied, so the image's memory can go as the full tensors grow."""
    full = []
    for index, (dtype_name, shape) in enumerate(described):
        dtype = getattr(torch, dtype_name)
        tensor = torch.empty(shape, dtype=dtype)
        for piece in saved.get(index, []):
            nbytes = math.prod(piece.sizes) * tensor.element_size()
            start = tails[piece.rank] + piece.at
            source = region[start:start + nbytes].view(dtype).view(piece.sizes)
            dest = tensor
            for dim, (offset, size) in enumerate(zip(piece.offsets, piece.sizes)):
                dest = dest.narrow(dim, offset, size)
            dest.copy_(source)
            if release is not None:
                release(start, start + nbytes)
        full.append(tensor)
    return full
