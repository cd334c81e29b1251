"""Where a node stands, as far as losing it together with others goes (:class:`FailureDomain`): its zone, its
pool (instance type and market), as dash-agent reads them from the cloud or ``--failure-domain``,
``--instance-type`` and ``--market`` name them. Pure: every field a peer sent is checked, bounded.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol

from dashrun.errors import ProtocolError, UsageError
from dashrun.wire.protocol import field_str

__all__ = ["MARKETS", "MAX_DOMAIN_LABEL", "MAX_DOMAIN_PART", "FailureDomain", "parse_instance_type"]

#: The markets a VM is bought in: Spot (the cloud takes it back when it wants the capacity) or on-demand.
MARKETS = ("spot", "on-demand")
#: Longest zone or pool of a failure domain, and so the longest label ("ZONE/POOL").
MAX_DOMAIN_PART = 127
MAX_DOMAIN_LABEL = 2 * MAX_DOMAIN_PART + 1
#: A zone or a pool: how the clouds spell zones, regions and instance types (us-east-1a, a2-highgpu-1g,
#: Standard_NC24ads_A100_v4), and the ``:`` that joins an instance type to its market. No ``/`` (it separates
#: zone and pool) and no blanks, so a label is one word on a command line and in ``dashrun status``.
_DOMAIN_PART = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:+@-]{{0,{MAX_DOMAIN_PART - 1}}}")
_DOMAIN_HINT = ("ZONE or ZONE/POOL, e.g. us-east-1a or us-east-1a/g5.12xlarge:spot; each part at most "
                f"{MAX_DOMAIN_PART} of A-Z a-z 0-9 . _ : + @ -, starting with a letter or digit")


class _Placed(Protocol):
    """What :meth:`FailureDomain.of` reads from a VM's identity (``dashrun.agent.identity.Identity``)."""

    zone: str
    instance_type: str
    market: str


@dataclasses.dataclass(frozen=True)
class FailureDomain:
    """Where a node stands, as far as losing it together with others goes: its zone and its pool.

    Spot VMs of one instance type in one zone (AWS calls it a Spot capacity
    pool) are reclaimed together when the cloud wants that capacity back, and a
    zone goes down whole, so replicas of a node's state go to nodes of another
    zone and pool first (``dashrun.agent.peers.placement``).

    ``zone``: the cloud's zone (us-east-1a, us-central1-a; Azure's
    LOCATION-ZONE, eastus-1, or the location where the VM has no zone).
    ``pool``: ``INSTANCE_TYPE:MARKET`` from the metadata service or ``--instance-type``/``--market``
    (:meth:`of`: g5.12xlarge:spot; an on-demand VM of the same type is another
    pool, since it is not reclaimed with the Spot ones), or any word
    ``--failure-domain`` gives (:meth:`parse`). ``market``: spot, on-demand, or
    "" where not known (a label's pool that does not end in ``:spot`` or
    ``:on-demand``). An empty zone or pool is unknown, and an unknown part
    never counts as another one: placement prefers only what it knows to differ.
    """

    zone: str = ""
    pool: str = ""
    market: str = ""

    def __post_init__(self) -> None:
        for name in ("zone", "pool"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not _DOMAIN_PART.fullmatch(value)):
                raise ValueError(f"{name} {str(value)[:80]!r} is not {_DOMAIN_HINT}")
        if self.market not in ("", *MARKETS):
            raise ValueError(f"market must be one of {', '.join(MARKETS)} or empty, not {str(self.market)[:20]!r}")

    @property
    def known(self) -> bool:
        """Whether anything of it is known (a zone, a pool or a market: ``--instance-type`` alone gives a pool)."""
        return bool(self.zone or self.pool or self.market)

    @property
    def label(self) -> str:
        """``ZONE/POOL``, ``ZONE`` without a pool, "" when unknown (what ``--failure-domain`` takes); ``/POOL``."""
        return f"{self.zone}/{self.pool}" if self.pool else self.zone

    @classmethod
    def parse(cls, label: str, what: str = "--failure-domain") -> FailureDomain:
        """``ZONE`` or ``ZONE/POOL`` as given on a command line; UsageError (one line, a hint) otherwise."""
        if not isinstance(label, str) or len(label) > MAX_DOMAIN_LABEL or label.count("/") > 1:
            raise UsageError(f"{what} {str(label)[:80]!r} is not ZONE or ZONE/POOL", hint=_DOMAIN_HINT)
        zone, slash, pool = label.partition("/")
        market = next((m for m in MARKETS if pool.endswith(f":{m}")), "")
        try:
            if not zone or (slash and not pool):
                raise ValueError("a label names its zone, and its pool after a /")
            return cls(zone=zone, pool=pool, market=market)
        except ValueError:
            raise UsageError(f"{what} {label[:80]!r} is not ZONE or ZONE/POOL", hint=_DOMAIN_HINT) from None

    @classmethod
    def of(cls, identity: _Placed) -> FailureDomain:
        """The domain of a VM whose identity the metadata service gave: its zone, pool ``INSTANCE_TYPE:MARKET``."""
        return cls(zone=identity.zone, pool=f"{identity.instance_type}:{identity.market}", market=identity.market)

    def to_body(self) -> dict[str, Any]:
        return {"zone": self.zone, "pool": self.pool, "market": self.market}

    @classmethod
    def from_body(cls, body: dict) -> FailureDomain:
        if not isinstance(body, dict):
            raise ProtocolError("a failure domain must be an object")
        try:
            return cls(zone=field_str(body, "zone", MAX_DOMAIN_PART, default=""),
                       pool=field_str(body, "pool", MAX_DOMAIN_PART, default=""),
                       market=field_str(body, "market", 16, default=""))
        except ValueError as e:
            raise ProtocolError(f"malformed failure domain: {e}") from None


def parse_instance_type(text: str | None, what: str = "--instance-type") -> str | None:
    """An instance type as a user typed it (None: not given); UsageError (one line, a hint) unless it can be part
    of a pool (``INSTANCE_TYPE:MARKET``)."""
    if text is None:
        return None
    if len(text) > MAX_DOMAIN_PART - len(":on-demand") or not _DOMAIN_PART.fullmatch(text) or ":" in text:
        raise UsageError(f"{what} {text[:80]!r} is not an instance type",
                         hint="the cloud's name of it, e.g. g5.12xlarge, a2-highgpu-1g or Standard_NC24ads_A100_v4")
    return text
