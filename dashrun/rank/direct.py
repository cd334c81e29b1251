"""The direct read: the only rank of a node restoring straight into the tensors it has.

On a CPU node of one rank, the node's image holds the tails alone and the rank
reads the replicated state itself (from the peers that hold copies of it, else
from dash-memd) through the restore's source planner
(:class:`dashrun.wire.planner.Planner`), each piece received and decrypted
straight into the tensors it already has — its parameters, its
optimizer's state where that exists — and into new tensors for the rest.
Fresh memory costs more per byte than the network on a small VM, and a rank
that built its model has touched its parameters' memory already; nothing is
mapped copy-on-write, so the first step copies nothing, and no byte is copied
twice: not through dash-agent, not through a buffer.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import threading
from typing import Any, Callable, Mapping, Sequence

import torch

from dashrun.errors import ProtocolError, UsageError
from dashrun.rank import sharded, statetree
from dashrun.rank.staging import bytes_of
from dashrun.wire.planner import Scatter

__all__ = ["JOIN_GAP", "in_place_targets", "read_direct", "scatter"]


class _Leaf:
    """Where leaf ``index`` of the saved state sits in its tree (see :func:`in_place_targets`)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def in_place_targets(skeleton: Any, entries: Sequence[Any], objects: Mapping[str, Any]) -> dict[int, torch.Tensor]:
    """The tensors ``objects`` have now that saved leaves can be read straight into, by leaf index: at the
    same place of the object's ``state_dict()``, on the CPU, dense and contiguous, of the saved dtype and shape,
    and each taken once (tied weights keep one)."""
    tree = statetree.unflatten(skeleton, [_Leaf(i) for i in range(len(entries))])
    found: dict[int, torch.Tensor] = {}

    def match(saved: Any, current: Any) -> None:
        if isinstance(saved, _Leaf):
            if type(current) in (torch.Tensor, torch.nn.Parameter):
                found[saved.index] = current
        elif isinstance(saved, Mapping) and isinstance(current, Mapping):
            for key, value in saved.items():
                if key in current:
                    match(value, current[key])
        elif isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)) and len(saved) == len(current):
            for value, now in zip(saved, current):
                match(value, now)

    for name, obj in objects.items():
        if name in tree and hasattr(obj, "state_dict"):
            match(tree[name], obj.state_dict())
    targets, taken = {}, set()
    for index, tensor in sorted(found.items()):
        kind, dtype, shape = entries[index][:3]
        if (kind == "t" and tensor.device.type == "cpu" and tensor.layout == torch.strided
                and tensor.is_contiguous() and not tensor.requires_grad and str(tensor.dtype) == f"torch.{dtype}"
                and list(tensor.shape) == list(shape) and tensor.data_ptr() not in taken):
            targets[index] = tensor
            if tensor.numel():
                taken.add(tensor.data_ptr())
    return targets


#: Bytes between two leaves up to which one read spans both (a request more costs more than reading them).
JOIN_GAP = 64 << 10


def read_direct(entries: Sequence[Any], targets: Mapping[int, torch.Tensor], rep_total: int,
                read: Callable[[list[tuple[int, int]], Scatter], None]) -> list[Any]:
    """The replicated state's leaves, read into ``targets`` (new tensors where a leaf has none): ``read(spans,
    image)`` reads each span ``[start, stop)`` of the replicated state into ``image`` (see :func:`scatter`),
    each piece verified against its CRC-32C on the way."""
    leaves: list[Any] = []
    plan: list[tuple[int, int, torch.Tensor]] = []  # (offset, nbytes, destination bytes)
    arrays: list[tuple[int, torch.Tensor, str, list[int]]] = []
    fresh: list[torch.Tensor] = []  # tensors made here, given their memory while the rank waits
    for index, entry in enumerate(entries):
        kind, dtype, shape, offset = entry[:4]
        if kind == "t":
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise UsageError(f"checkpoint holds an unknown tensor dtype {dtype!r}")
            dest = targets.get(index)
            if dest is None:
                dest = torch.empty(shape, dtype=torch_dtype)
                fresh.append(dest)
            leaves.append(dest)
            nbytes = dest.numel() * dest.element_size()
            flat = dest.reshape(-1).view(torch.uint8) if nbytes else None
        else:
            import numpy

            nbytes = math.prod(shape) * numpy.dtype(dtype).itemsize
            flat = torch.empty(nbytes, dtype=torch.uint8)
            arrays.append((index, flat, dtype, shape))
            leaves.append(None)
        if not 0 <= offset <= offset + nbytes <= rep_total:
            raise ProtocolError("a saved tensor lies outside the replicated state")
        if nbytes:
            plan.append((offset, nbytes, flat))
    plan.sort(key=lambda p: p[0])
    spans, image = scatter(plan)
    stop = threading.Event()
    toucher = threading.Thread(target=_touch, args=(fresh, stop), name="dashrun-restore-touch", daemon=True)
    toucher.start()
    try:
        if spans:
            read(spans, image)
    finally:
        stop.set()
        toucher.join()
    for index, flat, dtype, shape in arrays:
        leaves[index] = flat.numpy().view(dtype).reshape(shape)
    return leaves


def scatter(plan: Sequence[tuple[int, int, torch.Tensor]]) -> tuple[list[tuple[int, int]], Scatter]:
    """The spans of the replicated state to read for ``plan`` — (offset, bytes, where they go), sorted — and
    where each byte of them goes: a leaf's bytes into its tensor, the few of alignment between the leaves of
    one span into scratch memory of their own (each checksummed where it lands)."""
    # Leaves lie a few bytes of alignment apart: one read across them, not a request per leaf.
    spans = sharded.joined([(offset, offset + nbytes) for offset, nbytes, _ in plan], gap=JOIN_GAP)
    places: list[tuple[int, memoryview]] = []
    end = None
    for offset, nbytes, flat in plan:
        if end is not None and offset < end:
            raise ProtocolError("two saved tensors overlap in the replicated state")
        if end is not None and 0 < offset - end <= JOIN_GAP:  # inside a span: the gap is read too
            places.append((end, memoryview(bytearray(offset - end))))
        places.append((offset, bytes_of(flat)))
        end = offset + nbytes
    return spans, Scatter(places)


def _touch(tensors: Sequence[torch.Tensor], stop: threading.Event) -> None:
    """Give new tensors their memory while the rank waits for the first bytes, rather than page by page as
    they are received (a page fault each)."""
    madvise = _libc_madvise()
    if madvise is None:
        return
    for tensor in tensors:
        start = -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        for at in range(start, end, TOUCH_STEP):
            if stop.is_set() or madvise(at, min(TOUCH_STEP, end - at), MADV_POPULATE_WRITE) != 0:
                return  # done waiting, or a kernel before 5.14: the copies fault the pages in


#: Bytes of new tensors given memory per call while a direct read waits.
TOUCH_STEP = 8 << 20
#: ``madvise`` advice that maps pages for writing (Linux 5.14).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@functools.cache
def _libc_madvise():
    """libc's ``madvise`` through ctypes, which lets go of the GIL while it runs; None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call
