"""Where a job's newest steps are held, as ``dashrun status JOB`` prints it: dash-memd's tiers, the nodes' RAM.

From the job's listing in dash-memd and the nodes' newest announcements of
what they hold (:mod:`dashrun.memd.fleet.holdings`); see docs/replicas.md.
"""

from __future__ import annotations

from dashrun.wire.domain import FailureDomain
from dashrun.wire.holdings import NodeView

__all__ = ["holdings_lines"]


def _domain_text(domain: FailureDomain | None) -> str:
    return domain.label if domain is not None and domain.known else "domain unknown"


def holdings_lines(job: str, entry: dict, held: list[NodeView]) -> list[str]:
    """Where the job's newest steps are held: dash-memd's tiers and the nodes' own RAM (docs/replicas.md), then
    each node's failure domain and whose shards it keeps copies of."""
    if not held:
        return []
    tiers = {c["step"]: c.get("tiers", []) for c in entry.get("checkpoints", []) if isinstance(c, dict)}
    steps = sorted({step for node in held for step in node.steps} | set(tiers), reverse=True)[:3]
    lines = [f"{job}: where its newest steps are held:"]
    for step in steps:
        holders = [node.node for node in held if step in node.steps]
        places = ([f"dash-memd ({', '.join(tiers[step])})"] if tiers.get(step) else []) + holders
        lines.append(f"  step {step}: {', '.join(places) or 'nowhere yet'}")
    lines.append(f"{job}: nodes, their failure domains, and whose shards they hold:")
    for node in held:
        newest = max(node.steps, default=None)
        owners = node.steps.get(newest, []) if newest is not None else []
        whose = ", ".join("its own" if owner == node.node else f"{owner}'s" for owner in owners) or "nothing"
        lines.append(f"  {node.node}  {_domain_text(node.domain)}  replicas {node.replicas}  holds {whose}"
                     + (f" (step {newest})" if newest is not None else ""))
    return lines
