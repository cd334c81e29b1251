"""``dashrun export``: a committed checkpoint as files that plain torch reads.

Sharded state (DTensors) is exported whole: each tensor assembled from every rank's pieces, so either
format loads at any world size; the fetched pieces' memory goes as they are copied, so a sharded state is
never held twice. Both formats hold one dictionary: every replicated object's state under its
keyword (``model``, ``optimizer``, ...), each saved rank's own state under
``per_rank["<rank>"]`` (``data``, ``$rng``, ...), and ``dashrun`` = {job,
step, world}. ``torch`` writes one file for ``torch.load`` (``weights_only``
safe: numpy arrays become tensors, numpy scalars Python numbers); ``dcp``
writes a directory for ``torch.distributed.checkpoint.load``. Either appears
whole or not at all (temp name, fsync, rename). A checkpoint that
:class:`dashrun.dcp.Writer` wrote is exported as ``dcp.load`` gives it to one
process (every tensor whole, nested as saved), with ``dashrun`` beside it.

The bytes come as a rank's restore reads them: through the source planner
(:mod:`dashrun.wire.planner`), each checked piece over one of several
connections at once, into one image laid out as :mod:`dashrun.wire.layout`
says, which also refuses a checkpoint of another layout format.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from dashrun.errors import DashError, NotFoundError, ProtocolError, UsageError
from dashrun.rank import sharded, statetree
from dashrun.rank.restore import decode_private, decode_replicated, saved_pieces
from dashrun.util.files import fsync_dir
from dashrun.wire import layout
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.planner import MemdSource, Planner, everything

__all__ = ["FORMATS", "STREAMS", "fetch_state", "write"]

FORMATS = ("torch", "dcp")
#: Most connections an export receives over at once (decrypting on as many cores), as a rank's direct read.
STREAMS = 4


def fetch_state(client: MemdClient, job: str, step: int | None,
                progress: Callable[[int, int], None] | None = None) -> tuple[CheckpointInfo, dict[str, Any]]:
    """The checkpoint's whole state as one dictionary of owned tensors."""
    info = client.latest(job, step)
    if info is None:
        raise NotFoundError(f"job {job} has no committed checkpoint" + (f" of step {step}" if step is not None else ""),
                            hint="see what there is with: dashrun ls " + job)
    from dashrun.dcp import full_state  # here: it imports torch.distributed.checkpoint

    state = full_state(client, info)  # None unless dashrun.dcp.Writer wrote it
    if state is not None:
        if progress:
            progress(info.nbytes, info.nbytes)
        state["dashrun"] = {"job": info.job, "step": info.step, "world": info.world}
        return info, state
    tails, size = layout.image_tails(info)
    mapped = mmap.mmap(-1, max(size, 1))
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, info.nbytes)

    # Several connections of its own to the caller's dash-memd at once: one shard's receive and decryption
    # run on as many cores, and a checkpoint of many ranks is not read one shard after the other.
    source = MemdSource(client.another, streams=min(STREAMS, max(2, len(os.sched_getaffinity(0)))),
                        progress=advance)
    try:
        with memoryview(mapped) as view:
            Planner([source]).read(info, everything(info, tails), view)
        state = _decode(mapped, info, tails)
    except DashError as e:  # (the step gone since LATEST, say): the frames of its chain hold views of the mapping
        raise _detached(e) from None
    finally:
        # Any other failure's frames may still hold views: the mapping then goes with them, and that failure,
        # not a BufferError of this close, is what the caller sees.
        with contextlib.suppress(BufferError):
            mapped.close()
    state["dashrun"] = {"job": info.job, "step": info.step, "world": info.world}
    return info, state


def _detached(error: BaseException) -> BaseException:
    """``error`` without the tracebacks of it and of every exception it was raised in handling."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [error]
    while chain:
        e = chain.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            e.with_traceback(None)
            chain += [e.__cause__, e.__context__]
    return error


def _decode(mapped: mmap.mmap, info: CheckpointInfo, tails: list[int]) -> dict[str, Any]:
    """The state in the fetched image ``mapped``, as owned tensors; sharded tensors whole."""
    region = torch.frombuffer(mapped, dtype=torch.uint8)
    state = decode_replicated(region, mapped, info, tails, copy=True)
    described = layout.description_in(mapped, info, tails, 0)["replicated"].get("sharded")
    if described:  # each sharded tensor whole, from every rank's pieces, which are let go as they are copied
        def release(start: int, stop: int) -> None:
            first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, stop // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first:  # only pages wholly inside the piece: the next piece may share the edge ones
                mapped.madvise(mmap.MADV_DONTNEED, first, last - first)

        pieces = saved_pieces(mapped, info, tails, described)
        full = sharded.assemble(described, pieces, region, tails, release)
        for path, placeholder in list(sharded.sharded_paths(state, statetree.Sharded)):
            if not 0 <= placeholder.index < len(full):
                raise ProtocolError(f"checkpoint of step {info.step} names sharded leaf {placeholder.index} "
                                    f"of {len(full)}")
            state = sharded.replace(state, path, full[placeholder.index])
    state["per_rank"] = {str(r): decode_private(region, mapped, info, tails, r) for r in range(info.world)}
    return state


def _plain(tree: Any) -> Any:
    """numpy values as torch / Python ones, so ``torch.load(weights_only=True)`` reads the file."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(tree, numpy.ndarray):
        return torch.from_numpy(tree)
    if numpy is not None and isinstance(tree, numpy.generic):
        return tree.item()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return tree


def write(state: dict[str, Any], fmt: str, out: Path) -> None:
    """``state`` to ``out`` in format ``fmt`` (one of :data:`FORMATS`), whole or not at all; never overwrites."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}", hint="use --format torch or --format dcp")
    out = Path(out)
    if out.exists():
        raise UsageError(f"{out} exists", hint="choose a new path; export never overwrites")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if fmt == "torch":
            with open(tmp, "wb") as f:
                torch.save(_plain(state), f)
                f.flush()
                os.fsync(f.fileno())
        else:
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():  # torch warns that one process saves: what export asks of it
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(_plain(state), checkpoint_id=str(tmp), no_dist=True)
            for path in tmp.iterdir():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
