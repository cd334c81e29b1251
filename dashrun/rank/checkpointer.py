"""The rank side of dashrun: snapshot without stalling, restore exactly.

``save(step)`` captures the state in two parts. What can change during the
next forward/backward — module buffers, RNG states, scheduler and data
cursor — is copied at once into a reused shared-memory buffer; it is small.
Parameters and optimizer state change only in ``optimizer.step()``, so their
copy runs on a background thread beside the next forward/backward (with
streaming stores where it can, see dashrun.rank.staging), and a pre-hook on every
optimizer's ``step()`` waits for it: the training step is blocked only if
the copy is slower than a forward/backward. On CUDA the buffer is pinned and
the copy runs on a side stream that the compute stream waits for on the GPU,
not on the CPU.

State that every rank holds alike (``model``, ``optimizer``, ``scheduler``
and other keywords, as with DDP) is *replicated*: its bytes are laid out
identically on every rank and rank r stages and sends only the r-th slice,
so it crosses the wire once. State listed in ``per_rank`` (default:
``data``) and the RNG states are *private*: every rank sends its own. On
restore the replicated state is rebuilt from all slices, whatever the new
world size; private state goes to the rank with the same number, and what
has no owner is reported.

Module buffers (BatchNorm statistics) differ between ranks after each
forward, so they are not split: they come from rank 0, the rank DDP
broadcasts them from (a module without DDP gets rank 0's too), unless the
model is a ``DistributedDataParallel`` with ``broadcast_buffers=False``:
then each rank saves its own and gets them back, and a rank that did not
exist when the checkpoint was saved gets rank 0's.

The buffer is handed to the node's dash-agent by file descriptor; the
agent streams it to dash-memd and hands it back once stored. Two buffers
alternate, so one save can be staged while the previous one travels. If
both are still busy when a save is due, that snapshot is skipped (and
counted), never waited for — unless ``force=True``.

This module is the facade a training script sees; it wires the parts:
:mod:`~dashrun.rank.snapshot` (what ``save()`` captures),
:mod:`~dashrun.rank.stager` (the buffers and the background copy),
:mod:`~dashrun.rank.restore` (loading through the agent) and
:mod:`~dashrun.rank.notices` (interruption notices, agreed on by every rank).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, NoReturn

import torch

from dashrun import env
from dashrun.errors import DashError, ExitCode, RestoreMismatchError, UsageError
from dashrun.rank import sharded
from dashrun.rank.notices import TERM_GRACE, Agreement, NoticeBoard, in_process_group
from dashrun.rank.restore import restore_state
from dashrun.rank.snapshot import SaveStats, Snapshot, capture
from dashrun.rank.stager import SAVE, Stager
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.console import JsonFormatter
from dashrun.util.problems import ProblemLog
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.agent_messages import WaitReply, WaitRequest
from dashrun.wire.history import Restored
from dashrun.wire.protocol import Kind

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)


def _job_wide(obj: Any) -> bool:
    from dashrun.data.sampler import ElasticSampler

    return isinstance(obj, ElasticSampler)


def _int_env(var: env.Var) -> int:
    value = env.get(var, "0")
    return int(value) if value.isdigit() else 0


def _float_env(var: env.Var, default: float) -> float:
    try:
        value = float(env.get(var, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _membership_from_env() -> dict[str, Any] | None:
    """The launcher's view of the job's membership (``DASH_MEMBERSHIP``); None when absent or unreadable."""
    text = env.get(env.MEMBERSHIP)
    if not text:
        return None
    try:
        value = loads_bounded(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _record_uncaught_errors() -> None:
    """What torchrun's ``@record`` does for a script that lacks it: an exception that ends the rank is written to
    the error file torch's elastic agent reads, so dashrun's last line names it (a restore that cannot map a
    tensor, say) rather than torch's placeholder. Once per process; the previous hook still prints it.

    A :class:`RestoreMismatchError` reaches the previous hook without its traceback and cause: a checkpoint
    that does not fit the script is the user's to fix, not a fault in code, and is printed as one line (torch's
    own size-mismatch error, its cause, ran to a line per parameter, on every rank)."""
    if getattr(sys.excepthook, "dashrun_records", False) or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if not os.path.exists(os.environ.get("TORCHELASTIC_ERROR_FILE", "")):  # @record may have written it
            with contextlib.suppress(Exception):
                get_error_handler().record_exception(value)
        if isinstance(value, RestoreMismatchError):
            value.__cause__, value.__suppress_context__ = None, True
            value, traceback = value.with_traceback(None), None
        previous(kind, value, traceback)

    hook.dashrun_records = True
    sys.excepthook = hook


def _show_logs_of_rank(rank: int) -> None:
    """Make dashrun's messages visible in a training script that configured no logging."""
    package = logging.getLogger("dashrun")
    if not logging.getLogger().handlers and not package.handlers:
        handler = logging.StreamHandler()
        if env.get(env.LOG_FORMAT) == "json":  # the launcher's --log-format: one object a line, job and rank in it
            handler.setFormatter(JsonFormatter("dashrun"))
        else:
            handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(message)s", "%H:%M:%S"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


class Checkpointer:
    """Checkpoint a training job to dash-memd, and bring it back.

    ``objects`` are the keyword arguments with ``state_dict()`` and
    ``load_state_dict()`` (model, optimizer, scheduler, data cursor, ...).
    Launched without dashrun (no ``DASH_AGENT_SOCKET``), it does nothing:
    ``restore()`` returns 0 and ``save()`` returns False.
    """

    def __init__(self, *, interval: int = 100, early_interval: int | None = None, per_rank: Iterable[str] = ("data",),
                 job_id: str | None = None, on_world_change: Callable[[int, int], None] | None = None,
                 **objects: Any):
        if interval < 1 or (early_interval is not None and early_interval < 1):
            raise UsageError("interval and early_interval must be at least 1 step")
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(f"{name}= has no state_dict()/load_state_dict()",
                                 hint="pass objects such as a model, an optimizer, a scheduler or a data cursor")
        self.interval = interval
        #: the interval after an early warning (rebalance recommendation, maintenance) reached any rank
        self.early_interval = early_interval or max(1, interval // 4)
        self.objects = objects
        # Optimizers of DTensor parameters, with their modules: saved by parameter name (dashrun.rank.sharded).
        self._owners = sharded.owners(objects)
        # An ElasticSampler's position is the job's, not the rank's: replicated even under a per_rank name.
        self.per_rank = frozenset(name for name in per_rank if name in objects and not _job_wide(objects[name]))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
        self.job_id = job_id or env.get(env.JOB_ID)
        self.stats = SaveStats()
        #: The last restore's bytes of sharded state this rank needed and had read (``sharded_needed``/``_read``).
        self.restore_stats: dict[str, int] = {}
        #: How this run began (the step restored, -1 for none, and how long it took): reported with each snapshot,
        #: from which dash-memd's run history counts the steps redone after a rollback.
        self._restored: Restored | None = None
        self.preempted = False
        #: The job's world may change under dashrun (``--nnodes MIN:MAX`` with ``--memd``): when another node goes
        #: away or joins, this rank checkpoints and is started again at the new world size.
        self.elastic = env.get(env.ELASTIC) == "1"
        self.generation = _int_env(env.GENERATION)
        #: The job's nodes and world history as the launcher last saw them (None when not launched elastic).
        self.membership = _membership_from_env()
        #: Called by restore() as ``on_world_change(saved_world, world)`` when the checkpoint was taken at another
        #: world size (ranks): the place to rescale a learning rate or a per-rank batch.
        self.on_world_change = on_world_change
        _show_logs_of_rank(self.rank)
        _record_uncaught_errors()
        self._socket = env.get(env.AGENT_SOCKET)
        self.enabled = bool(self._socket and self.job_id)
        if not self.enabled:
            log.warning("dashrun.Checkpointer: not launched by dashrun (%s is unset): checkpointing is off",
                        env.AGENT_SOCKET.name if not self._socket else env.JOB_ID.name)
        # Each kind of trouble is reported once; a stored shard clears them (see dashrun.rank.stager).
        self._problems = ProblemLog(log)
        # Set before the link exists: its reader thread may deliver a notice the moment it connects.
        self._notices = NoticeBoard(self.world, self.early_interval, self.generation,
                                    term_grace=_float_env(env.TERM_GRACE, TERM_GRACE))
        self._sigterm = self._take_sigterm() if self.enabled else None
        atexit.register(self._notices.close_at_exit)  # for a script that never calls close(): see NoticeBoard.close
        self._link = (AgentLink(self._socket, on_notice=self._notices.on_notice, on_reshape=self._notices.on_reshape)
                      if self.enabled else None)
        if self._link is not None:
            self._link.request(Kind.PING)  # connect now: a notice the agent already has reaches us at once
        if self.world > 1 and not in_process_group() and self.enabled:
            log.warning("dashrun: WORLD_SIZE is %d but torch.distributed is not initialised: on a preemption "
                        "notice the ranks cannot agree on one step (call init_process_group before Checkpointer)",
                        self.world)
        self._stager = Stager(self._link, job_id=self.job_id, rank=self.rank, world=self.world, stats=self.stats,
                              problems=self._problems, generation=self.generation)
        self._current: Snapshot | None = None    # the newest snapshot handed to the stager
        self._last_step: int | None = None       # step of the newest snapshot (or restored checkpoint)
        self._restored_step: int | None = None   # step of the checkpoint restore() loaded
        self._saved_since_restore = False        # save() was called after it: the loop trained a step
        self._said_complete = False
        self._closed = False
        self._hooks = [obj.register_step_pre_hook(self._before_optimizer_step)
                       for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)]

    def _take_sigterm(self) -> tuple[Callable, Any] | None:
        """SIGTERM is a preemption notice — a scheduler's (Kubernetes, Slurm, SkyPilot), or the launcher passing
        its own on — not the end of the rank: the handler records it, and the next save() takes the emergency
        checkpoint on every rank of the job, as after a cloud's notice. A handler the script installed before
        still runs after it. Only the main thread may install one; the handler and the one it replaced, so that
        close() can put that back."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("dashrun: Checkpointer made outside the main thread: SIGTERM ends the rank without an "
                        "emergency checkpoint")
            return None
        notices, before = self._notices, signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame) -> None:
            notices.on_signal()
            if callable(before):
                before(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        return on_sigterm, before

    def take_sigterm(self) -> None:
        """SIGTERM back to this Checkpointer, from a handler a framework installed after it was made (Lightning's
        ``Trainer`` installs one that stops training at the next batch without a checkpoint). The framework's
        handler is not chained; the one the script had before the Checkpointer still is. From the main thread."""
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm[0])

    # --- saving ----------------------------------------------------------------------

    def save(self, step: int, force: bool = False) -> bool:
        """Snapshot the state after ``step`` if due (or forced); returns True if a snapshot started.

        Call it on every rank after every step. It returns at once: it only
        captures what could change before the next ``optimizer.step()``; laying
        out, copying and sending happen on the stager. After an interruption
        notice reached any rank of the job, every rank takes the emergency
        checkpoint of the same step here, waits until dash-memd has committed
        it, and sets ``preempted``.
        """
        if not self.enabled or self.preempted:
            return False
        self._saved_since_restore = True
        started = time.perf_counter()
        if self._notices.signal_unsaid():
            log.warning("dashrun: rank %d: SIGTERM: checkpointing at the next step, then stopping (within %.0fs)",
                        self.rank, self._notices.term_grace)
        agreed = self._notices.agree()
        if (agreed.emergency or agreed.reshape) and self.elastic and not self._notices.noticed_here:
            self._world_change(step, agreed)
        if agreed.emergency:
            return self._emergency(step, agreed)
        snapshot = None
        try:
            interval = min(self.interval, self.early_interval) if agreed.early else self.interval
            if not force and self._last_step is not None and step - self._last_step < interval:
                return False
            if not force and self._last_step is None and (step + 1) % interval:
                return False
            if not force and agreed.starved:
                return self._skip(step)
            snapshot = self._take(step, force)
            return snapshot is not None
        finally:
            if self._notices.shared:
                self._notices.publish(starved=not self._stager.has_free())
            if snapshot is not None:
                # Handed to the stager last: its thread, woken, takes the GIL for the layout, and this one would
                # wait for it to start the all-reduce.
                self._hand(snapshot, started)

    def _snapshot(self, step: int, wait_for_buffer: bool, emergency: bool = False) -> bool:
        started = time.perf_counter()
        snapshot = self._take(step, wait_for_buffer, emergency)
        if snapshot is not None:
            self._hand(snapshot, started)
        return snapshot is not None

    def _take(self, step: int, wait_for_buffer: bool, emergency: bool = False) -> Snapshot | None:
        """Capture the state after ``step`` into a reserved buffer; None if none came free (the save skipped)."""
        self._await_copy()
        buffer_index = self._stager.reserve(wait=wait_for_buffer)
        if buffer_index is None:
            self._skip(step)
            return None
        try:
            snapshot = capture(step, buffer_index, self.objects, self.per_rank, rank=self.rank,
                               emergency=emergency, owners=self._owners)
        except BaseException:
            self._stager.unreserve(buffer_index)  # for the next save(): this one failed before anything was staged
            raise
        snapshot.restored = self._restored
        self._current = snapshot
        self._last_step = step
        self.stats.snapshots += 1
        return snapshot

    def _hand(self, snapshot: Snapshot, started: float) -> None:
        """Stage ``snapshot``; training was held since ``started`` (save() called) for it."""
        self._stager.submit(snapshot)
        stall = time.perf_counter() - started
        self.stats.stall_s += stall
        self.stats.last_stall_s = stall

    def _skip(self, step: int) -> bool:
        """A due snapshot skipped (on every rank at once: see Agreement.starved), counted."""
        self.stats.skipped += 1
        # The schedule moves on as if it was taken: every rank keeps the same due steps.
        self._last_step = step
        self._problem("skipped", f"checkpoint of step {step} skipped: the previous two are still on their way "
                                 "to dash-memd (raise the interval, or check the network to dash-memd)")
        return False

    def _emergency(self, step: int, agreed: Agreement) -> bool:
        """The checkpoint of ``step`` that a notice asked for: taken, awaited until committed, then stop."""
        log.warning("dashrun: rank %d: emergency checkpoint of step %d", self.rank, step)
        started = self._snapshot(step, wait_for_buffer=True, emergency=True)
        committed = started and self.wait(timeout=agreed.commit_budget())
        if committed:
            log.warning("dashrun: rank %d: step %d is safe in dash-memd; stopping for the preemption", self.rank, step)
        else:
            log.error("dashrun: rank %d: the emergency checkpoint of step %d was NOT committed before the notice's "
                      "deadline; a relaunch resumes from the newest committed checkpoint", self.rank, step)
        self.preempted = True
        self._notices.settle()
        return started

    def _world_change(self, step: int, agreed: Agreement) -> NoReturn:
        """This node stays while the world changes (another node's notice, or a node joining): checkpoint
        ``step``, wait until it is committed, and end this rank for its launcher to start it again at the new
        world size, where restore() returns ``step + 1``. ``preempted`` stays False: the job goes on."""
        why = "another node goes away" if agreed.emergency else "a node joins"
        log.warning("dashrun: rank %d: %s: checkpoint of step %d, then restarting at the new world size", self.rank,
                    why, step)
        started = self._snapshot(step, wait_for_buffer=True)
        if not (started and self.wait(timeout=agreed.commit_budget())):
            log.error("dashrun: rank %d: the checkpoint of step %d was NOT committed; the job continues from the "
                      "newest committed one", self.rank, step)
        self.close()
        raise SystemExit(int(ExitCode.WORLD_CHANGE))

    def _problem(self, kind: str, message: str) -> None:
        """Warn once per kind of trouble; a stored shard clears it, so a new failure is reported again."""
        self._problems.problem(SAVE, kind, "dashrun: %s", message)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        snapshot = self._current
        if snapshot is None or snapshot.awaited:
            return
        started = time.perf_counter()
        snapshot.copied.wait()
        if snapshot.gpu_done is not None:
            torch.cuda.current_stream().wait_event(snapshot.gpu_done)  # waits on the GPU, not here
        snapshot.awaited = True
        stall = time.perf_counter() - started
        self.stats.stall_s += stall
        self.stats.last_stall_s += stall

    def _await_copy(self) -> None:
        if self._current is not None:
            self._before_optimizer_step(None, (), {})

    def wait(self, timeout: float = 600.0) -> bool:
        """Block until the newest snapshot is committed in dash-memd; True if it is (or nothing was saved)."""
        self._say_if_complete()
        snapshot = self._current
        if not self.enabled or snapshot is None:
            return True
        deadline = time.monotonic() + timeout
        if not snapshot.handed.wait(timeout) or snapshot.result is None:
            return False
        concurrent.futures.wait([snapshot.result], timeout=max(0.0, deadline - time.monotonic()))
        snapshot.settled.wait(max(0.0, deadline - time.monotonic()))  # the stats count it before wait() answers
        try:
            snapshot.result.result(timeout=0)
            request = WaitRequest(self.job_id, snapshot.step, max(0.0, deadline - time.monotonic()))
            reply = self._link.call(Kind.WAIT, request.to_body(), timeout=max(1.0, deadline - time.monotonic() + 5))
            return WaitReply.from_body(reply.body).committed
        except (DashError, concurrent.futures.TimeoutError) as e:
            self._problem("unconfirmed", f"checkpoint of step {snapshot.step} not confirmed: {e}")
            return False

    # --- restoring -----------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest committed checkpoint of the job; returns the step to run next (0 if none).

        A checkpoint that the objects do not fit (other shapes or keys) raises
        :class:`~dashrun.errors.RestoreMismatchError`, printed as one line if uncaught. A run that restores and then
        never calls ``save()`` (the job had finished) says at ``wait()`` or ``close()`` that the job is complete.
        """
        if not self.enabled:
            return 0
        began, at = time.monotonic(), time.time()
        info = restore_state(self._link, job_id=self.job_id, rank=self.rank, world=self.world,
                             local_world=self.local_world, objects=self.objects, per_rank=self.per_rank,
                             owners=self._owners, stats=self.restore_stats,
                             on_wait=lambda message: self._problem("restore", message), local_rank=self.local_rank)
        self._restored = Restored(-1 if info is None else info.step, time.monotonic() - began, at)
        if info is None:
            return 0
        self._last_step = self._restored_step = self._stager.base = info.step
        if info.world != self.world and self.on_world_change is not None:
            self.on_world_change(info.world, self.world)
        return info.step + 1

    def _say_if_complete(self) -> None:
        """At the end of the script's run (its ``wait()`` or ``close()``): a run that restored a checkpoint and
        then never called ``save()`` trained no step — ``range(ckpt.restore(), steps)`` was empty, the job had
        finished — and the first rank of each node says so, once, rather than exit 0 having done nothing.

        The rank knows this and its launcher does not: a newest checkpoint in dash-memd that did not change
        during the run is also what a run leaves that trained steps after its last due snapshot.
        """
        if (self._said_complete or self._restored_step is None or self._saved_since_restore
                or (self.local_rank if self.local_rank is not None else self.rank) != 0):
            return
        self._said_complete = True
        log.warning("dashrun: job %s is complete: its newest checkpoint, step %d, was restored and no step was left "
                    "to train; pass --fresh (or a new --job-id) to train it again", self.job_id, self._restored_step)

    def close(self) -> None:
        if self._closed:  # a rank ended for a world change closed it already; the script's own close() follows
            return
        self._say_if_complete()
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        if (self._sigterm is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is self._sigterm[0]):  # not replaced since: put back
            signal.signal(signal.SIGTERM, self._sigterm[1] if self._sigterm[1] is not None else signal.SIG_DFL)
        self._notices.close()  # every rank started the last all-reduce: it is settled, then let go
        atexit.unregister(self._notices.close_at_exit)
        self._stager.stop()
        if self._link is not None:
            self._link.close()
        self._stager.close()
