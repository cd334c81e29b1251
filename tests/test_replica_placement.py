"""Where a node's replicas go (agent/peers/placement.py): never to itself, to other zones and pools first, and
spread so that every node holds about as many replicas as it sends (exactly so in one domain)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dashrun.agent.peers.placement import Member, choose_holders
from dashrun.wire.domain import FailureDomain

ZONES = ["", "us-east-1a", "us-east-1b", "us-west-2a"]
POOLS = ["", "g5.12xlarge:spot", "g5.12xlarge:on-demand", "p4d.24xlarge:spot"]


@st.composite
def domains(draw) -> FailureDomain:
    zone = draw(st.sampled_from(ZONES))
    return FailureDomain(zone, draw(st.sampled_from(POOLS)) if zone else "")


@st.composite
def fleets(draw) -> tuple[list[Member], str, int]:
    """Members (shuffled), one of them as ``me``, and a count that may exceed the others."""
    names = draw(st.lists(st.text("abcxyz0123-", min_size=1, max_size=6), min_size=1, max_size=12, unique=True))
    members = [Member(name, draw(domains())) for name in names]
    members = draw(st.permutations(members))
    return members, draw(st.sampled_from(names)), draw(st.integers(0, len(names) + 1))


def preference(me: FailureDomain, other: FailureDomain) -> int:
    """The class the docstring promises: 0 another zone and pool, 1 another zone or pool, 2 neither (known)."""
    zone = bool(me.zone and other.zone and me.zone != other.zone)
    pool = bool(me.pool and other.pool and me.pool != other.pool)
    return 0 if zone and pool else 1 if zone or pool else 2


def chosen_by(members: list[Member], count: int) -> collections.Counter:
    """How many nodes choose each node as a holder."""
    load: collections.Counter = collections.Counter()
    for member in members:
        load.update(choose_holders(member.node, members, count))
    return load


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_holders_are_distinct_others_as_many_as_asked_or_there_are(fleet):
    members, me, count = fleet
    holders = choose_holders(me, members, count)
    assert me not in holders
    assert len(set(holders)) == len(holders)
    assert set(holders) <= {m.node for m in members}
    assert len(holders) == min(count, len(members) - 1)


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_a_less_preferred_holder_only_once_every_better_one_is_taken(fleet):
    members, me, count = fleet
    domain = {m.node: m.domain for m in members}
    holders = choose_holders(me, members, count)
    ranks = [preference(domain[me], domain[h]) for h in holders]
    assert ranks == sorted(ranks), "holders come most preferred first"
    if holders:
        worst = ranks[-1]
        passed_over = [m.node for m in members if m.node != me and m.node not in holders]
        assert all(preference(domain[me], domain[n]) >= worst for n in passed_over)


@settings(max_examples=100, deadline=None)
@given(fleets())
def test_the_same_members_in_any_order_give_the_same_holders(fleet):
    members, me, count = fleet
    assert choose_holders(me, members, count) == choose_holders(me, list(reversed(members)), count)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.data())
def test_in_one_domain_every_node_is_chosen_by_exactly_count_others(n, data):
    domain = data.draw(domains())
    members = [Member(f"node-{i:02d}", domain) for i in range(n)]
    count = data.draw(st.integers(0, n - 1))
    load = chosen_by(members, count)
    assert all(load[m.node] == count for m in members), load
    # plain ring order there: the next nodes by name
    assert choose_holders("node-00", members, count) == [f"node-{i:02d}" for i in range(1, count + 1)]


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.booleans(), st.data())
def test_balanced_zones_spread_exactly_whatever_the_names(zones, per_zone, one_pool, data):
    # names grouped by zone (a-0 .. a-3, b-0 ..) would all pick the same first node in ring order by name
    members = [Member(f"{'abcd'[z]}-{j}", FailureDomain(f"zone-{z}", "pool" if one_pool else f"pool-{z}"))
               for z in range(zones) for j in range(per_zone)]
    count = data.draw(st.integers(0, (zones - 1) * per_zone))
    load = chosen_by(members, count)
    assert all(load[m.node] == count for m in members), load
    for member in members:  # all in other zones
        assert all(h[0] != member.node[0] for h in choose_holders(member.node, members, count))


def test_another_zone_and_pool_first_then_either_then_the_same():
    members = [Member("me", FailureDomain("z1", "spot-a")), Member("same", FailureDomain("z1", "spot-a")),
               Member("pool", FailureDomain("z1", "spot-b")), Member("zone", FailureDomain("z2", "spot-a")),
               Member("both", FailureDomain("z2", "spot-b"))]
    holders = choose_holders("me", members, 4)
    assert holders[0] == "both" and set(holders[1:3]) == {"pool", "zone"} and holders[3] == "same"
    assert choose_holders("me", members, 1) == ["both"]


def test_unknown_domains_never_count_as_another():
    members = [Member("me", FailureDomain("z1", "p1")), Member("unknown"), Member("zone-only", FailureDomain("z2")),
               Member("other", FailureDomain("z2", "p2"))]
    assert choose_holders("me", members, 3) == ["other", "zone-only", "unknown"]


def test_me_missing_from_the_members_stands_in_the_unknown_domain():
    members = [Member("a", FailureDomain("z1")), Member("b", FailureDomain("z2"))]
    assert sorted(choose_holders("me", members, 5)) == ["a", "b"]
    assert choose_holders("a", [Member("a")], 1) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        choose_holders("a", [Member("a"), Member("b")], -1)
    with pytest.raises(ValueError):
        choose_holders("a", [Member("a"), Member("b"), Member("b", FailureDomain("z"))], 1)
