"""The StorageReader: a committed step read back from dash-memd, only the bytes each rank's plan asks for.

:class:`Reader` builds DCP's ``Metadata`` from rank 0's description of a
committed step (:func:`dashrun.dcp.metadata.parse_metadata`, every offset and
length checked against the shards' announced sizes) and reads each item as
byte ranges of the shard that holds it: only the bytes of the slices this
rank's planner asks for (:func:`dashrun.rank.sharded.byte_runs`, with short
gaps read rather than skipped), never the whole checkpoint; under dashrun on a
node of several ranks the node's dash-agent reads them (one fetch for the
node), elsewhere this process, each through the restore's source planner
(:mod:`dashrun.wire.planner`).
A value DCP pickled (``BYTE_IO``) is loaded as ``torch.load(weights_only=True)``
does, whatever planner DCP uses (:mod:`dashrun.dcp.planner`), unless the
reader was built with ``allow_pickle=True``.
:func:`describe_dcp` tells a checkpoint :class:`dashrun.dcp.Writer` wrote from
any other, and :func:`full_state` loads the whole of one in this process, as
``dashrun export`` writes it.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import uuid
from typing import Any, Iterator, Sequence

import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dashrun.dcp.metadata import FORMAT, MAX_META_DEPTH, Where, parse_metadata
from dashrun.dcp.planner import PickleRefused, SafeLoadPlanner, load_weights_only
from dashrun.dcp.target import Connected, Target, step_of
from dashrun.errors import NotFoundError, ProtocolError, UsageError
from dashrun.rank.sharded import byte_runs, joined
from dashrun.rank.staging import bytes_of
from dashrun.wire import layout
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.planner import MemdSource, Planner, pieces
from dashrun.wire.tls import TlsSettings

__all__ = ["MAX_GAP", "Reader", "describe_dcp", "full_state"]

#: Gaps of at most this many bytes between the pieces of one item a rank needs are read rather than skipped:
#: one request instead of many small ones (a column slice of a row-major chunk is one piece per row).
MAX_GAP = 64 << 10


class Reader(Connected, StorageReader):
    """A ``torch.distributed.checkpoint`` StorageReader that reads a committed step from dash-memd.

    The step is ``checkpoint_id`` of ``dcp.load`` (an int, or a string or path
    whose last run of digits is the step), else ``step=``, else the newest
    committed step of the job (looked up by each rank: pass the step when
    another save may commit meanwhile). The job and dash-memd are found as
    :class:`~dashrun.dcp.Writer` finds them; ``client=`` reuses an open connection (not
    closed by the reader). ``bytes_read`` counts the item bytes it fetched, and
    ``bytes_via`` splits them by the path they took: ``"agent"`` (the node's
    dash-agent put them in the node's image) or ``"memd"`` (read straight
    from dash-memd, as the only rank of a node does).

    Values DCP pickled (``BYTE_IO``: whatever is not a tensor) are never
    fully unpickled unless ``allow_pickle=True``: the bytes dash-memd serves
    may have come from its disk or its bucket, where someone without the
    cluster's token may have written. With any planner, DCP's default one
    too, the reader loads each such value as ``torch.load(weights_only=True)``
    does and hands the planner that (saved again, so the planner's own
    ``torch.load`` rebuilds only what the weights-only load allowed); a value
    that needs more is refused with
    :class:`~dashrun.dcp.planner.PickleRefused` (DCP raises it in its
    ``CheckpointException``), and nothing it names runs. A
    :class:`~dashrun.dcp.SafeLoadPlanner` loads them weights-only itself, so
    the reader leaves them to it. ``allow_pickle=True`` hands the planner the
    bytes as they are (DCP's default planner then unpickles them fully): only
    where dash-memd and its bucket are trusted.
    """

    _UNPICKLED = ("_client", "_image")

    def __init__(self, job: str | None = None, step: int | None = None, memd: str | tuple[str, int] | None = None,
                 token_file: str | os.PathLike | None = None, *, tls: TlsSettings | None = None,
                 client: MemdClient | None = None, allow_pickle: bool = False):
        super().__init__()
        self.allow_pickle = allow_pickle
        if client is not None:
            memd = (client.host, client.port)
            token_file = token_file or "-"  # the client holds the token already
            self._client, self._owns_client = client, False
        self._target = Target.resolve("Reader", job, memd, token_file, tls, use_agent=client is None)
        if self._target.memd is None:
            raise UsageError("dashrun.dcp.Reader does not know where dash-memd is",
                             hint="pass memd='HOST:PORT' and token_file=..., or run under dashrun (it sets DASH_MEMD)")
        self._image: tuple[memoryview, list[int]] | None = None  # (the node's image mapped, each saved rank's tail)
        self.step = None if step is None else step_of(int(step))
        self.info: CheckpointInfo | None = None
        self.metadata: Metadata | None = None
        self.bytes_read = 0
        self.bytes_via = {"agent": 0, "memd": 0}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self.info = self.metadata = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            info = self._memd().latest(self.job, self.step)
            if info is None:
                raise NotFoundError(f"job {self.job} has no committed checkpoint" +
                                    (f" of step {self.step}" if self.step is not None else ""),
                                    hint=f"see what there is with: dashrun ls {self.job}")
            description = describe_dcp(self._memd(), info)
            if description is None:
                raise UsageError(f"{info.job} step {info.step} was not written by dashrun.dcp.Writer",
                                 hint="restore it with dashrun.Checkpointer, or export it: dashrun export")
            self.metadata = parse_metadata(description, info)
            self.info, self.step = info, info.step
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.info is None or metadata is not self.metadata:
            self.read_metadata()  # DCP handed over metadata it read through another reader: use our own

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # The node's ranks share one fetch into the node's image. The only rank of a node reads for itself,
        # straight into its tensors: an image would be new shared memory, costlier than the bytes' transfer
        # on a small machine, and dash-agent lets it go once that one rank has it.
        if self._target.agent_socket is not None and (self._target.memd is None or _node_ranks() > 1):
            self._image = self._agent_image(self._ranges(plan))
        try:
            self._read_items(plan, planner)
        finally:
            self._drop_image()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _ranges(self, plan: LoadPlan) -> list[tuple[int, int, int]]:
        """(saved rank, start, stop) in its private part of every byte the plan's items read."""
        ranges = []
        for item in plan.items:
            where = self._where(item)
            if item.type == LoadItemType.BYTE_IO:
                ranges.append((where.rank, where.start, where.start + where.length))
                continue
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            _, windows = self._windows(md, item.storage_index.offset, item.storage_offsets, item.lengths)
            ranges += [(where.rank, where.start + start, where.start + end) for start, end in windows]
        return ranges

    def _agent_image(self, ranges: list[tuple[int, int, int]]) -> tuple[memoryview, list[int]]:
        """The node's dash-agent reads ``ranges`` from dash-memd into the node's image of this step (one fetch
        for the node's ranks, over several streams), mapped here: each run of the ranges in one call, not a
        page fault per page as they are copied out."""
        from dashrun.rank.restore import fetch_ranges, first_local_rank, populate
        from dashrun.wire.agent_link import AgentLink
        from dashrun.wire.agent_messages import RestoreRequest

        local = os.environ.get("LOCAL_RANK")
        first = first_local_rank(int(os.environ.get("RANK", "0")), None if local is None else int(local))
        local_world = _node_ranks()
        link = AgentLink(self._target.agent_socket)
        try:
            request = RestoreRequest(self.job, self.step, local_world, first, tuple(ranges))
            reply, frame = fetch_ranges(link, request, on_wait=lambda message: None)
        finally:
            link.close()
        try:
            if not reply.found or reply.checkpoint.committed_at != self.info.committed_at:
                raise NotFoundError(f"{self.job} step {self.step} went away while it was read",
                                    hint="load again: the newest checkpoint then")
            mapped = mmap.mmap(frame.fds[0], os.fstat(frame.fds[0]).st_size, prot=mmap.PROT_READ)
        finally:
            frame.close_fds()
        tails = reply.tails  # one per saved rank: the agent refused ranks the checkpoint does not have
        for start, stop in joined([(tails[rank] + a, tails[rank] + b) for rank, a, b in ranges], MAX_GAP):
            populate(mapped, stop, start)
        return memoryview(mapped), list(reply.tails)  # unmapped once the view is released

    def _drop_image(self) -> None:
        if self._image is not None:
            view, self._image = self._image[0], None
            view.release()

    def _where(self, item) -> Where:
        where = self.metadata.storage_data.get(item.storage_index)
        if where is None:
            raise ProtocolError(f"{item.storage_index.fqn!r} is not stored in {self.job} step {self.step}")
        return where

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        for item in plan.items:
            where = self._where(item)
            if item.type == LoadItemType.BYTE_IO:
                data = bytearray(where.length)
                self._read(where, 0, memoryview(data))
                planner.load_bytes(item, self._vetted(io.BytesIO(data), item, planner))
                continue
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            target = planner.resolve_tensor(item).detach()
            tensor = self._read_slice(where, md, item.storage_index.offset, item.storage_offsets, item.lengths,
                                      into=target)
            if tensor is not target:
                if target.size() != tensor.size():
                    raise UsageError(f"{item.storage_index.fqn}: the checkpoint's slice has shape "
                                     f"{tuple(tensor.size())}, the tensor to load it into {tuple(target.size())}")
                target.copy_(tensor)
            planner.commit_tensor(item, target)

    def _vetted(self, value: io.BytesIO, item, planner: LoadPlanner) -> io.BytesIO:
        """``value`` as the planner may unpickle it: as it is where pickles are allowed, or the planner loads
        weights-only itself; else loaded weights-only here, and saved again for the planner's ``torch.load``."""
        if self.allow_pickle or (isinstance(planner, SafeLoadPlanner) and not planner.allow_pickle):
            return value
        loaded = load_weights_only(value, f"{self.job} step {self.step}: {item.storage_index.fqn!r}")
        resaved = io.BytesIO()
        torch.save(loaded, resaved)  # of the types the weights-only load allowed, so only they are rebuilt
        resaved.seek(0)
        return resaved

    def _read_slice(self, where: Where, md: TensorStorageMetadata, chunk_offsets: Sequence[int],
                    offsets: Sequence[int], lengths: Sequence[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """The slice ``offsets``/``lengths`` of the stored chunk at ``chunk_offsets``: only its bytes are read.

        Read straight into ``into`` (and ``into`` returned) where its bytes are the slice's, in order: a tensor
        in RAM of the slice's dtype and shape, dense, and the slice one run of the stored chunk (a whole
        chunk, or whole rows of it). A rank's tensors have their memory already; a new tensor to read into
        and copy from would cost fresh memory, more than the bytes' transfer on a small machine."""
        sizes, windows = self._windows(md, chunk_offsets, offsets, lengths)
        dtype = md.properties.dtype
        if not windows:
            return torch.empty(tuple(lengths), dtype=dtype)
        if (into is not None and len(windows) == 1 and into.device.type == "cpu" and into.dtype == dtype
                and into.layout == torch.strided and into.is_contiguous() and list(into.size()) == list(lengths)
                and windows[0][1] - windows[0][0] == into.numel() * into.element_size()):
            self._read(where, windows[0][0], bytes_of(into.reshape(-1).view(torch.uint8)))
            increment_version(into)  # written behind autograd's back: as copy_() would, mark it changed
            return into
        first = windows[0][0]
        span = torch.empty(windows[-1][1] - first, dtype=torch.uint8)
        for start, end in windows:
            self._read(where, start, bytes_of(span[start - first:end - first]))
        strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
        return span.view(dtype).as_strided(tuple(lengths), strides, 0)

    def _windows(self, md: TensorStorageMetadata, chunk_offsets: Sequence[int], offsets: Sequence[int],
                 lengths: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """(the stored chunk's sizes, the byte windows of the chunk that hold the slice ``offsets``/``lengths``)."""
        sizes = next((list(c.sizes) for c in md.chunks if list(c.offsets) == list(chunk_offsets)), None)
        if sizes is None or len(offsets) != len(sizes) or len(lengths) != len(sizes) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes)):
            raise UsageError(f"a slice {list(offsets)}+{list(lengths)} lies outside the stored chunk {sizes}")
        if math.prod(lengths) == 0:
            return sizes, []
        return sizes, joined(byte_runs(sizes, list(offsets), list(lengths), md.properties.dtype.itemsize), MAX_GAP)

    def _read(self, where: Where, offset: int, view: memoryview) -> None:
        """Bytes ``[offset, offset + len(view))`` of the item at ``where``, checked to lie within it."""
        if offset < 0 or offset + len(view) > where.length:
            raise ProtocolError("a read outside the item that should hold it")
        if not len(view):
            return
        if self._image is not None:  # the node's dash-agent put it in the image (see _agent_image)
            mapped, tails = self._image
            start = tails[where.rank] + where.start + offset
            view[:] = mapped[start:start + len(view)]  # a view of the mapping: one copy, no bytes object
            self.bytes_via["agent"] += len(view)
        else:  # through the restore's source planner, as the agent reads (dash-memd's RAM, disk or bucket)
            start = where.start + offset
            tails = [-start] * len(self.info.shards)  # where each saved rank's private part would begin in view
            extents = pieces(self.info, tails, [(where.rank, start, start + len(view))])
            Planner([MemdSource(self._lend, streams=1)]).read(self.info, extents, view)
            self.bytes_via["memd"] += len(view)
        self.bytes_read += len(view)

    @contextlib.contextmanager
    def _lend(self) -> Iterator[MemdClient]:
        """This reader's connection to dash-memd, for the planner's one stream (it stays open after)."""
        yield self._memd()


def _node_ranks() -> int:
    """The ranks of this node, as the launcher says (torchrun's LOCAL_WORLD_SIZE); 1 if it does not."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() else 1


def describe_dcp(client: MemdClient, info: CheckpointInfo) -> dict[str, Any] | None:
    """Rank 0's ``"dcp"`` metadata of a committed checkpoint (read as one byte range), or None if
    :class:`~dashrun.dcp.Writer` did not write it."""
    shard = info.shards[0]
    if info.rep_total != 0 or not shard.meta_len:
        return None
    meta = bytearray(shard.meta_len)
    client.get_shard_into(info.job, info.step, 0, [memoryview(meta)],
                          offset=shard.rep_end - shard.rep_start + shard.private_len, committed_at=info.committed_at)
    description = layout.decode(meta, f"{info.job} step {info.step}", max_depth=MAX_META_DEPTH)
    dcp = description.get("dcp")
    if not isinstance(dcp, dict):
        return None
    if dcp.get("format") != FORMAT:
        raise UsageError(f"{info.job} step {info.step} was written by another version of dashrun.dcp "
                         f"(format {str(dcp.get('format'))[:20]})", hint="read it with that version")
    return dcp.get("metadata")


def full_state(client: MemdClient, info: CheckpointInfo) -> dict[str, Any] | None:
    """The whole state of a checkpoint :class:`~dashrun.dcp.Writer` wrote, as ``dcp.load`` gives it to one process (full
    tensors, nested as saved); None if it was not written by :class:`~dashrun.dcp.Writer`."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class WeightsOnly(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
        """DCP's planner for a state it builds from the metadata, but unpickling values as ``torch.load``'s
        ``weights_only`` does: whoever can write into dash-memd's disk or bucket cannot make an export run code."""

    if describe_dcp(client, info) is None:
        return None
    state: dict[str, Any] = {}
    reader = Reader(info.job, info.step, client=client)
    try:
        _load_state_dict(state, storage_reader=reader, planner=WeightsOnly(), no_dist=True)
    except CheckpointException as e:
        failures = [failure[0] for failure in e.failures.values()]  # (exception, its traceback)
        refused = [f for f in failures if isinstance(f, PickleRefused)]
        if not refused:
            raise
        raise UsageError(f"{info.job} step {info.step}: {refused[0].message}",
                         hint="export loads such values as torch.load(weights_only=True) does; where the source "
                              "is trusted, load it with dcp.load and dashrun.dcp.Reader(allow_pickle=True)") from None
    return state
