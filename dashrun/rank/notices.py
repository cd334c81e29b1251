"""Interruption notices on the rank side: recorded as the agent pushes them, agreed on by every rank each step.

The node's dash-agent pushes a :class:`~dashrun.wire.messages.Notice` to its
ranks when the cloud announces that the VM goes away (or warns early); a
SIGTERM to a rank (a scheduler's, or its launcher passing one on) is a notice
of its own, with the launcher's grace as its deadline. Only the ranks of that
node hear it, yet every rank of the job must take the
emergency checkpoint of the same step: :meth:`NoticeBoard.agree`, called by
each ``save()``, all-reduces every rank's notice asynchronously and reads the
result of the previous step's all-reduce, so the ranks agree one step late
without waiting on the network. :class:`Agreement` says what to do about it.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dashrun.errors import DashError
from dashrun.wire.messages import Notice

__all__ = ["EMERGENCY_MARGIN", "EMERGENCY_TIMEOUT", "Agreement", "NoticeBoard", "in_process_group"]

log = logging.getLogger(__name__)

#: Seconds before a notice's deadline by which the emergency checkpoint must be committed, and how
#: long one waits for it when the deadline is unknown.
EMERGENCY_MARGIN = 2.0
EMERGENCY_TIMEOUT = 120.0
_NO_DEADLINE = 1e18
#: What each rank all-reduces (MAX): notice level, -deadline, starved, reshape.
_FLAG = struct.Struct("=4d")
#: How long close() waits for gloo's worker thread to let go of the last all-reduce's tensor.
RELEASE_TIMEOUT = 5.0
#: Seconds from SIGTERM until the launcher kills a rank, unless it says otherwise (``DASH_TERM_GRACE``): torchrun's
#: default ``--shutdown-timeout``.
TERM_GRACE = 30.0


def in_process_group() -> bool:
    """Whether torch.distributed is initialised, so the ranks can agree with collectives."""
    return dist.is_available() and dist.is_initialized()


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The most serious notice any rank of the job had (``level``: 0, Notice.EARLY or Notice.PREEMPT)."""

    level: int = 0
    deadline: float | None = None  # epoch seconds, when a notice that the node goes away gave one
    #: Some rank had both staging buffers still on their way to dash-memd: every rank skips a due snapshot,
    #: or one rank's skip would leave the others' shards of that step waiting for a shard that never comes.
    starved: bool = False
    #: Some rank's world ends at this checkpoint (a node joins the job): every rank checkpoints, then restarts.
    reshape: bool = False

    @property
    def emergency(self) -> bool:
        """A node of the job goes away: take the emergency checkpoint now, then stop."""
        return self.level >= Notice.PREEMPT

    @property
    def early(self) -> bool:
        """An early warning (or worse): checkpoint more often."""
        return self.level >= Notice.EARLY

    def commit_budget(self) -> float:
        """How long the emergency checkpoint may take to be committed: up to the deadline, less a margin."""
        budget = (self.deadline - time.time() - EMERGENCY_MARGIN) if self.deadline else EMERGENCY_TIMEOUT
        return max(1.0, budget)


class NoticeBoard:
    """The most serious notice this node's agent pushed, and the per-step agreement on it across ranks."""

    def __init__(self, world: int, early_interval: int, generation: int = 0, term_grace: float = TERM_GRACE):
        self.world = world
        self.early_interval = early_interval  # for the message: how often an early warning makes a rank save
        self.generation = generation          # this world's (DASH_GENERATION): a RESHAPE for an older one is stale
        self.term_grace = term_grace          # seconds from SIGTERM until this rank is killed (DASH_TERM_GRACE)
        self.notice: Notice | None = None     # the most serious notice this node's agent pushed
        self.reshape = False                  # the agent said this world ends at its next checkpoint
        self.signalled_at: float | None = None  # when SIGTERM reached this rank (epoch seconds)
        self._said_signal = False
        # What publish() all-reduces: one tensor over bytes it packs into (no numpy, which torch does not need).
        self._flag_bytes = bytearray(_FLAG.size)
        self._flag: torch.Tensor | None = torch.frombuffer(self._flag_bytes, dtype=torch.float64)
        self._flag_refs = sys.getrefcount(self._flag)  # while no collective holds it: see close()
        self._work = None                     # the all-reduce of every rank's notice, one step behind
        self._group = None

    def on_notice(self, body: dict[str, Any]) -> None:
        """From the agent's reader thread: record the notice; save() acts on it, on every rank at once."""
        try:
            notice = Notice.from_body(body)
        except DashError:
            return
        if not notice.outranks(self.notice):
            return
        self.notice = notice
        if notice.early_warning:
            log.warning("dashrun: %s early warning (%s): checkpointing every %d steps", notice.cloud, notice.kind.value,
                        self.early_interval)
        else:
            left = f"{notice.deadline - time.time():.0f}s" if notice.deadline else "an unknown time"
            log.warning("dashrun: %s %s notice: this node goes away in %s; checkpointing at the next step",
                        notice.cloud, notice.kind.value, left)

    def on_signal(self) -> None:
        """From the rank's SIGTERM handler, which may run between any two bytecodes of the training loop: only
        records (no lock, no logging); save() acts on it, on every rank at once. A second SIGTERM changes nothing."""
        if self.signalled_at is None:
            self.signalled_at = time.time()

    def signal_unsaid(self) -> bool:
        """Whether a SIGTERM was recorded and not yet said (once, by save(), outside the handler)."""
        if self.signalled_at is None or self._said_signal:
            return False
        self._said_signal = True
        return True

    def on_reshape(self, body: dict[str, Any]) -> None:
        """From the agent's reader thread: the world of a generation ends at the next checkpoint (a node joins)."""
        generation = body.get("generation")
        if isinstance(generation, int) and generation >= self.generation and not self.reshape:
            self.reshape = True
            log.warning("dashrun: a node joins the job: checkpointing at the next step, then restarting at the "
                        "new world size")

    @property
    def noticed_here(self) -> bool:
        """Whether this node itself goes away (its own interruption notice or SIGTERM), not only another node of
        the job."""
        return self.signalled_at is not None or (self.notice is not None and not self.notice.early_warning)

    def agree(self) -> Agreement:
        """What every rank published at its previous ``save()`` (:meth:`publish`) — the same on every rank.

        The all-reduce (MAX) of what each rank published runs on a gloo group
        between two ``save()`` calls, so the ranks agree without waiting on the
        network: every rank acts at the same step. Every rank must call
        :meth:`agree` at the start and :meth:`publish` at the end of every ``save()``.
        """
        if not self.shared:
            return self._local()
        if self._work is None:
            return Agreement()
        self._work.wait()
        self._work = None
        level, negated_deadline, starved, reshape = self._flag.tolist()
        return Agreement(int(level), -negated_deadline if negated_deadline > -_NO_DEADLINE else None, starved > 0,
                         reshape > 0)

    @property
    def shared(self) -> bool:
        """Whether there are other ranks to agree with (else :meth:`publish` has nothing to do)."""
        return self.world > 1 and in_process_group()

    def publish(self, starved: bool) -> None:
        """Start the all-reduce of this rank's notice and whether it has a staging buffer free (read by the next
        :meth:`agree`). Buffers only come free between two ``save()`` calls, so a rank that had one here still
        has it there."""
        if not self.shared:
            return
        if self._group is None:
            self._group = (dist.group.WORLD if dist.get_backend() == "gloo"
                           else dist.new_group(backend="gloo"))  # collective: every rank, first save()
        local = self._local()
        # The same tensor each time, free again: agree() waited for its last all-reduce at the start of save().
        _FLAG.pack_into(self._flag_bytes, 0, local.level, -(local.deadline or _NO_DEADLINE), starved,
                        local.reshape)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def _local(self) -> Agreement:
        """This rank's own notice: the agent's, or SIGTERM's, whose deadline is the launcher's grace."""
        notice = self.notice
        level = 0 if notice is None else notice.severity
        deadline = notice.deadline if notice is not None and not notice.early_warning and notice.deadline else None
        if self.signalled_at is not None:
            level = Notice.PREEMPT
            killed_at = self.signalled_at + self.term_grace
            deadline = killed_at if deadline is None else min(deadline, killed_at)
        return Agreement(level, deadline, reshape=self.reshape)

    def settle(self) -> None:
        """Wait for the all-reduce in flight: every rank started it; leave no collective half-done."""
        if self._work is not None:
            self._work.wait()

    def close(self) -> None:
        """Settle, then let go of the process group, the collective and its tensor, here, on the closing thread,
        once gloo's worker thread has let go of the tensor too.

        The agent link's reader thread holds this board (its notice callback) and
        may outlive the Checkpointer: the group must not be freed there. And a
        C++ holder of a tensor made in Python also holds its Python object:
        gloo's worker drops its hold on a finished all-reduce a moment after
        ``wait()`` returns, taking the GIL to do so. If that moment falls after
        the interpreter began to shut down (the script ending right after its
        last ``save()``), the worker thread is torn down inside a destructor and
        the rank aborts ("terminate called without an active exception"). Also
        run at exit for a script that never calls ``close()``.
        """
        if self._flag is None:
            return
        try:
            self.settle()
        finally:
            self._work = None
            deadline = time.monotonic() + RELEASE_TIMEOUT
            while sys.getrefcount(self._flag) > self._flag_refs and time.monotonic() < deadline:
                time.sleep(0.001)  # the GIL is free meanwhile: the worker can drop its hold
            self._flag = self._group = None

    def close_at_exit(self) -> None:
        """:meth:`close` from ``atexit`` (the interpreter still whole): a failed collective is not news then."""
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - a peer that left first; the process is ending anyway
            log.debug("dashrun: the notices' last all-reduce at exit: %s", e)
