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

The buffer is handed to the node's dash-agent by file descriptor; the
agent streams it to dash-memd and hands it back once stored. Two buffers
alternate, so one save can be staged while the previous one travels. If
both are still busy when a save is due, that snapshot is skipped (and
counted), never waited for — unless ``force=True``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import random
import sys
import threading
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist

from dashrun import env
from dashrun.errors import DashError, UnavailableError, UsageError
from dashrun.rank import staging, statetree
from dashrun.util.faults import crash_point
from dashrun.util.files import unmap
from dashrun.wire import image
from dashrun.wire.agent_link import AgentLink
from dashrun.wire.messages import CheckpointInfo, Notice, ShardHeader
from dashrun.wire.protocol import Kind

log = logging.getLogger(__name__)

META_FORMAT = 1
#: How long restore() keeps trying while dash-agent or dash-memd is unreachable.
RESTORE_TIMEOUT = 120.0
#: How long save(force=True) waits for a buffer before giving up on the snapshot.
FORCED_SAVE_TIMEOUT = 120.0
#: Seconds before a notice's deadline by which the emergency checkpoint must be committed, and how
#: long one waits for it when the deadline is unknown.
EMERGENCY_MARGIN = 2.0
EMERGENCY_TIMEOUT = 120.0
_NO_DEADLINE = 1e18
#: The background copy works in pieces of this size, and tells the agent its progress about this often.
PIECE = 8 << 20
PROGRESS_EVERY = 8 << 20


@dataclasses.dataclass
class SaveStats:
    snapshots: int = 0   # snapshots started
    skipped: int = 0     # due, but both buffers were still in flight
    stored: int = 0      # shards stored in dash-memd
    failed: int = 0      # shards handed over but not stored
    stall_s: float = 0.0        # total time save() and the optimizer hook blocked training
    last_stall_s: float = 0.0   # the same, for the most recent snapshot


class SharedBuffer:
    """A reusable staging buffer in a memfd: this rank writes it, the agent reads it by descriptor."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.fd = os.memfd_create("dashrun-stage", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self._map = mmap.mmap(self.fd, capacity)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.busy = False
        self._pinned = False
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # Pinned, so device-to-host copies run asynchronously at full speed.
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), capacity, 0)
            self._pinned = int(err) == 0

    def write(self, offset: int, data: bytes) -> None:
        self._map[offset:offset + len(data)] = data

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        unmap(self._map)
        os.close(self.fd)


@dataclasses.dataclass
class Snapshot:
    """One checkpoint of this rank, from ``save()`` (capture) through the stager to dash-memd."""

    step: int
    buffer_index: int
    # What save() captured: trees with leaf indices, and leaves; leaves that could change before the next
    # optimizer.step() are already private copies, the others (parameters, optimizer state) still live.
    rep_tree: Any
    rep_leaves: list[Any]
    priv_tree: Any
    priv_leaves: list[Any]
    header: ShardHeader | None = None
    buffer: SharedBuffer | None = None
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    handed: threading.Event = dataclasses.field(default_factory=threading.Event)  # result is set (or failed)
    awaited: bool = False  # the optimizer hook has waited for the copy
    emergency: bool = False  # taken because of an interruption notice
    gpu_ready: Any = None  # CUDA event: the optimizer step that produced this state is done
    gpu_done: Any = None   # CUDA event the compute stream waits on before the next optimizer.step()
    result: concurrent.futures.Future | None = None


def _split(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's [start, end) of ``total`` replicated bytes; cut points 64-byte aligned."""
    def cut(r: int) -> int:
        return min(total, statetree.align(total * r // world))
    return cut(rank), cut(rank + 1)


def _in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    # 625 integers as one tensor, not 625 JSON numbers: this runs inside save().
    state: dict[str, Any] = {"python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
                             "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_initialized():  # (is_available() is slow, and an uninitialised CUDA has no RNG in use)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal.tolist()), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state and sys.modules.get("numpy") is not None:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _show_logs_of_rank(rank: int) -> None:
    """Make dashrun's messages visible in a training script that configured no logging."""
    package = logging.getLogger("dashrun")
    if not logging.getLogger().handlers and not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(message)s", "%H:%M:%S"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def decode_replicated(region: torch.Tensor, mapped, info: CheckpointInfo, tails: list[int], *,
                      copy: bool) -> dict[str, Any]:
    """The state every rank held alike, from a restore image; ``copy=False`` gives views into it."""
    rep = image.meta(mapped, info, tails, 0)["replicated"]
    return statetree.unflatten(rep["tree"], statetree.materialize(rep["tensors"], region[:info.rep_total],
                                                                   copy=copy))


def decode_private(region: torch.Tensor, mapped, info: CheckpointInfo, tails: list[int], rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s own state (per-rank objects and ``$rng``), as owned tensors."""
    mine = image.meta(mapped, info, tails, rank)["private"]
    start = tails[rank]
    return statetree.unflatten(mine["tree"], statetree.materialize(
        mine["tensors"], region[start:start + info.shards[rank].private_len], copy=True))


def _map_tensors(tree: Any, fn) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map_tensors(v, fn) for v in tree)
    return tree


class Checkpointer:
    """Checkpoint a training job to dash-memd, and bring it back.

    ``objects`` are the keyword arguments with ``state_dict()`` and
    ``load_state_dict()`` (model, optimizer, scheduler, data cursor, ...).
    Launched without dashrun (no ``DASH_AGENT_SOCKET``), it does nothing:
    ``restore()`` returns 0 and ``save()`` returns False.
    """

    def __init__(self, *, interval: int = 100, early_interval: int | None = None, per_rank: Iterable[str] = ("data",),
                 job_id: str | None = None, **objects: Any):
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
        self.per_rank = frozenset(per_rank) & objects.keys()
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.job_id = job_id or env.get(env.JOB_ID)
        self.stats = SaveStats()
        self.preempted = False
        _show_logs_of_rank(self.rank)
        self._socket = env.get(env.AGENT_SOCKET)
        self.enabled = bool(self._socket and self.job_id)
        if not self.enabled:
            log.warning("dashrun.Checkpointer: not launched by dashrun (%s is unset): checkpointing is off",
                        env.AGENT_SOCKET.name if not self._socket else env.JOB_ID.name)
        # Set before the link exists: its reader thread may deliver a notice the moment it connects.
        self._notice: Notice | None = None    # the most serious notice this node's agent pushed
        self._notice_flag: torch.Tensor | None = None
        self._notice_work = None                 # the all-reduce of every rank's notice, one step behind
        self._notice_group = None
        self._link = AgentLink(self._socket, on_notice=self._on_notice) if self.enabled else None
        if self._link is not None:
            self._link.request(Kind.PING)  # connect now: a notice the agent already has reaches us at once
        if self.world > 1 and not _in_process_group() and self.enabled:
            log.warning("dashrun: WORLD_SIZE is %d but torch.distributed is not initialised: on a preemption "
                        "notice the ranks cannot agree on one step (call init_process_group before Checkpointer)",
                        self.world)
        self._buffers: list[SharedBuffer | None] = [None, None]
        self._reserved: set[int] = set()         # buffers save() gave to a snapshot the stager has not laid out
        self._cond = threading.Condition()
        self._stager = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dashrun-stage")
        self._current: Snapshot | None = None    # the newest snapshot handed to the stager
        self._last_step: int | None = None       # step of the newest snapshot (or restored checkpoint)
        self._failure: str | None = None         # the kind of failure reported last, to report each once
        self._side_stream = None
        self._hooks = [obj.register_step_pre_hook(self._before_optimizer_step)
                       for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)]

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
        level, deadline = self._agreed_notice()
        if level >= Notice.PREEMPT:
            return self._emergency(step, deadline)
        interval = min(self.interval, self.early_interval) if level >= Notice.EARLY else self.interval
        if not force and self._last_step is not None and step - self._last_step < interval:
            return False
        if not force and self._last_step is None and (step + 1) % interval:
            return False
        return self._snapshot(step, force)

    def _snapshot(self, step: int, wait_for_buffer: bool, emergency: bool = False) -> bool:
        started = time.perf_counter()
        self._await_copy()
        buffer_index = self._free_buffer(wait=wait_for_buffer)
        if buffer_index is None:
            self.stats.skipped += 1
            self._report("skipped", f"checkpoint of step {step} skipped: the previous two are still on their way "
                                    "to dash-memd (raise the interval, or check the network to dash-memd)")
            return False
        snapshot = self._capture(step, buffer_index)
        snapshot.emergency = emergency
        self._current = snapshot
        self._last_step = step
        self.stats.snapshots += 1
        self._stager.submit(self._stage, snapshot)
        stall = time.perf_counter() - started
        self.stats.stall_s += stall
        self.stats.last_stall_s = stall
        return True

    # --- interruption notices ---------------------------------------------------------------

    def _on_notice(self, body: dict[str, Any]) -> None:
        """From the agent's reader thread: record the notice; save() acts on it, on every rank at once."""
        try:
            notice = Notice.from_body(body)
        except DashError:
            return
        if not notice.outranks(self._notice):
            return
        self._notice = notice
        if notice.early_warning:
            log.warning("dashrun: %s early warning (%s): checkpointing every %d steps", notice.cloud, notice.kind,
                        self.early_interval)
        else:
            left = f"{notice.deadline - time.time():.0f}s" if notice.deadline else "an unknown time"
            log.warning("dashrun: %s %s notice: this node goes away in %s; checkpointing at the next step",
                        notice.cloud, notice.kind, left)

    def _agreed_notice(self) -> tuple[int, float | None]:
        """(level, deadline) of the most serious notice any rank had one step ago — the same on every rank.

        Each save() starts an all-reduce (MAX) of this rank's notice on a gloo
        group and reads the one it started at the previous step, so the ranks
        agree without waiting on the network: every rank acts at the same step.
        """
        notice = self._notice
        level = 0 if notice is None else notice.severity
        deadline = notice.deadline if notice is not None and not notice.early_warning and notice.deadline else None
        if self.world == 1 or not _in_process_group():
            return level, deadline
        agreed, agreed_deadline = 0, None
        if self._notice_work is not None:
            self._notice_work.wait()
            agreed_level, negated_deadline = self._notice_flag.tolist()
            agreed = int(agreed_level)
            agreed_deadline = -negated_deadline if negated_deadline > -_NO_DEADLINE else None
        if self._notice_group is None:
            self._notice_group = (dist.group.WORLD if dist.get_backend() == "gloo"
                                  else dist.new_group(backend="gloo"))  # collective: every rank, first save()
        self._notice_flag = torch.tensor([float(level), -(deadline or _NO_DEADLINE)], dtype=torch.float64)
        self._notice_work = dist.all_reduce(self._notice_flag, op=dist.ReduceOp.MAX, group=self._notice_group,
                                            async_op=True)
        return agreed, agreed_deadline

    def _emergency(self, step: int, deadline: float | None) -> bool:
        """The checkpoint of ``step`` that a notice asked for: taken, awaited until committed, then stop."""
        log.warning("dashrun: rank %d: emergency checkpoint of step %d", self.rank, step)
        started = self._snapshot(step, wait_for_buffer=True, emergency=True)
        budget = (deadline - time.time() - EMERGENCY_MARGIN) if deadline else EMERGENCY_TIMEOUT
        committed = started and self.wait(timeout=max(1.0, budget))
        if committed:
            log.warning("dashrun: rank %d: step %d is safe in dash-memd; stopping for the preemption", self.rank, step)
        else:
            log.error("dashrun: rank %d: the emergency checkpoint of step %d was NOT committed before the notice's "
                      "deadline; a relaunch resumes from the newest committed checkpoint", self.rank, step)
        self.preempted = True
        if self._notice_work is not None:
            self._notice_work.wait()
        return started

    def _free_buffer(self, wait: bool) -> int | None:
        """Reserve a staging buffer that dash-memd is done with (waiting for one only if ``wait``)."""
        def free() -> int | None:
            return next((i for i, b in enumerate(self._buffers)
                         if (b is None or not b.busy) and i not in self._reserved), None)

        with self._cond:
            if wait:
                self._cond.wait_for(lambda: free() is not None, timeout=FORCED_SAVE_TIMEOUT)
            index = free()
            if index is not None:
                self._reserved.add(index)
            return index

    def _buffer(self, index: int, nbytes: int) -> SharedBuffer:
        buffer = self._buffers[index]
        if buffer is None or buffer.capacity < nbytes:
            if buffer is not None:
                buffer.close()
            # Headroom, so a layout that grows a little (counters, longer numbers) reuses the buffer.
            buffer = SharedBuffer(nbytes + max(nbytes // 64, 1 << 20))
            self._buffers[index] = buffer
        buffer.busy = True
        self._reserved.discard(index)
        return buffer

    def _stable_storages(self) -> set[int]:
        """Storages that only ``optimizer.step()`` changes: parameters and optimizer state."""
        stable = set()
        for obj in self.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    stable.update(p.untyped_storage().data_ptr() for p in group["params"])
                for per_param in obj.state.values():
                    stable.update(t.untyped_storage().data_ptr() for t in per_param.values()
                                  if isinstance(t, torch.Tensor))
        stable.discard(0)
        return stable

    def _capture(self, step: int, buffer_index: int) -> Snapshot:
        """The synchronous part of save(): state dicts, RNG, and private copies of what may change soon."""
        replicated = {name: obj.state_dict() for name, obj in self.objects.items() if name not in self.per_rank}
        private = {name: self.objects[name].state_dict() for name in sorted(self.per_rank)}
        private["$rng"] = capture_rng()
        rep_tree, rep_leaves = statetree.flatten(replicated)
        priv_tree, priv_leaves = statetree.flatten(private)
        stable = self._stable_storages()

        def settled(leaf):  # module buffers change in forward, for example: copy them now
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in stable:
                return leaf.detach().clone()
            return leaf

        snapshot = Snapshot(step, buffer_index, rep_tree, [settled(x) for x in rep_leaves],
                            priv_tree, [settled(x) for x in priv_leaves])
        if any(isinstance(x, torch.Tensor) and x.is_cuda for x in snapshot.rep_leaves):
            # The side stream starts after the optimizer step that produced this state.
            snapshot.gpu_done = torch.cuda.Event()
            snapshot.gpu_ready = torch.cuda.Event()
            snapshot.gpu_ready.record(torch.cuda.current_stream())
        return snapshot

    def _layout(self, snapshot: Snapshot) -> list[tuple[Any, int, int, int]]:
        """Describe the shard, put it in a buffer, return its copies: (leaf, first, end, shard offset)."""
        rep_offsets, rep_total = statetree.plan(snapshot.rep_leaves)
        rep_desc = {"tree": snapshot.rep_tree, "tensors": statetree.describe(snapshot.rep_leaves, rep_offsets),
                    "total": rep_total}
        rep_json = json.dumps(rep_desc, separators=(",", ":"), sort_keys=True).encode()
        priv_offsets, priv_len = statetree.plan(snapshot.priv_leaves)
        # Every rank holds the same description of the replicated state; rank 0 carries it.
        meta = json.dumps({
            "format": META_FORMAT, "step": snapshot.step, "rank": self.rank, "world": self.world,
            "replicated": None,
            "private": {"tree": snapshot.priv_tree, "tensors": statetree.describe(snapshot.priv_leaves, priv_offsets)},
        }, separators=(",", ":")).encode()
        if self.rank == 0:
            meta = meta.replace(b'"replicated":null', b'"replicated":' + rep_json, 1)
        rep_start, rep_end = _split(rep_total, self.rank, self.world)
        rep_len = rep_end - rep_start
        snapshot.header = ShardHeader(
            job=self.job_id, step=snapshot.step, rank=self.rank, world=self.world, rep_total=rep_total,
            rep_start=rep_start, rep_end=rep_end, private_len=priv_len, meta_len=len(meta),
            layout=hashlib.sha256(rep_json).hexdigest())
        with self._cond:
            snapshot.buffer = self._buffer(snapshot.buffer_index, snapshot.header.nbytes)
        snapshot.buffer.write(rep_len + priv_len, meta)

        copies = []
        for leaf, offset in zip(snapshot.rep_leaves, rep_offsets):
            first, end = max(offset, rep_start), min(offset + statetree.nbytes_of(leaf), rep_end)
            # Pieces, so that the agent can start streaming before a big tensor is copied whole.
            for piece in range(first, end, PIECE):
                copies.append((leaf, piece - offset, min(piece + PIECE, end) - offset, piece - rep_start))
        for leaf, offset in zip(snapshot.priv_leaves, priv_offsets):
            copies.append((leaf, 0, statetree.nbytes_of(leaf), rep_len + offset))
        return copies

    def _stage(self, snapshot: Snapshot) -> None:
        """The stager: lay out, hand the segment to the agent, copy; the agent streams what is done."""
        try:
            copies = self._layout(snapshot)
        except BaseException as e:
            with self._cond:
                self._reserved.discard(snapshot.buffer_index)
                self._cond.notify_all()
            snapshot.copied.set()
            snapshot.handed.set()
            log.error("dashrun: the checkpoint of step %d cannot be staged: %s", snapshot.step, e)
            return
        # The rank checksums as it copies (on CPU, with dashrun's C helper); otherwise the agent does.
        checksum = staging.streaming and snapshot.gpu_done is None
        snapshot.result = self._link.request(Kind.SNAPSHOT, {"shard": snapshot.header.to_body(), "ready": 0,
                                                             "emergency": snapshot.emergency,
                                                             "checksum": checksum},
                                             fds=[snapshot.buffer.fd])
        snapshot.handed.set()
        crash_point("rank.handoff", rank=self.rank, step=snapshot.step)
        snapshot.result.add_done_callback(lambda f: self._release(snapshot, f.exception()))
        request_id = snapshot.result.request_id
        stage = snapshot.buffer.tensor
        try:
            if snapshot.gpu_done is not None:
                self._stage_cuda(snapshot, copies)
                snapshot.gpu_done.synchronize()  # bytes in host memory before the agent reads them
            else:
                # The copies run in shard order; the CRC also covers the alignment gaps between them and
                # the description at the end, read back from the buffer.
                crc = 0 if checksum else None
                reported = done = 0
                for index, (leaf, first, end, offset) in enumerate(copies):
                    if index == len(copies) // 2:
                        crash_point("rank.staging", rank=self.rank, step=snapshot.step)
                    if crc is not None:
                        if offset < done:
                            raise RuntimeError("the shard's copies are out of order")
                        crc = staging.crc_of(stage[done:offset], crc)
                    crc = staging.copy_into(stage[offset:offset + end - first], statetree.byte_view(leaf)[first:end],
                                            crc)
                    done = offset + end - first
                    if done - reported >= PROGRESS_EVERY and index + 1 < len(copies):
                        self._link.notify(Kind.PROGRESS, {"id": request_id, "ready": done})
                        reported = done
                if crc is not None:
                    crc = staging.crc_of(stage[done:snapshot.header.nbytes], crc)
        except BaseException as e:
            snapshot.copied.set()
            self._link.notify(Kind.PROGRESS, {"id": request_id, "failed": True})
            log.error("dashrun: staging the checkpoint of step %d failed: %s", snapshot.step, e)
            return
        snapshot.copied.set()
        final = {"id": request_id, "ready": snapshot.header.nbytes}
        if checksum:
            final["crc"] = crc
        self._link.notify(Kind.PROGRESS, final)

    def _stage_cuda(self, snapshot: Snapshot, copies) -> None:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        stream = self._side_stream
        stage = snapshot.buffer.tensor
        with torch.cuda.stream(stream):
            stream.wait_event(snapshot.gpu_ready)
            for leaf, first, end, offset in copies:
                stage[offset:offset + end - first].copy_(statetree.byte_view(leaf)[first:end], non_blocking=True)
            snapshot.gpu_done.record(stream)
        snapshot.copied.set()  # enqueued: the compute stream waits for gpu_done on the GPU

    def _release(self, snapshot: Snapshot, error: BaseException | None) -> None:
        with self._cond:
            snapshot.buffer.busy = False
            self._cond.notify_all()
        if error is None:
            self.stats.stored += 1
            if self._failure is not None and self._failure.startswith("not stored"):
                log.info("dashrun: checkpoints reach dash-memd again (step %d stored)", snapshot.step)
            self._failure = None
        else:
            self.stats.failed += 1
            self._report(f"not stored: {getattr(error, 'code', type(error).__name__)}",
                         f"checkpoint of step {snapshot.step} not stored: {error}; training continues, "
                         "the next save tries again")

    def _report(self, kind: str, message: str) -> None:
        """Warn once per kind of trouble; a success clears it, so a new failure is reported again."""
        if kind != self._failure:
            log.warning("dashrun: %s", message)
        self._failure = kind

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
        snapshot = self._current
        if not self.enabled or snapshot is None:
            return True
        deadline = time.monotonic() + timeout
        if not snapshot.handed.wait(timeout) or snapshot.result is None:
            return False
        try:
            snapshot.result.result(timeout=max(0.0, deadline - time.monotonic()))
            reply = self._link.call(Kind.WAIT, {"job": self.job_id, "step": snapshot.step,
                                                "timeout": max(0.0, deadline - time.monotonic())},
                                    timeout=max(1.0, deadline - time.monotonic() + 5))
            return bool(reply.body.get("committed"))
        except (DashError, concurrent.futures.TimeoutError) as e:
            self._report("unconfirmed", f"checkpoint of step {snapshot.step} not confirmed: {e}")
            return False

    # --- restoring -----------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest committed checkpoint of the job; returns the step to run next (0 if none)."""
        if not self.enabled:
            return 0
        frame = self._fetch(step=None)
        found_step = frame.body["checkpoint"]["step"] if frame.body.get("found") else -1
        agreed = self._agree(found_step)
        if agreed != found_step:
            frame.close_fds()
            frame = self._fetch(step=agreed) if agreed >= 0 else None
        if frame is None or not frame.body.get("found"):
            log.info("dashrun: no checkpoint of job %s yet: starting from step 0", self.job_id)
            return 0
        try:
            info = self._load(frame)
        finally:
            frame.close_fds()
        self._last_step = info.step
        return info.step + 1

    def _fetch(self, step: int | None):
        deadline = time.monotonic() + RESTORE_TIMEOUT
        delay = 0.5
        while True:
            try:
                return self._link.call(Kind.RESTORE, {"job": self.job_id, "step": step,
                                                      "local_ranks": self.local_world}, timeout=RESTORE_TIMEOUT)
            except UnavailableError as e:
                if time.monotonic() + delay > deadline:
                    raise UnavailableError(f"cannot restore job {self.job_id}: {e}",
                                           hint="is dash-memd up and reachable from this node?") from None
                self._report("restore", f"restore waits for dash-memd: {e}")
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    @staticmethod
    def _agree(step: int) -> int:
        """The oldest of the steps the ranks found, so every rank loads the same checkpoint."""
        if not _in_process_group() or dist.get_world_size() == 1:
            return step
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        value = torch.tensor([step], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())

    def _load(self, frame) -> CheckpointInfo:
        info = CheckpointInfo.from_body(frame.body["checkpoint"])
        tails = frame.body.get("tails")
        if not (isinstance(tails, list) and len(tails) == info.world and all(type(t) is int for t in tails)):
            raise UnavailableError("dash-agent sent a malformed restore description")
        size = os.fstat(frame.fds[0]).st_size
        mapped = mmap.mmap(frame.fds[0], size, flags=mmap.MAP_PRIVATE)  # copy-on-write: never alters the image
        region = torch.frombuffer(mapped, dtype=torch.uint8)
        replicated = decode_replicated(region, mapped, info, tails, copy=False)
        private = decode_private(region, mapped, info, tails, self.rank) if self.rank < info.world else None
        self._report_world_change(info)

        for name, obj in self.objects.items():
            if name in self.per_rank:
                if private is not None and name in private:
                    obj.load_state_dict(private[name])
            elif name not in replicated:
                raise UsageError(f"checkpoint of step {info.step} has no state for {name}=",
                                 hint="pass the same keyword objects to Checkpointer as the run that saved it")
            elif isinstance(obj, torch.nn.Module):
                obj.load_state_dict(replicated[name])  # copies into the parameters
            else:
                obj.load_state_dict(_map_tensors(replicated[name], torch.Tensor.clone))
        if private is not None:
            restore_rng(private.get("$rng", {}))
        del replicated, region
        log.info("dashrun: restored job %s step %d (%d bytes, saved by %d ranks)", self.job_id, info.step,
                 info.nbytes, info.world)
        return info

    def _report_world_change(self, info: CheckpointInfo) -> None:
        if info.world == self.world:
            return
        if self.rank >= info.world:
            log.warning("dashrun: rank %d: checkpoint of step %d was saved by %d ranks; this rank has no saved "
                        "per-rank state (%s, RNG) and starts those fresh", self.rank, info.step, info.world,
                        ", ".join(sorted(self.per_rank)) or "none")
        elif self.rank == 0 and info.world > self.world:
            log.warning("dashrun: checkpoint of step %d was saved by %d ranks, restored by %d: per-rank state "
                        "(%s, RNG) of ranks %d..%d is not restored", info.step, info.world, self.world,
                        ", ".join(sorted(self.per_rank)) or "none", self.world, info.world - 1)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._notice_work is not None:
            self._notice_work.wait()  # every rank started it; leave no collective half-done
        self._stager.shutdown(wait=True)
        if self._link is not None:
            self._link.close()
        for buffer in self._buffers:
            if buffer is not None:
                buffer.close()
        self._buffers = [None, None]
