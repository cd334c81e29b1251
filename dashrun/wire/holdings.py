"""What a node holds in its own RAM, as its dash-agent tells dash-memd (HOLDINGS), and who holds a checkpoint.

Every dash-agent of a job with replicas keeps its own node's newest committed
shards and copies of other nodes' (see docs/replicas.md), and tells
dash-memd, every :data:`ANNOUNCE_PERIOD` seconds and at once after a change,
what it holds and where other agents reach it (:class:`Holdings`).
dash-memd keeps the newest announcement of each node for
:data:`HOLDINGS_TTL` seconds (RAM only: agents announce again after it
restarts), answers each one with the job's other members (:class:`Member`,
from which an agent places its copies), and names, with each checkpoint a
restore asks for, the nodes that hold each saved rank's shard
(:class:`Holder`). Pure, like :mod:`dashrun.wire.messages`: every field a
peer sent is checked, bounded, before anything is built from it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from dashrun.errors import ProtocolError
from dashrun.wire.domain import FailureDomain
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.protocol import MAX_WORLD, field_bool, field_int, field_job, field_str

__all__ = ["ANNOUNCE_PERIOD", "Announced", "Located", "HOLDINGS_TTL", "MAX_HELD", "MAX_MEMBERS", "HeldShard", "Holder",
           "Holdings", "Member", "NodeView", "field_domain", "field_node", "holders_from_body", "holders_to_body"]

#: Seconds between a dash-agent's announcements of what it holds.
ANNOUNCE_PERIOD = 2.0
#: Seconds dash-memd keeps a node's announcement: a node silent for this long holds nothing any more.
HOLDINGS_TTL = 5 * ANNOUNCE_PERIOD
#: Shards one node's announcement lists at most (its own ranks' and copies of other nodes', two steps each).
MAX_HELD = 1024
#: Members a reply lists at most.
MAX_MEMBERS = 1024
_HOST = re.compile(r"[A-Za-z0-9.:_%-]{1,255}")


def field_domain(body: Mapping[str, Any], name: str = "domain") -> FailureDomain | None:
    """A failure domain as a peer sent it: None (not known), or one :class:`FailureDomain` checks."""
    raw = body.get(name)
    return None if raw is None else FailureDomain.from_body(raw)


def field_node(body: Mapping[str, Any], name: str = "node") -> str:
    value = body.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 255 or not value.isprintable():
        raise ProtocolError(f"field '{name}' must be printable text of 1 to 255 characters")
    return value


@dataclasses.dataclass(frozen=True)
class HeldShard:
    """A shard a node holds: ``shard`` (its header, with its CRC-32C), saved by a rank of node ``owner``;
    ``committed``: the holder knows its step is committed."""

    shard: ShardHeader
    owner: str
    committed: bool = False

    def to_body(self) -> dict[str, Any]:
        return {"shard": self.shard.to_body(), "owner": self.owner, "committed": self.committed}

    @classmethod
    def from_body(cls, body: Any) -> HeldShard:
        if not isinstance(body, dict) or not isinstance(body.get("shard"), dict):
            raise ProtocolError("a held shard must be an object with a 'shard'")
        return cls(ShardHeader.from_body(body["shard"]), field_node(body, "owner"),
                   field_bool(body, "committed", default=False))


@dataclasses.dataclass(frozen=True)
class Holdings:
    """One node's announcement: where its agent listens for peers (``port`` 0: nowhere), its failure domain,
    the copies it keeps of its own shards for other nodes (``replicas``), and what it holds."""

    job: str
    node: str
    host: str
    port: int
    replicas: int = 0
    domain: FailureDomain | None = None
    shards: tuple[HeldShard, ...] = ()

    def to_body(self) -> dict[str, Any]:
        return {"job": self.job, "node": self.node, "host": self.host, "port": self.port, "replicas": self.replicas,
                "domain": self.domain.to_body() if self.domain else None,
                "shards": [held.to_body() for held in self.shards]}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Holdings:
        raw = body.get("shards", [])
        if not isinstance(raw, list) or len(raw) > MAX_HELD:
            raise ProtocolError(f"field 'shards' must list at most {MAX_HELD} shards")
        job = field_job(body)
        shards = tuple(HeldShard.from_body(held) for held in raw)
        if any(held.shard.job != job for held in shards):
            raise ProtocolError("a node announces shards of its own job only")
        return cls(job=job, node=field_node(body), host=field_str(body, "host", 255, _HOST),
                   port=field_int(body, "port", 0, 65535), replicas=field_int(body, "replicas", 0, MAX_WORLD),
                   domain=field_domain(body), shards=shards)


@dataclasses.dataclass(frozen=True, order=True)
class Holder:
    """A node that holds a shard, and where its agent is reached."""

    node: str
    host: str
    port: int

    def to_body(self) -> list[Any]:
        return [self.node, self.host, self.port]

    @classmethod
    def from_body(cls, raw: Any) -> Holder:
        if not isinstance(raw, list) or len(raw) != 3:
            raise ProtocolError("a holder is [node, host, port]")
        body = dict(zip(("node", "host", "port"), raw))
        return cls(field_node(body), field_str(body, "host", 255, _HOST), field_int(body, "port", 1, 65535))


@dataclasses.dataclass(frozen=True)
class Member:
    """Another node of the job, as an announcement's reply lists it: where its agent listens, its failure
    domain (None: not known)."""

    node: str
    host: str
    port: int
    domain: FailureDomain | None = None

    def to_body(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "port": self.port,
                "domain": self.domain.to_body() if self.domain else None}

    @classmethod
    def from_body(cls, body: Any) -> Member:
        if not isinstance(body, dict):
            raise ProtocolError("a member must be an object")
        return cls(field_node(body), field_str(body, "host", 255, _HOST), field_int(body, "port", 0, 65535),
                   field_domain(body))


@dataclasses.dataclass(frozen=True)
class NodeView:
    """A node's holdings as ``dashrun status`` shows them: its failure domain, the copies it keeps of its own
    shards elsewhere (``replicas``), and for each step it holds, whose shards (node names); where its agent
    listens for the job's other nodes (``port`` 0: nowhere), which read its data set cache there."""

    node: str
    domain: FailureDomain | None
    replicas: int
    steps: dict[int, list[str]]
    host: str = ""
    port: int = 0

    @classmethod
    def from_body(cls, body: Any) -> NodeView:
        if not isinstance(body, dict) or not isinstance(body.get("steps"), dict) or len(body["steps"]) > MAX_HELD:
            raise ProtocolError("a node's holdings must be an object with its 'steps'")
        steps = {}
        for step, owners in body["steps"].items():
            if not isinstance(step, str) or not step.isdigit() or len(step) > 16 or not isinstance(owners, list) \
                    or len(owners) > MAX_MEMBERS:
                raise ProtocolError("a node's holdings list, per step, the nodes whose shards it holds")
            steps[int(step)] = [field_node({"owner": owner}, "owner") for owner in owners]
        host = field_str(body, "host", 255, _HOST) if body.get("host") else ""
        return cls(field_node(body), field_domain(body), field_int(body, "replicas", 0, MAX_WORLD), steps, host,
                   field_int(body, "port", 0, 65535) if host else 0)


@dataclasses.dataclass(frozen=True)
class Located:
    """A committed checkpoint and where it is: the nodes holding each saved rank's shard in their own RAM, and
    whether dash-memd holds it whole (False: committed on the fleet, held by R+1 nodes, not by dash-memd yet)."""

    info: CheckpointInfo
    holders: dict[int, list[Holder]]
    in_memd: bool = True


@dataclasses.dataclass(frozen=True)
class Announced:
    """dash-memd's answer to an announcement: the job's other members, and its newest committed step."""

    members: list[Member]
    committed: int | None


def holders_to_body(holders: Mapping[int, list[Holder]]) -> dict[str, list[list[Any]]]:
    return {str(rank): [h.to_body() for h in found] for rank, found in holders.items() if found}


def holders_from_body(raw: Any, world: int) -> dict[int, list[Holder]]:
    """The holders of a checkpoint of ``world`` saved ranks, as a LATEST reply names them (``{rank: [holder]}``)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > world:
        raise ProtocolError("field 'holders' must map saved ranks to their holders")
    holders = {}
    for key, found in raw.items():
        if not isinstance(key, str) or not key.isdigit() or not 0 <= int(key) < world:
            raise ProtocolError(f"holders of rank {key!r}, of a checkpoint saved by {world}")
        if not isinstance(found, list) or len(found) > MAX_MEMBERS:
            raise ProtocolError(f"at most {MAX_MEMBERS} holders of a shard")
        holders[int(key)] = [Holder.from_body(h) for h in found]
    return holders
