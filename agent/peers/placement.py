"""Which nodes hold the replicas of a node's snapshot: :func:`choose_holders`, a pure function.

Spot nodes of one zone and pool are often reclaimed together, so a node's
replicas go, in this order of preference, to nodes of

1. another zone *and* another pool,
2. another zone or another pool,
3. its own failure domain (or one not known to differ: an unknown zone or
   pool never counts as another one).

Within each class the candidates are taken in a ring order that spreads the
load: every node computes the same ordering of all members (by failure
domain, then name), and a node at position ``p`` of it starts in each
class's list at position ``p`` (modulo its length). In one failure domain
that is plain ring order, the ``count`` nodes after ``me``, and every node
holds the replicas of exactly ``count`` others; with balanced zones it is
exact too. Plain ring order by name alone would not be: with names grouped
by zone (``a-1 .. a-4``, ``b-1 .. b-4``) every node of zone a would pick b-1
first.

Deterministic: the same members give the same holders on every node, in any
order of ``members``. Nothing here does I/O or imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dashrun.wire.domain import FailureDomain

__all__ = ["Member", "choose_holders"]


@dataclasses.dataclass(frozen=True)
class Member:
    """A node of the job and its failure domain (the unknown domain where it has none)."""

    node: str
    domain: FailureDomain = FailureDomain()


def _differ(a: str, b: str) -> bool:
    """Whether two zones (or pools) are known to be different: an unknown one ("") differs from none."""
    return bool(a) and bool(b) and a != b


def _preference(me: FailureDomain, other: FailureDomain) -> int:
    """0: another zone and another pool; 1: another zone or another pool; 2: the same (or not known to differ)."""
    zone, pool = _differ(me.zone, other.zone), _differ(me.pool, other.pool)
    return 0 if zone and pool else 1 if zone or pool else 2


def _order(member: Member) -> tuple[str, str, str]:
    return member.domain.zone, member.domain.pool, member.node


def choose_holders(me: str, members: Sequence[Member], count: int) -> list[str]:
    """The ``count`` nodes (fewer where there are fewer others) that hold replicas of ``me``'s snapshot, most
    preferred first; never ``me``. ``me`` missing from ``members`` stands in the unknown domain.

    ValueError for a negative ``count`` or a node named twice in ``members``.
    """
    if count < 0:
        raise ValueError(f"count must be 0 or more, not {count}")
    names = [m.node for m in members]
    if len(set(names)) != len(names):
        raise ValueError("members name a node twice")
    own = next((m for m in members if m.node == me), None)
    if own is None:
        own = Member(me)
        members = [*members, own]
    ordered = sorted(members, key=_order)
    position = ordered.index(own)
    classes: list[list[Member]] = [[], [], []]
    for member in ordered:
        if member.node != me:
            classes[_preference(own.domain, member.domain)].append(member)
    holders: list[str] = []
    for candidates in classes:
        if len(holders) >= count:
            break
        start = position % len(candidates) if candidates else 0
        ring = candidates[start:] + candidates[:start]
        holders.extend(m.node for m in ring[:count - len(holders)])
    return holders
