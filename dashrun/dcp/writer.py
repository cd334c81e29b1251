"""The StorageWriter: each rank's write items as one shard of an ordinary dashrun checkpoint.

Every rank of DCP's process group sends one shard, with no replicated part
(``rep_total`` 0): its write items' bytes one after the other are its private
part, and its description (:mod:`dashrun.wire.layout`) lists them under ``"dcp"``. The coordinator's
``prepare_global_plan`` gives each rank its place and a layout digest of every
rank's items; DCP calls ``finish`` on the coordinator only after every rank's
``write_data``, so the other ranks send their shards from ``write_data`` and
the coordinator sends its own from ``finish``, with DCP's global metadata
(:func:`dashrun.dcp.metadata.describe_metadata`) in its description, and
waits until dash-memd has committed the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import uuid
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dashrun.dcp.metadata import FORMAT, Where, describe_metadata, index_json
from dashrun.dcp.target import Connected, Target, step_of
from dashrun.errors import NotFoundError, UsageError
from dashrun.rank.staging import bytes_of
from dashrun.wire import layout
from dashrun.wire.messages import ShardHeader
from dashrun.wire.tls import TlsSettings

__all__ = ["COMMIT_TIMEOUT", "Writer"]

#: How long ``dcp.save`` waits for dash-memd to commit the step after the coordinator's shard is stored.
COMMIT_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class _PlanInfo:
    """What the coordinator adds to each rank's save plan: the rank's place and the checkpoint's layout digest."""

    rank: int
    world: int
    layout: str


class Writer(Connected, StorageWriter):
    """A ``torch.distributed.checkpoint`` StorageWriter that stores into dash-memd.

    ``checkpoint_id`` (of ``dcp.save``) names the step: an int, or a string or
    path whose last run of digits is the step; ``step=`` gives it instead. The
    job is ``job=``, else the running dashrun job (``DASH_JOB_ID``). The shard
    goes through the node's dash-agent (shared memory) when one runs for this
    process and ``memd=`` is not given; otherwise straight to dash-memd at
    ``memd=`` (``HOST:PORT``; default ``DASH_MEMD``) with the token in
    ``token_file=`` (default ``DASH_TOKEN_FILE``). ``dcp.save`` returns once
    dash-memd has committed the step. DCP must coordinate the ranks
    (``use_collectives=True``, its default). ``sent_via`` says the path the
    last shard this object sent took: ``"agent"`` or ``"memd"`` (``None``
    before one is sent, or where DCP sent it from a copy of the writer in
    its checkpointing process).
    """

    _UNPICKLED = ("_client", "_link", "_pending")
    _link = None
    _pending: tuple[ShardHeader, list[Any], dict[str, Any]] | None = None  # (header, parts, the "dcp" part)
    sent_via: str | None = None

    def __init__(self, job: str | None = None, memd: str | tuple[str, int] | None = None,
                 token_file: str | os.PathLike | None = None, *, step: int | None = None,
                 tls: TlsSettings | None = None, commit_timeout: float = COMMIT_TIMEOUT):
        super().__init__()
        self._target = Target.resolve("Writer", job, memd, token_file, tls, use_agent=True)
        self.step = None if step is None else step_of(int(step))
        self.commit_timeout = commit_timeout
        self.is_coordinator = False
        self.save_id: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self._pending = None
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise UsageError("dashrun.dcp.Writer: no step to save", hint="pass checkpoint_id=STEP to dcp.save")
        if kwargs.get("use_collectives", True) is False:
            raise UsageError("dashrun.dcp.Writer needs DCP to coordinate the ranks",
                             hint="leave dcp.save's use_collectives at True")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Every rank announces the same layout digest; this one names every item of every rank, in order.
        described = [[index_json(item.index) for item in plan.items] for plan in plans]
        digest = hashlib.sha256(json.dumps(["dashrun.dcp", FORMAT, described], separators=(",", ":"))
                                .encode()).hexdigest()
        return [dataclasses.replace(plan, storage_data=_PlanInfo(rank, len(plans), digest))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        where = plan.storage_data
        if not isinstance(where, _PlanInfo):
            raise UsageError("dashrun.dcp.Writer: the save plan lost its storage data",
                             hint="a custom SavePlanner must keep SavePlan.storage_data")
        parts, items, results, position = [], [], [], 0
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                part = memoryview(data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)).cast("B")
            else:
                # Only the projection is stored, contiguous in host memory (DCP may hand over a view on a GPU).
                tensor = data.detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                part = tensor.contiguous()
            length = part.nbytes
            parts.append(part)
            items.append({**index_json(item.index), "start": position, "length": length})
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=Where(where.rank, position, length)))
            position += length
        dcp_part = {"format": FORMAT, "items": items}  # the coordinator's gets DCP's metadata in finish()
        header = ShardHeader(job=self.job, step=self.step, rank=where.rank, world=where.world, rep_total=0,
                             rep_start=0, rep_end=0, private_len=position, meta_len=0, layout=where.layout,
                             pieces_len=position,  # every item is read by byte range, never a node's whole part
                             generation=self._target.generation)
        self._pending = (header, parts, dcp_part)
        if not self.is_coordinator:  # the coordinator sends its own from finish(), with the global metadata
            self._send()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._pending is None:
            raise UsageError("dashrun.dcp.Writer: finish() before write_data()")
        storage = {}
        for rank_results in results:
            storage.update({r.index: r.storage_data for r in rank_results})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        self._pending[2]["metadata"] = describe_metadata(metadata)
        self._send(wait_commit=True)

    def _send(self, wait_commit: bool = False) -> None:
        header, parts, dcp_part = self._pending
        # An ordinary dashrun description with nothing in it (dashrun's own restore finds no state here), and DCP's.
        meta = layout.encode(step=header.step, rank=header.rank, world=header.world,
                             private=layout.private_part({}, []), dcp=dcp_part,
                             replicated=layout.replicated_part({}, [], 0) if header.rank == 0 else None)
        header = dataclasses.replace(header, meta_len=len(meta))
        views = [bytes_of(p.view(-1).view(torch.uint8)) if isinstance(p, torch.Tensor) else p for p in parts]
        views.append(memoryview(meta))
        try:
            if self._target.agent_socket is not None:
                self._send_by_agent(header, views, wait_commit)
                self.sent_via = "agent"
            else:
                reply = self._memd().put_shard(header, views)
                if wait_commit and not reply.get("committed") and not self._memd().wait(
                        header.job, header.step, self.commit_timeout):
                    raise NotFoundError(f"dash-memd did not commit {header.job} step {header.step} within "
                                        f"{self.commit_timeout:g} s", hint="did every rank of the save reach it?")
                self.sent_via = "memd"
        finally:
            self._pending = None

    def _send_by_agent(self, header: ShardHeader, views: Sequence[memoryview], wait_commit: bool) -> None:
        """Hand the shard to the node's dash-agent in a shared-memory segment; it replies once it is stored."""
        from dashrun.rank.snapshot import SharedBuffer
        from dashrun.wire.agent_link import AgentLink
        from dashrun.wire.agent_messages import SnapshotRequest, WaitReply, WaitRequest
        from dashrun.wire.protocol import Kind

        if self._link is None:
            self._link = AgentLink(self._target.agent_socket)
        buffer = SharedBuffer(max(header.nbytes, 1))
        try:
            position = 0
            for view in views:
                buffer.write(position, view)
                position += len(view)
            request = SnapshotRequest(header, ready=header.nbytes)
            self._link.call(Kind.SNAPSHOT, request.to_body(), fds=[buffer.fd], timeout=self.commit_timeout)
        finally:
            buffer.close()  # the agent holds its own descriptor of the segment while it still reads it
        if wait_commit:
            reply = self._link.call(Kind.WAIT, WaitRequest(header.job, header.step, self.commit_timeout).to_body(),
                                    timeout=self.commit_timeout + 10)
            if not WaitReply.from_body(reply.body).committed:
                raise NotFoundError(f"dash-memd did not commit {header.job} step {header.step} within "
                                    f"{self.commit_timeout:g} s", hint="did every rank of the save reach it?")

    def close(self) -> None:
        super().close()
        if self._link is not None:
            self._link.close()
            self._link = None
