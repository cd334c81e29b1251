"""Where this node's dash-agent and ranks run: ``--agent-cpus auto|none|LIST`` (env ``DASH_AGENT_CPUS``).

dash-agent encrypts and sends every checkpoint while the ranks train; on
the ranks' cores that work is added training time. So by default (``auto``)
the launcher keeps one physical core (all its SMT siblings) of the CPUs it
may use — the one with the highest CPU number, as taskset, numactl or a
cpuset left them — for dash-agent and its threads (and the private
dash-memd, when there is one), and starts the ranks on the rest, so that
torch and OpenMP size their thread pools to the cores they have. One core
more is kept for every :data:`CORES_PER_AGENT_CORE` cores allowed: a big
node's ranks hand over more bytes per checkpoint.

Nothing is placed where it cannot pay: a node with no more cores than
ranks, a launch with torch's ``--numa-binding`` (torch places the ranks
then), or an OS without CPU affinity (only Linux has it). ``none`` places
nothing (everything runs where the launcher may); a ``LIST`` (``0-3,7``)
puts dash-agent there and the ranks on the launcher's other CPUs.
"""

from __future__ import annotations

import dataclasses
import logging

from dashrun.errors import UsageError
from dashrun.util.cpus import allowed_cpus, format_cpus, parse_cpus, physical_cores

__all__ = ["AUTO", "CORES_PER_AGENT_CORE", "NONE", "AgentCpus", "Placement", "parse_agent_cpus", "plan"]

log = logging.getLogger(__name__)

AUTO, NONE = "auto", "none"
#: ``auto`` keeps one core for dash-agent, and one more for every this many cores allowed.
CORES_PER_AGENT_CORE = 32

#: What ``--agent-cpus`` says: AUTO, NONE, or the CPUs dash-agent gets.
AgentCpus = str | frozenset[int]


@dataclasses.dataclass(frozen=True)
class Placement:
    """CPUs for dash-agent and for the ranks (None: unpinned, where the launcher runs), and why."""

    agent: frozenset[int] | None = None
    ranks: frozenset[int] | None = None
    reason: str = "not placed"

    def __post_init__(self) -> None:
        if (self.agent is None) != (self.ranks is None) or (self.agent and self.agent & self.ranks):
            raise ValueError("dash-agent and the ranks are both placed, on disjoint CPUs, or neither is")

    @property
    def placed(self) -> bool:
        return self.agent is not None


def parse_agent_cpus(value: str | None) -> AgentCpus:
    """``auto`` (also for None or empty), ``none``, or a CPU list; UsageError for anything else."""
    value = (value or AUTO).strip().lower()
    if value in (AUTO, NONE):
        return value
    try:
        return parse_cpus(value)
    except ValueError as e:
        raise UsageError(f"--agent-cpus {value[:80]!r}: {e}",
                         hint="auto, none, or the CPUs for dash-agent as a list like 7 or 6-7 or 0,8") from None


def plan(spec: AgentCpus, nproc_per_node: int, *, numa_binding: bool = False,
         allowed: frozenset[int] | None = None, cores: list[frozenset[int]] | None = None) -> Placement:
    """The placement ``spec`` asks for, for ``nproc_per_node`` ranks on the CPUs this launcher may use.

    ``allowed`` and ``cores`` (the allowed CPUs grouped by physical core) are
    read from this machine unless given. UsageError if a LIST names a CPU the
    launcher may not use or leaves none for the ranks.
    """
    allowed = allowed_cpus() if allowed is None else allowed
    if spec == NONE:
        return _unplaced("--agent-cpus none")
    if allowed is None:
        if spec != AUTO:
            log.warning("--agent-cpus %s: CPU affinity is not supported on this system; nothing is placed",
                        format_cpus(spec))
        return _unplaced("CPU affinity is not supported on this system")
    if spec != AUTO:
        outside = spec - allowed
        if outside:
            raise UsageError(f"--agent-cpus names CPU {format_cpus(outside)}, which this launcher may not use",
                             hint=f"pick among its CPUs {format_cpus(allowed)} (as taskset/numactl/the cpuset allow)")
        if spec >= allowed:
            raise UsageError(f"--agent-cpus {format_cpus(spec)} leaves no CPU for the ranks",
                             hint=f"leave some of this launcher's CPUs {format_cpus(allowed)} to the ranks")
        return _placed(Placement(spec, allowed - spec, "--agent-cpus"))
    if numa_binding:
        return _unplaced("torch's --numa-binding places the ranks")
    cores = physical_cores(allowed) if cores is None else cores
    spare = len(cores) - nproc_per_node
    if spare < 1:
        return _unplaced(f"{nproc_per_node} rank(s) on {len(cores)} core(s) ({format_cpus(allowed)}): "
                         "no core to spare")
    kept = sorted(cores, key=max)[-min(spare, max(1, len(cores) // CORES_PER_AGENT_CORE)):]
    agent = frozenset().union(*kept)
    return _placed(Placement(agent, allowed - agent, f"auto: {len(kept)} of {len(cores)} cores"))


def _placed(placement: Placement) -> Placement:
    log.info("dash-agent on CPU %s, the ranks on CPU %s (%s)", format_cpus(placement.agent),
             format_cpus(placement.ranks), placement.reason)
    return placement


def _unplaced(reason: str) -> Placement:
    log.debug("dash-agent and the ranks are not placed: %s", reason)
    return Placement(reason=reason)
