"""The structured messages of the wire format: what a shard, a checkpoint, a launch and a notice look like.

Each is a frozen dataclass with ``to_body()`` (a JSON object for a frame's
body) and ``from_body()``, which checks every field a peer sent, bounded,
before anything is built from it. Pure, like :mod:`dashrun.wire.protocol`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
from typing import Any, ClassVar, Mapping

from dashrun.errors import AuthError, ProtocolError
from dashrun.wire.protocol import (
    HEX_DIGEST,
    MAX_BODY,
    MAX_BYTES,
    MAX_STEP,
    MAX_WORLD,
    field_bool,
    field_float,
    field_int,
    field_job,
    field_step,
    field_str,
)

__all__ = ["CLOUDS", "MAX_RDZV_STATE", "MAX_RDZV_WAIT", "MAX_STORE_JOB_BYTES", "MAX_STORE_KEY", "MAX_STORE_KEYS",
           "MAX_STORE_VALUE", "MAX_STORE_WAIT", "MEMBERSHIP_CHANGES", "CheckpointInfo", "JobSpec", "MembershipEvent",
           "Notice", "NoticeKind", "ShardHeader", "tiling_problem"]

#: An Ed25519 signature as 128 lowercase hex digits.
_SIGNATURE = re.compile(r"[0-9a-f]{128}")
#: Largest rendezvous state (torch's pickled rendezvous state, opaque to dash-memd) of one run id.
MAX_RDZV_STATE = 1 << 20
#: Longest a rendezvous read waits in dash-memd for the state to change (a node polling for a change).
MAX_RDZV_WAIT = 5.0
#: Largest key (UTF-8 bytes) and value of a job's key/value store.
MAX_STORE_KEY = 512
MAX_STORE_VALUE = 64 << 10
#: Keys, and bytes of keys and values together, one job's store holds at most.
MAX_STORE_KEYS = 4096
MAX_STORE_JOB_BYTES = 16 << 20
#: Longest one store request waits for keys to appear (a client waits longer by asking again).
MAX_STORE_WAIT = 300.0


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """What a rank's shard of one checkpoint holds, as announced in PUT_SHARD.

    A shard's bytes are ``[replicated slice][private][meta]``: the rank's slice
    ``[rep_start, rep_end)`` of the state every rank holds alike (so replicated
    state crosses the wire once, split between ranks), the rank's own private
    tensors (RNG, data cursor), and its layout description (JSON) — opaque to
    dash-memd, which checks only that the slices of all ranks tile
    ``[0, rep_total)`` and that every rank announced the same ``layout`` digest.

    ``generation`` is the world generation the rank's world was formed in
    (elastic jobs; 0: not fenced, as from dashrun before elastic jobs):
    dash-memd refuses a shard of a generation older than the job's, so a
    node cut off from the others cannot commit into the new world.

    ``base``: the step the rank's run restored (-1: fresh); a step holds one run's shards (``attempt``).

    ``pieces_len``: the last bytes of the private part hold the rank's pieces of
    sharded state (DTensors), read by byte range (:mod:`dashrun.rank.sharded`).
    """

    job: str
    step: int
    rank: int
    world: int
    rep_total: int
    rep_start: int
    rep_end: int
    private_len: int
    meta_len: int
    layout: str
    crc: int = 0  # CRC-32C of the shard's bytes; 0 until they are verified
    generation: int = 0
    pieces_len: int = 0  # the last bytes of the private part: the rank's pieces of sharded state
    base: int = -1

    @property
    def attempt(self) -> tuple[int, int]:  # which sending of its step: a newer world, then a later-begun run, wins
        return self.generation, self.base

    @property
    def nbytes(self) -> int:
        return self.rep_end - self.rep_start + self.private_len + self.meta_len

    def to_body(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_body(cls, body: dict) -> ShardHeader:
        world = field_int(body, "world", 1, MAX_WORLD)
        rep_total = field_int(body, "rep_total")
        rep_start = field_int(body, "rep_start", 0, rep_total)
        private_len = field_int(body, "private_len")
        header = cls(
            job=field_job(body),
            step=field_step(body),
            rank=field_int(body, "rank", 0, world - 1),
            world=world,
            rep_total=rep_total,
            rep_start=rep_start,
            rep_end=field_int(body, "rep_end", rep_start, rep_total),
            private_len=private_len,
            meta_len=field_int(body, "meta_len", 0, MAX_BODY * 16),
            layout=field_str(body, "layout", 64, HEX_DIGEST),
            crc=field_int(body, "crc", 0, 0xFFFFFFFF, default=0),
            generation=field_int(body, "generation", 0, MAX_STEP, default=0),
            pieces_len=field_int(body, "pieces_len", 0, private_len, default=0),
            base=field_int(body, "base", -1, MAX_STEP, default=-1),
        )
        if header.nbytes > MAX_BYTES:
            raise ProtocolError("shard too large")
        return header


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as dash-memd describes it (also its manifest on disk)."""

    job: str
    step: int
    world: int
    rep_total: int
    layout: str
    committed_at: float
    shards: tuple[ShardHeader, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def to_body(self) -> dict[str, Any]:
        return {
            "job": self.job, "step": self.step, "world": self.world, "rep_total": self.rep_total,
            "layout": self.layout, "committed_at": self.committed_at,
            "shards": [s.to_body() for s in self.shards],
        }

    @classmethod
    def from_body(cls, body: dict) -> CheckpointInfo:
        world = field_int(body, "world", 1, MAX_WORLD)
        raw_shards = body.get("shards")
        if not isinstance(raw_shards, list) or len(raw_shards) != world:
            raise ProtocolError("field 'shards' must list one shard per rank")
        shards = []
        for rank, raw in enumerate(raw_shards):
            if not isinstance(raw, dict):
                raise ProtocolError("shard entry is not an object")
            shard = ShardHeader.from_body(raw)
            if shard.rank != rank or shard.world != world:
                raise ProtocolError("shard entries out of order")
            shards.append(shard)
        info = cls(
            job=field_job(body), step=field_step(body), world=world,
            rep_total=field_int(body, "rep_total"), layout=field_str(body, "layout", 64, HEX_DIGEST),
            committed_at=field_float(body, "committed_at", 0.0, 1e11), shards=tuple(shards),
        )
        problem = tiling_problem(info.shards, info.rep_total, info.layout)
        if problem or any(s.job != info.job or s.step != info.step for s in shards):
            raise ProtocolError(problem or "shards of another checkpoint")
        return info


def tiling_problem(shards: tuple[ShardHeader, ...] | list[ShardHeader], rep_total: int, layout: str) -> str | None:
    """Why the shards (ordered by rank) do not form one whole checkpoint, or None."""
    position = 0
    for shard in shards:
        if shard.layout != layout or shard.rep_total != rep_total:
            return f"rank {shard.rank} describes its state differently from rank 0"
        if shard.rep_start != position:
            return f"rank {shard.rank}'s slice of the replicated state does not follow rank {shard.rank - 1}'s"
        position = shard.rep_end
    if position != rep_total:
        return "the ranks' slices do not cover the replicated state"
    return None


MAX_ARGS = 1024
MAX_ARG_LEN = 8192


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """How a job was launched: what ``dashrun resume`` runs again on a new node.

    ``argv`` is the dashrun command line without the node-specific options
    (``--memd``, ``--token-file``), and ``cwd`` the directory it ran in.
    ``signature`` is the operator's Ed25519 signature over the job id and every
    other field (:meth:`signed`, :mod:`dashrun.wire.operator`): whoever can
    write where dash-memd keeps specs (its disk, the bucket), or holds the
    cluster's token or a job's credential, but not the operator's private key,
    cannot make a node run a command of theirs, since ``resume`` runs only a
    spec that :meth:`verify` accepts. A spec stored before specs were signed so
    has none.
    """

    argv: tuple[str, ...]
    cwd: str
    host: str
    created: float
    signature: str = ""

    #: Names what is signed, so that a signature can never pass for one over anything else.
    PURPOSE: ClassVar[str] = "dashrun launch spec v2"

    def to_body(self) -> dict[str, Any]:
        body = {"argv": list(self.argv), "cwd": self.cwd, "host": self.host, "created": self.created}
        return {**body, "signature": self.signature} if self.signature else body

    @classmethod
    def from_body(cls, body: dict) -> JobSpec:
        argv = body.get("argv")
        if (not isinstance(argv, list) or not 0 < len(argv) <= MAX_ARGS
                or not all(isinstance(a, str) and len(a) <= MAX_ARG_LEN for a in argv)):
            raise ProtocolError(f"field 'argv' must be a list of at most {MAX_ARGS} strings")
        return cls(argv=tuple(argv), cwd=field_str(body, "cwd", 4096), host=field_str(body, "host", 255),
                   created=field_float(body, "created", 0.0, 1e11),
                   signature=field_str(body, "signature", 128, _SIGNATURE) if body.get("signature") is not None
                   else "")

    def _message(self, job: str) -> bytes:
        # One JSON array of strings and a float: an unambiguous encoding, the same after any round trip
        # through the wire, a disk file or the bucket (a float's repr is exact).
        return json.dumps([self.PURPOSE, job, list(self.argv), self.cwd, self.host, float(self.created)],
                          ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()

    def signed(self, job: str, key) -> JobSpec:
        """This spec with the signature for job ``job`` of the operator's private ``key`` (Ed25519)."""
        return dataclasses.replace(self, signature=key.sign(self._message(job)).hex())

    def verify(self, job: str, public_key) -> None:
        """Raise AuthError unless the spec carries a valid signature for job ``job`` by ``public_key``."""
        from cryptography.exceptions import InvalidSignature

        if not self.signature:
            raise AuthError(f"the launch spec of job {job!r} is not signed by the operator (stored by a dashrun "
                            "older than signed specs, or by someone without the operator's key)",
                            hint="launch the job once more with dashrun --operator-key (same --job-id)")
        try:
            public_key.verify(bytes.fromhex(self.signature), self._message(job))
        except InvalidSignature:
            raise AuthError(f"the launch spec of job {job!r} does not carry a valid signature of the operator: "
                            "it was changed, or signed with another key",
                            hint="check --operator-pubkey; if it is right, launch the job once more with dashrun "
                                 "--operator-key (same --job-id) to store a new spec") from None


CLOUDS = ("aws", "gcp", "azure")


class NoticeKind(str, enum.Enum):
    TERMINATE = "terminate"  # the VM is deleted (AWS terminate, Azure Terminate)
    STOP = "stop"  # AWS: stopped; memory and instance store are lost
    HIBERNATE = "hibernate"  # AWS: hibernated, with no lead time
    PREEMPT = "preempt"  # GCP preempted, Azure Preempt
    MAINTENANCE = "maintenance"  # GCP TERMINATE_ON_HOST_MAINTENANCE; Azure Reboot/Redeploy/Freeze
    REBALANCE = "rebalance"  # AWS: elevated risk of interruption; no deadline


@dataclasses.dataclass(frozen=True)
class Notice:
    """One interruption notice (or early warning), from the cloud's metadata service to the ranks.

    The one notice type: dash-agent's pollers make it from what the metadata
    service served, the agent stamps its ``node`` on it and pushes it to the
    node's ranks and to dash-memd (the job's record), where ``dashrun status``
    shows it.

    ``deadline`` is epoch seconds: AWS's ``time``, Azure's ``NotBefore`` (the
    moment an event already started was seen, when blank), GCP's preemption
    first seen + 30 s, a GCP maintenance event first seen + 1 h; None when the
    cloud gives none (rebalance). ``early_warning`` marks notices with a long
    or no lead: checkpoint more often, there is time. ``id`` identifies the
    notice: the same notice served again has the same id. ``id``, ``detail``
    and ``seen_at`` stay on the node; the wire carries kind, cloud,
    ``early``, deadline and node.
    """

    cloud: str
    kind: NoticeKind
    deadline: float | None
    early_warning: bool = False
    id: str = ""
    node: str = ""
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    seen_at: float = dataclasses.field(default_factory=time.time, compare=False)

    #: ``severity``: an early warning, then a notice that the node goes away
    EARLY: ClassVar[int] = 1
    PREEMPT: ClassVar[int] = 2

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {', '.join(CLOUDS)}, not {self.cloud!r}")
        object.__setattr__(self, "kind", NoticeKind(self.kind))
        if self.deadline is not None:
            object.__setattr__(self, "deadline", float(self.deadline))
        object.__setattr__(self, "detail", dict(self.detail))

    @property
    def severity(self) -> int:
        return self.EARLY if self.early_warning else self.PREEMPT

    def outranks(self, known: Notice | None) -> bool:
        """Whether this notice tells more than ``known`` (the most serious one received so far)."""
        return known is None or self.severity > known.severity

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (negative once past); None without a deadline."""
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)

    def describe(self) -> str:
        left = self.seconds_left()
        when = "no deadline" if left is None else f"in {left:.0f} s"
        early = " (early warning)" if self.early_warning else ""
        return f"{self.cloud} {self.kind.value} notice{early}, {when}"

    def to_body(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "cloud": self.cloud, "early": self.early_warning, "deadline": self.deadline,
                "node": self.node}

    @classmethod
    def from_body(cls, body: dict) -> Notice:
        deadline = body.get("deadline")
        try:
            return cls(kind=field_str(body, "kind", 32), cloud=field_str(body, "cloud", 16),
                       early_warning=field_bool(body, "early"),
                       deadline=None if deadline is None else field_float(body, "deadline", 0.0, 1e11),
                       node=field_str(body, "node", 255, default=""))
        except ValueError as e:
            raise ProtocolError(f"malformed notice: {e}") from None


#: What a membership event says happened to its node; ``finished`` and ``failed``: the job's launch on that node
#: ended (its ranks exited 0 / non-zero), as the launcher records it at its end.
MEMBERSHIP_CHANGES = ("joined", "left", "died", "finished", "failed")
MAX_WHY = 500


@dataclasses.dataclass(frozen=True)
class MembershipEvent:
    """One change of an elastic job's nodes, as dash-memd records it and ``dashrun status JOB`` lists it.

    ``change``: ``joined``, ``left`` (after a notice: it checkpointed and
    exited), ``died`` (gone without notice), ``finished`` or ``failed`` (the
    launch ended, its ranks exited 0 or not). ``world``: the job's size in
    nodes after the change; ``generation``: the world generation it started.
    ``step``: the committed checkpoint the job continued from, and
    ``steps_lost`` how many steps done since it were lost (None where not
    known). ``node`` and ``why`` are printable text (they end up on terminals).
    """

    time: float
    node: str
    change: str
    why: str
    world: int
    generation: int
    step: int | None = None
    steps_lost: int | None = None

    def __post_init__(self) -> None:
        if self.change not in MEMBERSHIP_CHANGES:
            raise ValueError(f"change must be one of {', '.join(MEMBERSHIP_CHANGES)}, not {self.change!r}")
        for name, limit in (("node", 255), ("why", MAX_WHY)):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > limit or not value.isprintable():
                raise ValueError(f"{name} must be printable text of at most {limit} characters")
        if not self.node:
            raise ValueError("node must not be empty")

    def to_body(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_body(cls, body: dict) -> MembershipEvent:
        if not isinstance(body, dict):
            raise ProtocolError("a membership event must be an object")
        try:
            return cls(time=field_float(body, "time", 0.0, 1e11), node=field_str(body, "node", 255),
                       change=field_str(body, "change", 16), why=field_str(body, "why", MAX_WHY, default=""),
                       world=field_int(body, "world", 0, MAX_WORLD),
                       generation=field_int(body, "generation", 0, MAX_STEP),
                       step=None if body.get("step") is None else field_step(body),
                       steps_lost=None if body.get("steps_lost") is None else field_int(body, "steps_lost", 0,
                                                                                          MAX_STEP))
        except ValueError as e:
            raise ProtocolError(f"malformed membership event: {e}") from None
