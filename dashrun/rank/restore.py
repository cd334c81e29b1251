"""Restore through the node's dash-agent: fetch the image, agree on one step across ranks, load it.

The agent fetches a committed checkpoint from dash-memd once per node and
hands every rank of the node the same image by descriptor, laid out as
:mod:`dashrun.wire.layout` says (which also refuses a checkpoint of another
layout format, one a newer dashrun wrote). The ranks load the oldest of the steps they
found, so all of them resume from the same checkpoint. The replicated state
is rebuilt from every saved rank's slice whatever the new world size; private
state (``per_rank`` objects, RNG states) goes to the rank with the same
number, and what has no owner is reported. Module buffers, which the saving
ranks kept in their private state (see :mod:`dashrun.rank.snapshot`), go
back into the replicated state: the rank's own where it saved its own, else
rank 0's (every rank of a node has every saved rank's part in the image).

The only rank of a node on the CPU reads the replicated state *directly*, from
the other nodes' agents that hold copies of it (their names come with the
agent's reply) or else from dash-memd, straight into the tensors it already
has (:mod:`dashrun.rank.direct`); the image then holds the tails alone.

A checkpoint that the objects do not fit (other shapes, keys or keyword
objects: the job id names a run of another model) raises one
:class:`~dashrun.errors.RestoreMismatchError` line (:mod:`dashrun.rank.mismatch`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import random
import sys
import time
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from dashrun.errors import DashError, ProtocolError, RestoreMismatchError, UnavailableError, UsageError
from dashrun.rank import sharded, statetree
from dashrun.rank.direct import in_place_targets, read_direct
from dashrun.rank.mismatch import mismatch_hint, must_fit
from dashrun.rank.notices import in_process_group
from dashrun.rank.snapshot import BUFFERS
from dashrun.util.retry import Backoff, countdown, retry
from dashrun.wire import layout
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import MAX_RANGES, RestoreReply, RestoreRequest
from dashrun.wire.channel import Frame
from dashrun.wire.memd_client import memd_from_env
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.peer_client import peers_from_env
from dashrun.wire.planner import MemdSource, PeerSource, Planner, Scatter, Source, replicated_span
from dashrun.wire.protocol import Kind

__all__ = ["RESTORE_TIMEOUT", "agree", "decode_private", "decode_replicated", "fetch", "first_local_rank", "load",
           "populate", "report_world_change",
           "restore_rng", "restore_state", "saved_pieces"]

log = logging.getLogger(__name__)

#: How long restore() keeps trying while dash-agent or dash-memd is unreachable.
RESTORE_TIMEOUT = 120.0
#: Most connections a direct read receives over at once (decrypting on as many of the rank's cores).
DIRECT_STREAMS = 4


def decode_replicated(region: torch.Tensor, mapped, info: CheckpointInfo, tails: Sequence[int], *,
                      copy: bool, rank: int = 0, leaves: list[Any] | None = None) -> dict[str, Any]:
    """The state every rank held alike, from a restore image; ``copy=False`` gives views into it, ``leaves``
    its tensors read already (see :func:`read_direct`).

    Module buffers are saved rank ``rank``'s where it kept its own
    (DDP with ``broadcast_buffers=False``, a sharded model), rank 0's otherwise.
    """
    rep = layout.description_in(mapped, info, tails, 0)["replicated"]
    if leaves is None:
        leaves = statetree.materialize(rep["tensors"], region[:info.rep_total], copy=copy)
    state = statetree.unflatten(rep["tree"], leaves)
    owners = [rank, 0] if 0 < rank < info.world else [0]
    kept = [decode_private(region, mapped, info, tails, owner).get(BUFFERS, {}) for owner in owners]
    for name, tree in state.items():
        sources = [buffers[name] for buffers in kept if name in buffers]
        if sources:  # in the state dict's own order: the buffers' keys held None in the replicated part
            state[name] = {key: next((s[key] for s in sources if key in s), value) for key, value in tree.items()}
    return state


def decode_private(region: torch.Tensor, mapped, info: CheckpointInfo, tails: Sequence[int],
                   rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s own state (per-rank objects and ``$rng``), as owned tensors."""
    mine = layout.description_in(mapped, info, tails, rank)["private"]
    start = tails[rank]
    return statetree.unflatten(mine["tree"], statetree.materialize(
        mine["tensors"], region[start:start + info.shards[rank].private_len], copy=True))


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states :func:`dashrun.rank.snapshot.capture_rng` took (those this process has)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal.tolist()), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state and sys.modules.get("numpy") is not None:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


#: Times the batches of a request with many ranges are sent again when the image they went into was replaced.
RANGES_ATTEMPTS = 3


def fetch_ranges(link: AgentLink, request: RestoreRequest,
                 on_wait: Callable[[str], None]) -> tuple[RestoreReply, Frame]:
    """:func:`fetch` of a request with ranges, in requests of at most MAX_RANGES each, every one but the last
    with ``more``: the agent reads each batch into the same image, and the last reply's descriptor holds them
    all (or says the image is gone).

    Every batch must land in one image: one that the agent dropped between two (it restarted, or the image
    expired) would hold only the later batches, so each reply's image is identified by its descriptor's inode,
    and the batches are sent again if it changed.
    """
    ranges = request.ranges or ()
    batches = [ranges[i:i + MAX_RANGES] for i in range(0, len(ranges), MAX_RANGES)] or [()]
    for _ in range(RANGES_ATTEMPTS):
        images = set()
        for batch in batches[:-1]:
            reply, frame = fetch(link, dataclasses.replace(request, ranges=batch, more=True), on_wait)
            if not reply.found:
                return reply, frame
            images.add(_image_of(frame.fds[0]))
            frame.close_fds()
        reply, frame = fetch(link, dataclasses.replace(request, ranges=batches[-1]), on_wait)
        if not reply.found or not images or images == {_image_of(frame.fds[0])}:
            return reply, frame
        frame.close_fds()
        log.warning("dashrun: the node's restore image of step %s was replaced while its %d ranges were read: "
                    "reading them again", request.step, len(ranges))
    raise UnavailableError(f"the node's restore image of job {request.job} was replaced {RANGES_ATTEMPTS} times "
                           "while it was read", hint="is dash-agent restarting? run again")


def _image_of(fd: int) -> tuple[int, int]:
    """What identifies the shared memory behind ``fd``: its device and inode."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def fetch(link: AgentLink, request: RestoreRequest,
          on_wait: Callable[[str], None]) -> tuple[RestoreReply, Frame]:
    """Ask the agent for the image, trying again for RESTORE_TIMEOUT while it or dash-memd is unreachable.

    ``on_wait(message)`` is told that it waits, and for how long more (again at most every
    :data:`~dashrun.util.retry.SAY_EVERY` seconds). The frame holds the image's descriptor when the reply says
    ``found``: the caller closes it.
    """
    deadline = time.monotonic() + RESTORE_TIMEOUT
    try:
        frame = retry(lambda: link.call(Kind.RESTORE, request.to_body(), timeout=RESTORE_TIMEOUT),
                      on=UnavailableError, backoff=Backoff(0.5, 10.0), deadline=deadline,
                      on_retry=countdown(lambda line: on_wait(f"restore waits for dash-memd: {line}"), deadline))
    except UnavailableError as e:
        raise UnavailableError(f"cannot restore job {request.job}: {e}",
                               hint="is dash-memd up and reachable from this node?") from None
    try:
        return RestoreReply.from_body(frame.body), frame
    except ProtocolError as e:
        frame.close_fds()
        raise UnavailableError("dash-agent sent a malformed restore description") from e


def first_local_rank(rank: int, local_rank: int | None) -> int | None:
    """The first rank of this node, its ranks being numbered in a row (torchrun's LOCAL_RANK); None: unknown."""
    return rank - local_rank if local_rank is not None and 0 <= local_rank <= rank else None


def agree(step: int) -> int:
    """The oldest of the steps the ranks found, so every rank loads the same checkpoint."""
    if not in_process_group() or dist.get_world_size() == 1:
        return step
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([step], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def restore_state(link: AgentLink, *, job_id: str, rank: int, world: int, local_world: int,
                  objects: Mapping[str, Any], per_rank: Collection[str],
                  on_wait: Callable[[str], None], local_rank: int | None = None,
                  owners: Mapping[str, torch.nn.Module] | None = None,
                  stats: dict[str, int] | None = None) -> CheckpointInfo | None:
    """Load the newest checkpoint of ``job_id`` every rank has into ``objects``; None if there is none.

    The node's ranks are taken to be numbered in a row (torchrun's LOCAL_RANK); unknown (None), the node's
    image holds every saved rank's private state. Pieces of sharded state are asked for by byte range once
    this rank knows which it needs; ``stats`` (if given) is told the bytes of them needed and read.
    """
    first_rank = first_local_rank(rank, local_rank)
    # A node of several ranks downloads the state once, into the image they all map; the only rank of a CPU
    # node reads it from dash-memd itself, where the launcher said how to reach it.
    connect = memd_from_env() if local_world == 1 and _device_of(objects) is None else None
    direct = connect is not None
    reply, frame = fetch(link, RestoreRequest(job_id, None, local_world, first_rank, direct=direct), on_wait)
    found_step = reply.checkpoint.step if reply.found else -1
    agreed = agree(found_step)
    if agreed != found_step:
        frame.close_fds()
        if agreed < 0:  # another rank found none
            reply = RestoreReply(found=False)
        else:
            reply, frame = fetch(link, RestoreRequest(job_id, agreed, local_world, first_rank, direct=direct),
                                 on_wait)
    if not reply.found:
        log.info("dashrun: no checkpoint of job %s yet: starting from step 0", job_id)
        return None
    step = reply.checkpoint.step

    def read_pieces(ranges: list[tuple[int, int, int]]) -> int:
        """The image again, with ``ranges`` of saved ranks' private parts in place (a descriptor to close)."""
        more, again = fetch_ranges(link, RestoreRequest(job_id, step, local_world, first_rank, tuple(ranges)),
                                   on_wait)
        if not more.found or more.checkpoint.committed_at != reply.checkpoint.committed_at:
            again.close_fds()
            raise UnavailableError(f"checkpoint of step {step} went away while it was restored",
                                   hint="run again: it restores the newest checkpoint then")
        return again.fds[0]

    def read_spans(spans: list[tuple[int, int]], into: Scatter) -> None:
        """Spans of the replicated state from the peers the agent named, else dash-memd, as the agent would
        read them for the node's image."""
        info = reply.checkpoint
        extents = [e for start, stop in spans for e in replicated_span(info, start, stop, start)]
        # On the rank's own CPUs (as the launcher or the user placed it), not every CPU as dash-agent's would.
        streams = min(DIRECT_STREAMS, max(2, len(os.sched_getaffinity(0))))
        sources: list[Source] = []
        peer_connect = peers_from_env(job_id) if reply.holders else None
        if peer_connect is not None:
            holders = {rank: [(h.node, h.host, h.port) for h in found] for rank, found in reply.holders.items()}
            # every holder at once: spread the rank's streams over them
            per_holder = max(1, streams // len({h for found in holders.values() for h in found}))
            sources.append(PeerSource(holders, peer_connect, reply.node, per_holder))
        sources.append(MemdSource(connect, streams=streams, waited_on=lambda: False))
        Planner(sources).read(info, extents, into)

    try:
        load(reply, frame.fds[0], objects, per_rank, job_id=job_id, rank=rank, world=world, owners=owners,
             read_pieces=read_pieces, stats=stats, read_spans=read_spans if direct else None)
    except DashError as e:
        if not reply.direct or isinstance(e, UsageError):
            raise
        # The checkpoint is loaded again whole from the node's image, which then holds the replicated state.
        log.warning("dashrun: reading step %d straight into this rank's tensors failed (%s): loading it from "
                    "the node's image", step, e)
        frame.close_fds()
        reply, frame = fetch(link, RestoreRequest(job_id, step, local_world, first_rank), on_wait)
        if not reply.found:
            raise UnavailableError(f"checkpoint of step {step} went away while it was restored",
                                   hint="run again: it restores the newest checkpoint then") from None
        load(reply, frame.fds[0], objects, per_rank, job_id=job_id, rank=rank, world=world, owners=owners,
             read_pieces=read_pieces, stats=stats)
    finally:
        frame.close_fds()
    return reply.checkpoint


def load(reply: RestoreReply, fd: int, objects: Mapping[str, Any], per_rank: Collection[str], *,
         job_id: str, rank: int, world: int, read_pieces: Callable[[list[tuple[int, int, int]]], int],
         owners: Mapping[str, torch.nn.Module] | None = None, stats: dict[str, int] | None = None,
         read_spans: Callable[[list[tuple[int, int]], Scatter], None] | None = None) -> None:
    """Load the image in ``fd`` that ``reply`` describes into ``objects``, and this rank's RNG states.

    Module parameters and buffers are copied into the module's own (already allocated) tensors. Other
    state (an optimizer's, a scheduler's) is not copied on the host: its tensors map the image
    copy-on-write, as ``torch.load(mmap=True)`` maps a file, and a page is copied only when training first
    writes it. On a GPU, the image is pinned while it is copied to the device on a side stream.

    Sharded state (DTensors) is resharded: this rank's tensors say which pieces of the global tensors it holds
    now, ``read_pieces(ranges)`` makes the agent read those byte ranges of the saved pieces into the image
    (returning a descriptor of it), and they are copied into place (see :mod:`dashrun.rank.sharded`).

    When the reply says ``direct``, the image lacks the replicated state: ``read_spans(spans, into)`` reads
    it straight into the tensors the objects have (see :func:`read_direct`).
    """
    owners = owners or {}
    info, tails = reply.checkpoint, reply.tails
    size = os.fstat(fd).st_size
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)  # copy-on-write: never alters the image
    if not reply.direct:
        populate(mapped, info.rep_total)
    region = torch.frombuffer(mapped, dtype=torch.uint8)
    meta = layout.description_in(mapped, info, tails, 0)
    if "dcp" in meta:
        raise UsageError(f"checkpoint of step {info.step} of job {job_id} was written by dcp.save through "
                         "dashrun.dcp.Writer, not by a Checkpointer",
                         hint=f"load it with dcp.load(state, checkpoint_id={info.step}, "
                              "storage_reader=dashrun.dcp.Reader())")
    leaves = None
    if reply.direct:
        if read_spans is None:
            raise ProtocolError("dash-agent left out the replicated state of a rank that cannot read it")
        rep = meta["replicated"]
        targets = in_place_targets(rep["tree"], rep["tensors"],
                                   {name: obj for name, obj in objects.items()
                                    if name not in per_rank and name not in owners})
        leaves = read_direct(rep["tensors"], targets, info.rep_total, read_spans)
    replicated = decode_replicated(region, mapped, info, tails, copy=False, rank=rank, leaves=leaves)
    private = decode_private(region, mapped, info, tails, rank) if rank < info.world else None
    report_world_change(info, rank, world, per_rank)

    for name, obj in objects.items():
        if name not in per_rank and name not in replicated:
            raise RestoreMismatchError(f"job {job_id}'s checkpoint of step {info.step} has no state for {name}= "
                                       "(the run that saved it passed other keyword objects to Checkpointer)",
                                       hint=mismatch_hint(job_id))
    rep = meta["replicated"]
    if rep.get("sharded"):
        try:
            _reshard(rep["sharded"], replicated, mapped, info, tails, objects, per_rank, owners, read_pieces, stats)
        except UsageError as e:  # a DTensor of other global shape or dtype than the saved one, or none
            raise RestoreMismatchError(f"job {job_id}'s checkpoint of step {info.step} does not fit this run's "
                                       f"sharded state: {e.message}", hint=mismatch_hint(job_id)) from e
    with _pinned_copies(region, _device_of(objects)):
        for name, obj in objects.items():
            with must_fit(job_id, info.step, name, obj):
                if name in per_rank:
                    if private is not None and name in private:
                        obj.load_state_dict(private[name])
                else:  # a module copies into its parameters; an optimizer moves its state to theirs
                    sharded.load_state(obj, owners.get(name), replicated[name])
    if private is not None:
        restore_rng(private.get("$rng", {}))
    del replicated, region
    log.info("dashrun: restored job %s step %d (%d bytes, saved by %d ranks)", job_id, info.step,
             info.nbytes, info.world)


def saved_pieces(mapped, info: CheckpointInfo, tails: Sequence[int],
                 described: Sequence[Any]) -> dict[int, list[sharded.SavedPiece]]:
    """Every saved rank's pieces of sharded state, by leaf, each checked against the shard that holds it."""
    found: dict[int, list[sharded.SavedPiece]] = {}
    for shard in info.shards:
        entries = layout.description_in(mapped, info, tails, shard.rank)["private"].get("pieces", [])
        start = shard.private_len - shard.pieces_len
        for entry in entries if isinstance(entries, list) else [None]:
            try:
                index, offsets, sizes, at = entry
                dtype_name, shape = described[index]
                itemsize = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
                valid = (len(offsets) == len(sizes) == len(shape) and start <= at
                         and at + math.prod(sizes) * itemsize <= shard.private_len
                         and all(0 <= o and 0 < n and o + n <= d for o, n, d in zip(offsets, sizes, shape)))
            except (TypeError, ValueError, IndexError, AttributeError):
                valid = False
            if not valid:
                raise ProtocolError(f"saved rank {shard.rank}'s description of its sharded state is malformed")
            found.setdefault(index, []).append(sharded.SavedPiece(shard.rank, tuple(offsets), tuple(sizes), at))
    return found


def _reshard(described: Sequence[Any], replicated: dict[str, Any], mapped, info: CheckpointInfo,
             tails: Sequence[int], objects: Mapping[str, Any], per_rank: Collection[str],
             owners: Mapping[str, torch.nn.Module], read_pieces, stats: dict[str, int] | None) -> None:
    """Fill this rank's DTensors from the saved pieces they overlap, in place of the placeholders in
    ``replicated``; only the byte ranges needed are read."""
    saved = saved_pieces(mapped, info, tails, described)
    reads: list[sharded.Read] = []
    needed = 0
    for name, tree in replicated.items():
        if name in per_rank or name not in objects:
            continue
        places = list(sharded.sharded_paths(tree, statetree.Sharded))
        if not places:
            continue
        # Its state as it is now, whose DTensors say which pieces this rank holds; an optimizer's is created here.
        target = sharded.state_dict_of(objects[name], owners.get(name))
        for path, placeholder in places:
            if not 0 <= placeholder.index < len(described):
                raise ProtocolError(f"checkpoint of step {info.step} names sharded leaf {placeholder.index} of "
                                    f"{len(described)}")
            here = sharded.lookup(target, path)
            reads += sharded.plan_reads(sharded.dotted(name, path), described[placeholder.index],
                                        saved.get(placeholder.index, []), here)
            needed += sharded.local_of(here).numel() * here.element_size()
            tree = sharded.replace(tree, path, here)
        replicated[name] = tree
    wanted: dict[int, list[tuple[int, int]]] = {}
    for read in reads:
        wanted.setdefault(read.piece.rank, []).extend(read.runs())
    ranges = [(r, start, stop) for r, runs in sorted(wanted.items()) for start, stop in sharded.joined(runs)]
    fd = read_pieces(ranges)
    try:
        region = torch.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
        for read in reads:
            start = tails[read.piece.rank] + read.piece.at
            read.copy(region[start:start + math.prod(read.piece.sizes) * read.dest.element_size()])
        del region
    finally:
        os.close(fd)
    if stats is not None:
        stats["sharded_needed"] = needed
        stats["sharded_read"] = sum(stop - start for _, start, stop in ranges)


def populate(mapped: mmap.mmap, stop: int, start: int = 0) -> None:
    """Map bytes ``[start, stop)`` of the image in one call rather than one page fault per page as they are
    read."""
    start -= start % mmap.PAGESIZE
    stop = min(stop, len(mapped))
    try:
        if stop > start:
            mapped.madvise(MADV_POPULATE_READ, start, stop - start)
    except (OSError, ValueError):  # before Linux 5.14: the pages fault in as they are read
        pass


#: ``madvise`` advice that maps pages for reading (Linux 5.14); Python names it from 3.13 on.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _device_of(objects: Mapping[str, Any]) -> torch.device | None:
    """The CUDA device of the first module with parameters there, if any."""
    for obj in objects.values():
        if isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                if param.is_cuda:
                    return param.device
    return None


#: ``cudaHostRegisterReadOnly`` (CUDA 11.1 and later).
CUDA_HOST_REGISTER_READ_ONLY = 0x08


class _pinned_copies:
    """On a GPU: the image pinned (registered with CUDA) while the state is copied from it, so that the copies
    go by DMA, and queued on a side stream; the block ends once they are done. Elsewhere nothing."""

    def __init__(self, region: torch.Tensor, device: torch.device | None):
        self.region, self.device = region, device
        self.pinned = False
        self.stream = self._context = None

    def __enter__(self) -> None:
        if self.device is None:
            return
        try:  # read-only: pinning the copy-on-write mapping for writing would copy every page of it
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.region.data_ptr(), self.region.numel(),
                                                                  CUDA_HOST_REGISTER_READ_ONLY)) == 0
        except (RuntimeError, AttributeError):  # copies then go through CUDA's own staging buffers
            self.pinned = False
        self.stream = torch.cuda.Stream(self.device)
        self._context = torch.cuda.stream(self.stream)
        self._context.__enter__()

    def __exit__(self, *exc) -> None:
        if self.stream is None:
            return
        self._context.__exit__(*exc)
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.region.data_ptr())


def report_world_change(info: CheckpointInfo, rank: int, world: int, per_rank: Collection[str]) -> None:
    """Say which per-rank state a world size other than the saving one leaves fresh or behind."""
    if info.world == world:
        return
    if rank >= info.world:
        log.warning("dashrun: rank %d: checkpoint of step %d was saved by %d ranks; this rank has no saved "
                    "per-rank state (%s, RNG) and starts those fresh", rank, info.step, info.world,
                    ", ".join(sorted(per_rank)) or "none")
    elif rank == 0 and info.world > world:
        log.warning("dashrun: checkpoint of step %d was saved by %d ranks, restored by %d: per-rank state "
                    "(%s, RNG) of ranks %d..%d is not restored", info.step, info.world, world,
                    ", ".join(sorted(per_rank)) or "none", world, info.world - 1)
