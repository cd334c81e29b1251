"""The messages between a rank and its node's dash-agent, typed like those to dash-memd.

They travel as frames over the node's Unix socket (:mod:`dashrun.wire.channel`);
each request carries an ``id`` that its reply repeats (added and matched by
:class:`dashrun.wire.agent_link.AgentLink`, not part of these types). The
agent pushes :class:`~dashrun.wire.messages.Notice` frames to the ranks
unasked. Every ``from_body`` checks, bounded, each field a peer sent.

====================  =========================================  ===============================
frame                 request (rank -> agent)                    reply (agent -> rank)
====================  =========================================  ===============================
SNAPSHOT (+ segment)  :class:`SnapshotRequest`                   :class:`SnapshotReply`
PROGRESS              :class:`Progress` (one-way)                -
RESTORE               :class:`RestoreRequest`                    :class:`RestoreReply` (+ image)
WAIT                  :class:`WaitRequest`                       :class:`WaitReply`
PING                  ``{}``                                     ``{"pid": ...}``
====================  =========================================  ===============================
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dashrun.errors import ProtocolError
from dashrun.wire.history import Restored
from dashrun.wire.holdings import Holder, field_node, holders_from_body, holders_to_body
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.protocol import (
    MAX_BYTES,
    MAX_STEP,
    MAX_WORLD,
    field_bool,
    field_float,
    field_int,
    field_job,
    field_step,
)

__all__ = ["MAX_RANGES", "MAX_WAIT", "Progress", "RestoreReply", "RestoreRequest", "SnapshotReply", "SnapshotRequest",
           "WaitReply", "WaitRequest"]

#: Longest a WAIT may block.
MAX_WAIT = 3600.0
#: Most byte ranges one RESTORE may ask for besides the node's parts.
MAX_RANGES = 16384
#: Most seconds of stall a rank may report (a year): beyond is a malformed body.
MAX_STALL = 365 * 86400.0


@dataclasses.dataclass(frozen=True)
class SnapshotRequest:
    """A shard handed over in the shared-memory segment attached to the frame, perhaps still being staged.

    ``ready``: bytes ``[0, ready)`` of the shard are final already (PROGRESS
    tells the rest). ``emergency``: taken because of an interruption notice.
    ``checksum``: the rank computes the shard's CRC-32C as it stages and sends
    it with its last PROGRESS; otherwise the agent computes it as it sends.
    ``skipped`` and ``stall_s``: the rank's snapshots skipped and seconds its
    training was blocked by saves, since it started (for dash-agent's metrics;
    sent only once non-zero, so older agents see the body they knew).
    ``restored``: how the rank's run began (the job's run history counts the
    steps redone from it: :mod:`dashrun.wire.history`).
    """

    shard: ShardHeader
    ready: int = 0
    emergency: bool = False
    checksum: bool = False
    skipped: int = 0
    stall_s: float = 0.0
    restored: Restored | None = None

    def to_body(self) -> dict[str, Any]:
        body = {"shard": self.shard.to_body(), "ready": self.ready, "emergency": self.emergency,
                "checksum": self.checksum}
        if self.skipped:
            body["skipped"] = self.skipped
        if self.stall_s:
            body["stall_s"] = self.stall_s
        if self.restored is not None:
            body["restored"] = self.restored.to_body()
        return body

    @classmethod
    def from_body(cls, body: dict) -> SnapshotRequest:
        shard = body.get("shard")
        if not isinstance(shard, dict):
            raise ProtocolError("field 'shard' must be an object")
        header = ShardHeader.from_body(shard)
        return cls(shard=header, ready=field_int(body, "ready", 0, header.nbytes),
                   emergency=field_bool(body, "emergency", default=False),
                   checksum=field_bool(body, "checksum", default=False),
                   skipped=field_int(body, "skipped", 0, MAX_STEP, default=0),
                   stall_s=field_float(body, "stall_s", 0.0, MAX_STALL, default=0.0),
                   restored=None if body.get("restored") is None else Restored.from_body(body["restored"]))


@dataclasses.dataclass(frozen=True)
class SnapshotReply:
    """The shard is stored and verified in dash-memd: its buffer may be reused."""

    committed: bool
    crc: int | None = None

    def to_body(self) -> dict[str, Any]:
        return {"committed": self.committed, "crc": self.crc}

    @classmethod
    def from_body(cls, body: dict) -> SnapshotReply:
        crc = body.get("crc")
        return cls(committed=field_bool(body, "committed"),
                   crc=None if crc is None else field_int(body, "crc", 0, 0xFFFFFFFF))


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far the snapshot of request ``id`` is staged: ``ready`` bytes final (with the rank's ``crc`` once all
    are), or ``failed``: the rank gave it up and it must not go out."""

    id: int
    ready: int | None = None
    crc: int | None = None
    failed: bool = False

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id}
        if self.failed:
            body["failed"] = True
        if self.ready is not None:
            body["ready"] = self.ready
        if self.crc is not None:
            body["crc"] = self.crc
        return body

    @classmethod
    def from_body(cls, body: dict, nbytes: int = MAX_BYTES) -> Progress:
        """``nbytes``: the size of the shard it is about, which ``ready`` may not exceed."""
        failed = body.get("failed") is True
        ready = None if failed or body.get("ready") is None else field_int(body, "ready", 0, nbytes)
        crc = None if body.get("crc") is None else field_int(body, "crc", 0, 0xFFFFFFFF)
        return cls(id=field_int(body, "id", 0, MAX_STEP), ready=ready, crc=crc, failed=failed)


@dataclasses.dataclass(frozen=True)
class RestoreRequest:
    """Fetch the newest committed checkpoint of ``job`` (or ``step``) into shared memory for the node's
    ``local_ranks`` ranks: the node downloads it once however many ranks map it. The node's ranks are
    ``first_rank`` and the ``local_ranks - 1`` after it (None: unknown, every saved rank's part is fetched).

    ``ranges``: byte ranges ``(saved rank, start, stop)`` of saved ranks' private parts that the rank needs
    besides, read into their place in the same image: its pieces of sharded state. A rank restoring sharded
    state asks twice, the second time with its ranges (perhaps none); None: not such a second request. More
    than :data:`MAX_RANGES` go in several requests, every one but the last with ``more``: the image stays for
    the next (it is not yet the rank's).

    ``direct``: the rank would rather read the replicated state from dash-memd itself, straight into the
    tensors it has, than map it from the image: the reply says whether the image leaves it out.
    """

    job: str
    step: int | None = None
    local_ranks: int = 1
    first_rank: int | None = None
    ranges: tuple[tuple[int, int, int], ...] | None = None
    more: bool = False
    direct: bool = False

    @property
    def ranks(self) -> range | None:
        return None if self.first_rank is None else range(self.first_rank, self.first_rank + self.local_ranks)

    def to_body(self) -> dict[str, Any]:
        body = {"job": self.job, "step": self.step, "local_ranks": self.local_ranks, "first_rank": self.first_rank}
        if self.ranges is not None:
            body["ranges"] = [list(r) for r in self.ranges]
        if self.more:
            body["more"] = True
        if self.direct:
            body["direct"] = True
        return body

    @classmethod
    def from_body(cls, body: dict) -> RestoreRequest:
        first = body.get("first_rank")
        raw = body.get("ranges")
        if raw is not None and (not isinstance(raw, list) or len(raw) > MAX_RANGES):
            raise ProtocolError(f"field 'ranges' must be a list of at most {MAX_RANGES} ranges")
        ranges = None if raw is None else []
        for item in raw or ():
            if not (isinstance(item, list) and len(item) == 3):
                raise ProtocolError("a range is [rank, start, stop]")
            rank, start, stop = (field_int({"range": v}, "range") for v in item)
            if rank >= MAX_WORLD or stop < start:
                raise ProtocolError("a range is [rank, start, stop] with start <= stop")
            ranges.append((rank, start, stop))
        return cls(job=field_job(body), step=field_step(body) if body.get("step") is not None else None,
                   local_ranks=field_int(body, "local_ranks", 1, MAX_WORLD, default=1),
                   first_rank=None if first is None else field_int(body, "first_rank", 0, MAX_WORLD),
                   ranges=None if ranges is None else tuple(ranges), more=field_bool(body, "more", default=False),
                   direct=field_bool(body, "direct", default=False))


@dataclasses.dataclass(frozen=True)
class RestoreReply:
    """``found``: the image's descriptor is attached, laid out as :mod:`dashrun.wire.layout` says, with each
    saved rank's tail at ``tails[rank]``. ``direct``: the image holds the tails only; the rank reads the
    replicated state itself: from the other nodes in ``holders`` (each saved rank's, in the order node ``node``,
    this one, tries them; see :func:`dashrun.wire.planner.pick_holder`) where they hold it, else from dash-memd."""

    found: bool
    checkpoint: CheckpointInfo | None = None
    tails: tuple[int, ...] = ()
    direct: bool = False
    holders: dict[int, list[Holder]] = dataclasses.field(default_factory=dict)
    node: str = ""

    def to_body(self) -> dict[str, Any]:
        if not self.found:
            return {"found": False}
        body = {"found": True, "checkpoint": self.checkpoint.to_body(), "tails": list(self.tails)}
        if self.direct:
            body["direct"] = True
        if self.holders:
            body["holders"] = holders_to_body(self.holders)
            body["node"] = self.node
        return body

    @classmethod
    def from_body(cls, body: dict) -> RestoreReply:
        if not field_bool(body, "found"):
            return cls(found=False)
        raw = body.get("checkpoint")
        if not isinstance(raw, dict):
            raise ProtocolError("field 'checkpoint' must be an object")
        info = CheckpointInfo.from_body(raw)
        tails = body.get("tails")
        if not (isinstance(tails, list) and len(tails) == info.world
                and all(type(t) is int and 0 <= t <= MAX_BYTES for t in tails)):
            raise ProtocolError("field 'tails' must give one offset per saved rank")
        holders = holders_from_body(body.get("holders"), info.world)
        return cls(found=True, checkpoint=info, tails=tuple(tails), direct=field_bool(body, "direct", default=False),
                   holders=holders, node=field_node(body) if holders else "")


@dataclasses.dataclass(frozen=True)
class WaitRequest:
    """Block until ``step`` of ``job`` is committed in dash-memd, or ``timeout`` seconds have passed."""

    job: str
    step: int
    timeout: float

    def to_body(self) -> dict[str, Any]:
        return {"job": self.job, "step": self.step, "timeout": self.timeout}

    @classmethod
    def from_body(cls, body: dict) -> WaitRequest:
        return cls(job=field_job(body), step=field_step(body), timeout=field_float(body, "timeout", 0.0, MAX_WAIT))


@dataclasses.dataclass(frozen=True)
class WaitReply:
    committed: bool

    def to_body(self) -> dict[str, Any]:
        return {"committed": self.committed}

    @classmethod
    def from_body(cls, body: dict) -> WaitReply:
        return cls(committed=field_bool(body, "committed"))
