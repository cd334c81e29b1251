"""The direct read: the only rank of a node restoring straight into the tensors it has.

On a CPU node of one rank, the node's image holds the tails alone and the rank
reads the replicated state itself: through a few small buffers it reuses
(READ_INTO, see :class:`dashrun.wire.agent_messages.ReadRequest`), each
piece copied into the tensors it already has — its parameters, its
optimizer's state where that exists — and into new tensors for the rest.
Fresh memory costs more per byte than the network on a small VM, and a rank
that built its model has touched its parameters' memory already; nothing is
mapped copy-on-write, so the first step copies nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import itertools
import math
import mmap
import os
import threading
from typing import Any, Callable, Mapping, Sequence

import torch

from dashrun.errors import ProtocolError, UnavailableError, UsageError
from dashrun.rank import sharded, statetree
from dashrun.wire.channel import Frame

__all__ = ["DIRECT_SLOT", "DIRECT_SLOTS", "READ_TIMEOUT", "in_place_targets", "read_direct"]

#: How long a direct read waits for one piece from dash-agent.
READ_TIMEOUT = 120.0


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


#: A direct read's buffers: how many are in flight at once, and the bytes of each.
DIRECT_SLOTS = 4
DIRECT_SLOT = 16 << 20
#: Bytes between two leaves up to which one read spans both (a request more costs more than reading them).
JOIN_GAP = 64 << 10


def read_direct(entries: Sequence[Any], targets: Mapping[int, torch.Tensor], rep_total: int,
                read_span: Callable[..., concurrent.futures.Future[Frame]]) -> list[Any]:
    """The replicated state's leaves, read through a few reused buffers into ``targets`` (new tensors where a
    leaf has none): ``read_span(start, stop, fd, at, keep)`` has the agent read bytes ``[start, stop)`` of it
    into the buffers' segment ``fd`` at ``at``, each piece verified against its CRC-32C on the way; ``keep``:
    more reads into the segment follow, the agent may keep it mapped.

    (Reading new tensors' bytes straight into shared memory they are views of, rather than copying them from
    the buffers into anonymous memory, was slower here: fresh shared memory costs this VM about three times
    what fresh anonymous memory does.)"""
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
    stop = threading.Event()
    toucher = threading.Thread(target=_touch, args=(fresh, stop), name="dashrun-restore-touch", daemon=True)
    toucher.start()
    try:
        _stream(plan, read_span)
    finally:
        stop.set()
        toucher.join()
    for index, flat, dtype, shape in arrays:
        leaves[index] = flat.numpy().view(dtype).reshape(shape)
    return leaves


def _touch(tensors: Sequence[torch.Tensor], stop: threading.Event) -> None:
    """Give new tensors their memory while the rank waits for the first bytes, rather than page by page as
    they are copied (a page fault each, on the rank's core)."""
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


def _stream(plan: list[tuple[int, int, torch.Tensor]],
            read_span: Callable[..., concurrent.futures.Future[Frame]]) -> None:
    """Read the bytes of ``plan`` (sorted by offset) through DIRECT_SLOTS buffers: while the rank copies one
    piece into place, the agent fills the others."""
    # Leaves lie a few bytes of alignment apart: one read across them, not a request per leaf.
    spans = sharded.joined([(offset, offset + nbytes) for offset, nbytes, _ in plan], gap=JOIN_GAP)
    pieces = [(start, min(start + DIRECT_SLOT, stop)) for start, stop in spans
              for start in range(start, stop, DIRECT_SLOT)]
    if not pieces:
        return
    slots = min(DIRECT_SLOTS, len(pieces))
    fd = os.memfd_create("dashrun-restore-direct", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, slots * DIRECT_SLOT)
        buffers = torch.frombuffer(mmap.mmap(fd, slots * DIRECT_SLOT), dtype=torch.uint8)
        in_flight: collections.deque = collections.deque()
        following = iter(pieces)

        def ask(slot: int) -> None:
            piece = next(following, None)
            if piece is not None:
                # The last read lets the agent let go of its mapping of the buffers.
                keep = piece is not pieces[-1]
                in_flight.append((read_span(piece[0], piece[1], fd, slot * DIRECT_SLOT, keep), slot, piece))

        for slot in range(slots):
            ask(slot)
        first = 0  # plan entries before it end before the piece being copied
        try:
            while in_flight:
                future, slot, (start, stop) = in_flight.popleft()
                try:
                    future.result(timeout=READ_TIMEOUT).close_fds()
                except concurrent.futures.TimeoutError:
                    raise UnavailableError(f"dash-agent did not read bytes {start}-{stop} of the checkpoint "
                                           f"within {READ_TIMEOUT:.0f} s") from None
                base = slot * DIRECT_SLOT - start
                while first < len(plan) and plan[first][0] + plan[first][1] <= start:
                    first += 1
                for offset, nbytes, flat in itertools.islice(plan, first, None):
                    if offset >= stop:
                        break
                    lo, hi = max(start, offset), min(stop, offset + nbytes)
                    if lo < hi:
                        flat[lo - offset:hi - offset].copy_(buffers[base + lo:base + hi])
                ask(slot)
        finally:
            for future, _, _ in in_flight:  # the agent is still writing: wait, so the buffers outlive it
                try:
                    future.result(timeout=READ_TIMEOUT)
                except Exception:
                    pass
    finally:
        os.close(fd)
