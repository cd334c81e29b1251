"""Elastic jobs: the same command on every Spot node, a membership change as a checkpoint boundary.

With ``--memd``, ``--nnodes MIN:MAX`` (MAX > 1) and no ``--rdzv-endpoint``,
every node runs the identical command and none is special: the rendezvous
lives in dash-memd (:mod:`dashrun.launch.rendezvous`), so losing any node,
the first one included, never loses the job.

:class:`DashElasticAgent` is torch's ``LocalElasticAgent`` with dashrun's
rules for a changing fleet, all of them at a checkpoint boundary:

- Ranks that end with ``ExitCode.WORLD_CHANGE`` — their checkpoint committed
  because another node goes away (its notice) or one joins — are started
  again at the new world size; this never uses up ``--max-restarts``.
- A node waiting to join is admitted after a checkpoint: the ranks are asked
  through dash-agent (RESHAPE) to take one and end, rather than being stopped
  mid-step as torch's agent does.
- A member that stops heartbeating (killed, cut off) ends the world: the
  ranks are stopped and started again from the newest committed checkpoint.
  Ranks that failed because a member died do not count as failures either.
- A node whose own notice stopped its ranks leaves the rendezvous without
  closing it for the others, and without torch's exit barrier (300 s, past
  GCP's 30 s notice).

Each change is one line on the console and an event on the job in dash-memd
(``dashrun status JOB``). dash-memd fences shards by the world's generation
(the rendezvous round): a node cut off from the others cannot commit into
the new world.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections import Counter
from typing import Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from dashrun import env
from dashrun.errors import DashError, ExitCode
from dashrun.launch.options import LaunchOptions
from dashrun.launch.rendezvous import DashRendezvousHandler, MemdConnection, MemdStore, create_handler
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.messages import MembershipEvent
from dashrun.wire.protocol import Kind

__all__ = ["DashElasticAgent", "launch"]

log = logging.getLogger(__name__)

#: Seconds between looks at the rendezvous for members gone or nodes waiting, while the ranks run.
MEMBERSHIP_POLL = 1.0
#: After the ranks failed, a member whose heartbeat is this many intervals old is taken as gone: the world is
#: broken anyway, and a live member wrongly taken as gone only joins the next round from the wait list.
LATE_HEARTBEATS = 1.5
#: Seconds between looks for a late member once the ranks failed (every look is one read of the rendezvous).
LATE_POLL = 0.1
#: Membership events the ranks are given (``Checkpointer.membership["history"]``), newest last.
HISTORY_FOR_RANKS = 100
#: Seconds the ranks get to reach a checkpoint when a node waits to join; then they are restarted as torch does.
GROW_TIMEOUT = 120.0


@dataclasses.dataclass
class _World:
    """What this node knew of the world it last joined."""

    generation: int
    nodes: tuple[str, ...]


class DashElasticAgent(LocalElasticAgent):
    """torch's local elastic agent, with membership changes as checkpoint boundaries (see the module's doc)."""

    def __init__(self, *args, options: LaunchOptions, agent_socket: str, preempted: Callable[[], bool], **kwargs):
        super().__init__(*args, **kwargs)
        self.options = options
        self.agent_socket = agent_socket
        self.preempted = preempted  # whether this node's own notice stopped its ranks
        self.left = False           # this node left the job (its notice), the others go on
        self._world: _World | None = None
        self._memd = MemdConnection(options, timeout=30)

    # --- rounds -----------------------------------------------------------------------

    def _rendezvous(self, worker_group) -> None:
        super()._rendezvous(worker_group)
        handler: DashRendezvousHandler = worker_group.spec.rdzv_handler
        nodes = tuple(node.addr for node, _ in sorted(handler.members.items(), key=lambda item: item[1]))
        before, self._world = self._world, _World(handler.round, nodes)
        me = handler.this_node.addr  # a node is named by its address (a host name by default)
        try:
            self._memd.call(lambda c: c.set_generation(self.options.job_id, handler.round))
        except DashError as e:
            log.warning("could not tell dash-memd the world's generation (%s): a node cut off from this world could "
                        "still commit into it", e)
        self._announce(before, self._world, me)
        history = self._membership()  # with this round's events
        # What the ranks about to start see (their environment is this process's, taken at their start).
        os.environ[env.ELASTIC.name] = "1"
        os.environ[env.GENERATION.name] = str(handler.round)
        os.environ[env.MEMBERSHIP.name] = json.dumps({
            "node": me, "nodes": list(nodes), "generation": handler.round,
            "history": [event.to_body() for event in history[-HISTORY_FOR_RANKS:]]})

    def _announce(self, before: _World | None, now: _World, me: str) -> None:
        """One console line per change; each event goes to dash-memd from one node."""
        step = self._committed_step()
        if before is None:
            self._record(MembershipEvent(time.time(), me, "joined", "started", len(now.nodes), now.generation, step,
                                         None))
            return
        # As multisets: two nodes may share a name (a host name by default), and one of them leaving is a change.
        gone = list((Counter(before.nodes) - Counter(now.nodes)).elements())
        came = list((Counter(now.nodes) - Counter(before.nodes)).elements())
        if not gone and not came:
            return  # the same nodes again (the ranks failed and were restarted): no change to tell
        left = self._left_by_notice(before.generation)
        why = ", ".join([f"{n} {'noticed' if n in left else 'lost'}" for n in gone] + [f"{n} joined" for n in came])
        at = f"step {step} committed" if step is not None else "no step committed yet"
        print(f"dashrun: world {len(before.nodes)} -> {len(now.nodes)}: {why}, {at}, continuing", file=sys.stderr,
              flush=True)
        survivors = list((Counter(now.nodes) & Counter(before.nodes)).elements())
        if survivors and survivors[0] == me:  # one node records what the survivors saw
            for node in gone:
                if node not in left:
                    self._record(MembershipEvent(time.time(), node, "died", "stopped heartbeating", len(now.nodes),
                                                 now.generation, step, None))

    def _membership(self) -> list[MembershipEvent]:
        """The job's membership history in dash-memd, oldest first (empty when it cannot be read now)."""
        try:
            return self._memd.call(lambda c: c.membership(self.options.job_id))
        except DashError:
            return []

    def _left_by_notice(self, generation: int) -> set[str]:
        return {e.node for e in self._membership() if e.change == "left" and e.generation == generation}

    def _committed_step(self) -> int | None:
        try:
            newest = self._memd.call(lambda c: c.latest(self.options.job_id))
        except DashError:
            return None
        return newest.step if newest is not None else None

    def _record(self, event: MembershipEvent) -> None:
        try:
            self._memd.call(lambda c: c.record_membership(self.options.job_id, event))
        except DashError as e:
            log.warning("could not record the membership change in dash-memd: %s", e)

    # --- the run ------------------------------------------------------------------------

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        handler: DashRendezvousHandler = spec.rdzv_handler
        self._initialize_workers(self._worker_group)
        next_look = time.monotonic() + MEMBERSHIP_POLL
        grow_asked_at: float | None = None
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(self._worker_group)
            state = self._worker_group.state = result.state
            if state == WorkerState.SUCCEEDED:
                if self.preempted():
                    self._leave(handler)
                    return result
                self._exit_barrier()
                return result
            if state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                if self.preempted():  # the notice's deadline came first: the launcher stopped the ranks
                    self._leave(handler)
                    return result
                if _all_exited_with(result, ExitCode.WORLD_CHANGE) or self._member_lost(handler, wait=True):
                    self._restart_workers(self._worker_group)  # a membership change: not one of --max-restarts
                    grow_asked_at = None
                    continue
                if self._remaining_restarts > 0:
                    log.info("worker group %s; %d/%d restarts left", state.name, self._remaining_restarts,
                             spec.max_restarts)
                    self._remaining_restarts -= 1
                    self._restart_workers(self._worker_group)
                    continue
                self._stop_workers(self._worker_group)
                self._worker_group.state = WorkerState.FAILED
                return result
            if state != WorkerState.HEALTHY:
                raise RuntimeError(f"[{role}] worker group in {state.name} state")
            if time.monotonic() < next_look:
                continue
            next_look = time.monotonic() + MEMBERSHIP_POLL
            if self._member_lost(handler, wait=False):
                log.warning("a node of the job stopped heartbeating: restarting the ranks at the new world size "
                            "from the newest committed checkpoint")
                self._restart_workers(self._worker_group)
                grow_asked_at = None
            elif self._nodes_waiting(handler) > 0:
                if grow_asked_at is None:
                    grow_asked_at = time.monotonic()
                    self._ask_for_boundary(handler.round)
                elif time.monotonic() - grow_asked_at > GROW_TIMEOUT:
                    log.warning("the ranks reached no checkpoint within %.0fs of a node asking to join: restarting "
                                "them now, from the newest committed checkpoint", GROW_TIMEOUT)
                    self._restart_workers(self._worker_group)
                    grow_asked_at = None

    def _member_lost(self, handler: DashRendezvousHandler, wait: bool) -> bool:
        """Whether a member of this world is gone. ``wait``: the ranks failed, perhaps because a member was
        killed; its heartbeat lapses only after a few seconds, so look until then before calling it a failure."""
        interval = handler.settings.keep_alive_interval
        lapse = interval.total_seconds() * (handler.settings.keep_alive_max_attempt + 1)
        deadline = time.monotonic() + (lapse if wait else 0.0)
        while True:
            try:
                if handler.departed():
                    return True
                # The ranks failed: a member that has missed a heartbeat or two is the likely cause. Waiting
                # for it to miss all of them would only delay the new world.
                if wait and handler.evict_late(interval * LATE_HEARTBEATS):
                    return True
            except Exception as e:  # dash-memd unreachable: no verdict now
                log.warning("could not read the rendezvous: %s", e)
            if time.monotonic() >= deadline:
                return False
            time.sleep(LATE_POLL)

    @staticmethod
    def _nodes_waiting(handler: DashRendezvousHandler) -> int:
        try:
            return handler.num_nodes_waiting()
        except Exception as e:  # dash-memd unreachable for now: training goes on, the next look may tell
            log.warning("could not read the rendezvous: %s", e)
            return 0

    def _ask_for_boundary(self, generation: int) -> None:
        """A node waits to join: ask this node's ranks (through dash-agent) to checkpoint and end."""
        link = AgentLink(self.agent_socket)
        try:
            link.call(Kind.RESHAPE, {"generation": generation}, timeout=10)
            log.info("a node waits to join: the ranks checkpoint, then the world grows")
        except DashError as e:
            log.warning("could not ask the ranks for a checkpoint before the world grows (%s)", e)
        finally:
            link.close()

    def _leave(self, handler: DashRendezvousHandler) -> None:
        """This node's notice ended its ranks: record it and leave, the others go on."""
        step = self._committed_step()
        world = self._world
        me = handler.this_node.addr
        if world is not None:
            self._record(MembershipEvent(time.time(), me, "left", "interruption notice", len(world.nodes) - 1,
                                         world.generation, step, 0))
        handler.leave()
        self.left = True


def _all_exited_with(result: RunResult, code: int) -> bool:
    return bool(result.failures) and all(f.exitcode == code for f in result.failures.values())


def launch(launch_config, entrypoint, args: tuple, options: LaunchOptions, agent_socket: str,
           preempted: Callable[[], bool]) -> DashElasticAgent:
    """torch's ``launch_agent`` for a job whose rendezvous dash-memd serves, with :class:`DashElasticAgent`.

    Unlike torch's, it closes the rendezvous only when the job is done: a
    node that leaves (its notice) or fails leaves only itself, and the job's
    rendezvous stays open for the nodes that go on and for a relaunch. Raises
    torch's ``ChildFailedError`` when the ranks failed for good, as
    ``elastic_launch`` does; returns the agent (``left``: this node's notice
    ended it).
    """
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    params = RendezvousParameters(backend=launch_config.rdzv_backend, endpoint=launch_config.rdzv_endpoint,
                                  run_id=launch_config.run_id, min_nodes=launch_config.min_nodes,
                                  max_nodes=launch_config.max_nodes, local_addr=launch_config.local_addr,
                                  **launch_config.rdzv_configs)
    handler = create_handler(options, params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = launch_config.signals_to_handle
    spec = WorkerSpec(role=launch_config.role, local_world_size=launch_config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=handler, max_restarts=launch_config.max_restarts,
                      monitor_interval=launch_config.monitor_interval, master_addr=None, master_port=None,
                      local_addr=launch_config.local_addr, numa_options=launch_config.numa_options,
                      duplicate_stdout_filters=launch_config.duplicate_stdout_filters,
                      duplicate_stderr_filters=launch_config.duplicate_stderr_filters,
                      virtual_local_rank=launch_config.virtual_local_rank)
    agent = DashElasticAgent(spec=spec, logs_specs=launch_config.logs_specs, start_method=launch_config.start_method,
                             log_line_prefix_template=launch_config.log_line_prefix_template,
                             shutdown_timeout=launch_config.shutdown_timeout,
                             options=options, agent_socket=agent_socket, preempted=preempted)
    try:
        try:
            result = agent.run()  # None: torch's graceful exit from a closed rendezvous
        except RendezvousClosedError:
            result = None
        if result is None:
            print(f"dashrun: job {options.job_id} has finished (its rendezvous in dash-memd is closed): nothing to "
                  "join; --fresh or another --job-id trains it again", file=sys.stderr)
            return agent
        if result.is_failed() and not agent.left:
            name = entrypoint if isinstance(entrypoint, str) else getattr(entrypoint, "__qualname__", "entrypoint")
            raise ChildFailedError(name=os.path.basename(name), failures=result.failures)
        if not agent.left:
            handler.shutdown()  # the job is done: a node that arrives now is told so instead of waiting for peers
        return agent
    finally:
        handler._stop_heartbeats()
        if isinstance(handler._store, MemdStore):
            handler._store.close()
