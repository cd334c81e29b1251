"""State dicts as JSON skeletons plus a flat list of tensors — no pickle anywhere.

:func:`flatten` turns a ``state_dict()`` tree into a JSON-safe skeleton in
which every tensor (or numpy array) is replaced by an index into a list, and
:func:`unflatten` reverses it. Types JSON lacks are tagged: tuples, dicts
with non-string keys, non-finite floats, bytes, dtypes, devices. A tensor
that appears twice (tied weights) is stored once and comes back as the same
object in both places. Anything else is refused with the path where it was
found, so a checkpoint never silently drops state.

:func:`plan` lays tensors out in one byte region, each at an aligned offset
(:data:`dashrun.wire.layout.ALIGN`), and :func:`describe`/:func:`materialize`
write and read the entries of the description that travels with the bytes
(whose layout :mod:`dashrun.wire.layout` owns).
"""

from __future__ import annotations

import base64
import math
import sys
from typing import Any

import torch

from dashrun.errors import UsageError
from dashrun.wire.layout import align

__all__ = ["Sharded", "byte_view", "describe", "flatten", "materialize", "nbytes_of", "plan", "unflatten"]


def _np():
    return sys.modules.get("numpy")


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t.device)


class Sharded:
    """Where a restored tree had a DTensor: sharded leaf ``index`` (see :mod:`dashrun.rank.sharded`)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"Sharded({self.index})"


def flatten(tree: Any, sharded: list[Any] | None = None) -> tuple[Any, list[Any]]:
    """(skeleton, leaves): leaves are torch tensors and numpy arrays, deduplicated by identity of memory.

    DTensors go to ``sharded`` (deduplicated alike) as ``{"$S": index}``; without it they are refused.
    """
    leaves: list[Any] = []
    seen: dict[Any, int] = {}
    seen_sharded: dict[Any, int] = {}

    def leaf(value: Any, key: Any) -> int:
        index = seen.get(key)
        if index is None:
            index = seen[key] = len(leaves)
            leaves.append(value)
        return index

    def walk(node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, str)):
            return node
        if isinstance(node, int):
            return node if type(node) is int else int(node)
        if isinstance(node, float):
            return node if math.isfinite(node) else {"$f": repr(node)}
        if isinstance(node, torch.Tensor):
            if sharded is not None and type(node).__name__ == "DTensor":
                local = node._local_tensor
                key = _tensor_key(local) if local.numel() else ("empty", id(node))
                index = seen_sharded.get(key)
                if index is None:
                    index = seen_sharded[key] = len(sharded)
                    sharded.append(node)
                return {"$S": index}
            if node.layout != torch.strided or node.is_quantized or type(node) not in (torch.Tensor,
                                                                                      torch.nn.Parameter):
                raise UsageError(f"cannot checkpoint {path}: {type(node).__name__} with layout {node.layout}",
                                 hint="dashrun stores plain dense tensors; convert it in state_dict()")
            return {"$T": leaf(node, _tensor_key(node) if node.numel() else ("empty", id(node)))}
        np = _np()
        if np is not None and isinstance(node, np.ndarray):
            if node.dtype.hasobject:
                raise UsageError(f"cannot checkpoint {path}: numpy array of Python objects")
            return {"$N": leaf(node, ("numpy", id(node)))}
        if np is not None and isinstance(node, np.generic):
            return {"$ns": [node.dtype.str, walk(node.item(), path)]}
        if isinstance(node, torch.dtype):
            return {"$dt": str(node).removeprefix("torch.")}
        if isinstance(node, torch.device):
            return {"$dev": str(node)}
        if isinstance(node, (bytes, bytearray)):
            return {"$b": base64.b64encode(bytes(node)).decode()}
        if isinstance(node, tuple):  # torch.Size too
            return {"$t": [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in node):
                return {k: walk(v, f"{path}.{k}") for k, v in node.items()}
            return {"$d": [[walk(k, path), walk(v, f"{path}[{k!r}]")] for k, v in node.items()]}
        raise UsageError(f"cannot checkpoint {path}: a {type(node).__name__} value",
                         hint="state_dict() may hold tensors, numbers, strings, lists, tuples and dicts")

    return walk(tree, "state"), leaves


def unflatten(skeleton: Any, leaves: list[Any]) -> Any:
    """The tree :func:`flatten` made ``skeleton`` of, with ``leaves`` (by index) in place of its tensors."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (tag, value), = node.items()
            if tag == "$T" or tag == "$N":
                return leaves[value]
            if tag == "$S":
                return Sharded(value)
            if tag == "$f":
                return float(value)
            if tag == "$t":
                return tuple(walk(v) for v in value)
            if tag == "$d":
                return {_hashable(walk(k)): walk(v) for k, v in value}
            if tag == "$dt":
                return getattr(torch, value)
            if tag == "$dev":
                return torch.device(value)
            if tag == "$b":
                return base64.b64decode(value)
            if tag == "$ns":
                import numpy

                return numpy.dtype(value[0]).type(walk(value[1]))
        return {k: walk(v) for k, v in node.items()}

    return walk(skeleton)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def nbytes_of(leaf: Any) -> int:
    """The size in bytes of a leaf (a tensor or a numpy array)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    return int(leaf.nbytes)


def plan(leaves: list[Any]) -> tuple[list[int], int]:
    """Aligned byte offsets of each leaf in one region, and the region's size."""
    offsets, position = [], 0
    for leaf in leaves:
        offsets.append(position)
        position = align(position + nbytes_of(leaf))
    return offsets, position


def describe(leaves: list[Any], offsets: list[int]) -> list[list[Any]]:
    """What a reader needs to rebuild each leaf from the region's bytes."""
    out = []
    for leaf, offset in zip(leaves, offsets):
        if isinstance(leaf, torch.Tensor):
            out.append(["t", str(leaf.dtype).removeprefix("torch."), list(leaf.shape), offset, str(leaf.device)])
        else:
            out.append(["n", leaf.dtype.str, list(leaf.shape), offset, "cpu"])
    return out


def byte_view(leaf: Any) -> torch.Tensor:
    """A flat uint8 view of a leaf's bytes (a contiguous copy if the leaf is not contiguous)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().reshape(-1).view(torch.uint8)
    np = _np()
    return torch.from_numpy(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))


def materialize(entries: list[list[Any]], region: torch.Tensor, *, copy: bool) -> list[Any]:
    """Rebuild leaves from ``region`` (uint8). ``copy=False`` returns views into the region."""
    leaves = []
    for entry in entries:
        kind, dtype, shape, offset = entry[:4]
        if kind == "t":
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise UsageError(f"checkpoint holds an unknown tensor dtype {dtype!r}")
            size = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
            view = region[offset:offset + size].view(torch_dtype).view(shape)
            leaves.append(view.clone() if copy else view)
        else:
            import numpy

            count = math.prod(shape) * numpy.dtype(dtype).itemsize
            array = region[offset:offset + count].numpy().view(numpy.dtype(dtype)).reshape(shape)
            leaves.append(array.copy())
    return leaves
