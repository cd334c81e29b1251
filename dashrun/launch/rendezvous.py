"""The job's rendezvous on dash-memd: torch's dynamic rendezvous over dash-memd's authenticated, encrypted link.

With ``--memd``, ``--nnodes MIN:MAX`` (MAX > 1) and no ``--rdzv-endpoint``,
the rendezvous lives in dash-memd on the stable VM, never on a Spot node.
:class:`MemdRendezvousBackend` is torch's ``RendezvousBackend``: compare-and-set
of the state torch's ``DynamicRendezvousHandler`` keeps, which dash-memd
stores without reading it (and without torch) and persists, so a restarted
dash-memd brings the rendezvous back. :class:`MemdStore` is the
``torch.distributed.Store`` for the few keys of each round's bootstrap.
:class:`DashRendezvousHandler` is torch's handler with what a changing fleet
needs: the round's members, a leave that does not close the rendezvous for
the others, and a fresh TCPStore (the one the ranks form their process group
with) on the world's rank 0 at every round — torch keeps the first round's,
which dies with its node.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import pickle
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    _Action,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousState,
)

from dashrun.errors import DashError, UnavailableError
from dashrun.launch.options import LaunchOptions, max_nodes
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.tokens import read_token
from dashrun.wire.heartbeats import DEFAULT_KEEP_ALIVE, KEEP_ALIVE, MAX_NODES, KeepAlive, liveness
from dashrun.wire.memd_client import MemdClient, StoreTimeoutError

__all__ = [
    "BACKEND", "RDZV_DEFAULTS", "DashRendezvousHandler", "MemdConnection", "MemdRendezvousBackend", "MemdStore",
    "create_handler", "use_memd_rendezvous",
]

log = logging.getLogger(__name__)

#: The rendezvous backend's name (``--rdzv-backend``) when dash-memd serves the rendezvous.
BACKEND = "dashrun"
#: dashrun's rendezvous settings where ``--rdzv-conf`` names none. A member is dead after
#: ``keep_alive_interval * keep_alive_max_attempt`` seconds without a heartbeat (torch: 5 * 3), so survivors
#: learn of a death within 10 s; ``last_call`` is how long a round waits for more nodes once MIN are there
#: (torch: 30 s): a shrink should not wait for nodes that are gone, and a late node joins at a checkpoint.
RDZV_DEFAULTS = {"keep_alive_interval": int(DEFAULT_KEEP_ALIVE.interval),
                 "keep_alive_max_attempt": DEFAULT_KEEP_ALIVE.max_attempt, "last_call_timeout": 1, "join_timeout": 600,
                 "close_timeout": 30, "heartbeat_timeout": 5}
#: Seconds a blocking get of the bootstrap store waits server-side at most, per request.
STORE_GET_SLICE = 60.0
#: Keys of each round of the bootstrap store: torch's ``PrefixStore`` adds this and a "/" before each key.
STORE_ROUND_PREFIX = "torch.rendezvous.{run_id}.{round}/"


def use_memd_rendezvous(args: argparse.Namespace, options: LaunchOptions) -> bool:
    """Serve this launch's rendezvous from dash-memd: a shared dash-memd, several nodes allowed, and neither an
    explicit ``--rdzv-endpoint`` (which still wins) nor ``--standalone``. Sets torch's rendezvous options."""
    if options.memd is None or args.rdzv_endpoint or args.standalone or max_nodes(args) < 2:
        return False
    if args.rdzv_backend not in ("static", "c10d", BACKEND):
        return False
    args.rdzv_backend = BACKEND
    args.rdzv_endpoint = f"{options.memd[0]}:{options.memd[1]}"
    if args.rdzv_id in (None, "", "none"):
        args.rdzv_id = options.job_id
    given = {item.split("=", 1)[0] for item in (args.rdzv_conf or "").split(",") if "=" in item}
    extra = [f"{key}={value}" for key, value in RDZV_DEFAULTS.items() if key not in given]
    args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf or "", *extra]))
    return True


class MemdConnection:
    """One dash-memd connection for one purpose, reopened when dash-memd closed it while idle."""

    def __init__(self, options: LaunchOptions, timeout: float):
        self._client = MemdClient(*options.memd, read_token(options.token_file), timeout=timeout, tls=options.tls)
        self._lock = threading.Lock()

    def call(self, fn: Callable[[MemdClient], Any]) -> Any:
        with self._lock:
            if not self._client.idle_and_open():
                self._client.close()  # never send on a connection dash-memd already timed out
            return fn(self._client)

    def close(self) -> None:
        with self._lock:
            self._client.close()


#: Bound on a rendezvous state read from dash-memd: a node's address (its lists: MAX_NODES nodes each).
MAX_ADDR = 255


def state_to_wire(state: bytes, keep_alive: KeepAlive = DEFAULT_KEEP_ALIVE) -> bytes:
    """torch's state holder pickles its ``_RendezvousState``; what goes to dash-memd is that state as JSON, with
    this node's heartbeat settings, by which dash-memd and a node launched with ``--fresh`` judge which members
    are alive (:mod:`dashrun.wire.heartbeats`).

    The pickle is this process's own, made by torch a moment ago. No pickle
    crosses a process boundary: the other nodes read the JSON, checked, and
    make their own pickle of it for torch (:func:`state_from_wire`).
    """
    raw = pickle.loads(state)

    def node(desc) -> list:
        return [desc.addr, desc.pid, desc.local_id]

    return json.dumps({
        "round": raw.round, "complete": raw.complete, "closed": raw.closed,
        "deadline": raw.deadline.timestamp() if raw.deadline is not None else None,
        "participants": [[*node(d), rank] for d, rank in raw.participants.items()],
        "wait_list": [node(d) for d in raw.wait_list],
        "redundancy_list": [node(d) for d in raw.redundancy_list],
        "last_heartbeats": [[*node(d), beat.timestamp()] for d, beat in raw.last_heartbeats.items()],
        KEEP_ALIVE: keep_alive.to_wire(),
    }, separators=(",", ":")).encode()


def state_from_wire(data: bytes) -> bytes:
    """The JSON from dash-memd, every field checked, as the pickle torch's state holder loads."""
    try:
        raw = loads_bounded(data, max_depth=4)
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        state = _RendezvousState()
        state.round = _int(raw["round"])
        state.complete, state.closed = _bool(raw["complete"]), _bool(raw["closed"])
        state.deadline = None if raw["deadline"] is None else _time(raw["deadline"])
        state.participants = {_node(item[:3]): _int(item[3]) for item in _items(raw["participants"], 4)}
        state.wait_list = {_node(item) for item in _items(raw["wait_list"], 3)}
        state.redundancy_list = {_node(item) for item in _items(raw["redundancy_list"], 3)}
        state.last_heartbeats = {_node(item[:3]): _time(item[3]) for item in _items(raw["last_heartbeats"], 4)}
    except (KeyError, TypeError, ValueError) as e:
        raise RendezvousStateError(f"dash-memd holds a rendezvous state this dashrun cannot read: {e}") from None
    return pickle.dumps(state)


def _items(value, width: int) -> list:
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise ValueError(f"a list of at most {MAX_NODES} nodes expected")
    if not all(isinstance(item, list) and len(item) == width for item in value):
        raise ValueError("a node entry of the wrong shape")
    return value


def _node(item: list) -> _NodeDesc:
    addr, pid, local_id = item
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR:
        raise ValueError("a node address of 1-255 characters expected")
    return _NodeDesc(addr, _int(pid), _int(local_id))


def _int(value) -> int:
    if type(value) is not int or not 0 <= value < 1 << 63:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _bool(value) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{value!r} is not true or false")
    return value


def _time(value) -> datetime:
    if type(value) not in (int, float) or not 0 <= value < 1e11:
        raise ValueError(f"{value!r} is not a time")
    return datetime.fromtimestamp(value, timezone.utc)


class MemdRendezvousBackend(RendezvousBackend):
    """torch's rendezvous state, held by dash-memd: compare-and-set by token, persisted there. It travels as
    checked JSON (:func:`state_to_wire`), never as a pickle, with ``keep_alive``: the job's heartbeat settings."""

    def __init__(self, options: LaunchOptions, run_id: str, keep_alive: KeepAlive = DEFAULT_KEEP_ALIVE):
        self.job = options.job_id
        self.run_id = run_id
        self.keep_alive = keep_alive
        self._memd = MemdConnection(options, timeout=30)
        self._watch = MemdConnection(options, timeout=30)  # its own: a wait must not hold up the heartbeats

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        found = self._call(lambda c: c.rendezvous_get(self.job, self.run_id))
        if found is None:
            return None
        state, token = found
        return state_from_wire(state), token

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        answer = self._call(lambda c: c.rendezvous_set(self.job, self.run_id, state_to_wire(state, self.keep_alive),
                                                       token if isinstance(token, int) else None))
        if answer is None:
            return None
        held, new_token, was_set = answer
        return state_from_wire(held), new_token, was_set

    def wait_for_change(self, token: Any, seconds: float) -> None:
        """Return once the state's token is not ``token`` (another node set it), or after ``seconds``."""
        deadline = time.monotonic() + seconds
        token = token if isinstance(token, int) else None
        held = self._call(lambda c: c.rendezvous_get(self.job, self.run_id, token, seconds), self._watch)
        left = deadline - time.monotonic()
        if (held[1] if held else None) == token and left > 0.9 * seconds:
            time.sleep(left)  # unchanged, yet answered at once: a dash-memd that does not wait; poll as torch does

    def _call(self, fn, connection: MemdConnection | None = None):
        try:
            return (connection or self._memd).call(fn)
        except UnavailableError as e:
            raise RendezvousConnectionError(f"dash-memd holds the rendezvous and cannot be reached: {e}") from None
        except DashError as e:
            raise RendezvousStateError(f"dash-memd refused the rendezvous state: {e}") from None


class MemdStore(dist.Store):
    """A ``torch.distributed.Store`` over dash-memd's key/value store of the job (RAM only, bounded there).

    torch's rendezvous uses it for each round's bootstrap — rank 0's address
    for the TCPStore, the agents' role and rank assignment, the exit barrier
    — a few keys per node and round, so its speed does not matter. A get
    blocks in dash-memd until the key is set, in slices, up to the store's
    timeout.
    """

    def __init__(self, options: LaunchOptions, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.job = options.job_id
        self._memd = MemdConnection(options, timeout=STORE_GET_SLICE + 30)
        self.set_timeout(timeout)

    def set(self, key: str, value) -> None:
        self._memd.call(lambda c: c.store_set(self.job, key, _bytes(value)))

    def multi_set(self, keys: list[str], values: list) -> None:
        self._memd.call(lambda c: c.store_multi_set(self.job, list(keys), [_bytes(v) for v in values]))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._until_set(keys, self.timeout, lambda c, wait: c.store_multi_get(self.job, list(keys), wait))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until_set(keys, timeout or self.timeout, lambda c, wait: c.store_wait(self.job, list(keys), wait))

    def _until_set(self, keys: list[str], timeout: timedelta, request: Callable[[MemdClient, float], Any]) -> Any:
        """A request that dash-memd holds until ``keys`` are set, asked again in slices up to ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            wait = min(STORE_GET_SLICE, max(0.0, deadline - time.monotonic()))
            try:
                return self._memd.call(lambda c: request(c, wait))
            except StoreTimeoutError:
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"keys {keys} not set within {timeout}") from None

    def add(self, key: str, amount: int) -> int:
        return self._memd.call(lambda c: c.store_add(self.job, key, int(amount)))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._memd.call(lambda c: c.store_compare_set(self.job, key, _bytes(expected), _bytes(desired)))

    def check(self, keys: list[str]) -> bool:
        return self._memd.call(lambda c: c.store_check(self.job, list(keys)))

    def delete_key(self, key: str) -> bool:
        return self._memd.call(lambda c: c.store_delete(self.job, key))

    def num_keys(self) -> int:
        return self._memd.call(lambda c: c.store_num_keys(self.job))

    def delete_prefix(self, prefix: str) -> int:
        return self._memd.call(lambda c: c.store_delete_prefix(self.job, prefix))

    def close(self) -> None:
        self._memd.close()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


#: Where torch's rendezvous loop would sleep a second before reading the state again (its SYNC), the
#: executor of a :class:`DashRendezvousHandler` waits in dash-memd for the state to change instead.
_WAIT_FOR_CHANGE: contextvars.ContextVar[Callable[[float], None] | None] = contextvars.ContextVar(
    "dashrun_wait_for_change", default=None)
_torch_delay = dynamic_rendezvous._delay


def _delay(seconds) -> None:
    wait = _WAIT_FOR_CHANGE.get()
    if wait is not None and seconds == 1:  # the SYNC of torch's op executor: "poll for state changes"
        wait(seconds)
    else:
        _torch_delay(seconds)


dynamic_rendezvous._delay = _delay


class _ChangeWaitingExecutor(_DistributedRendezvousOpExecutor):
    """torch's op executor, reacting to another node's change of the state at once instead of up to a second
    (twice: torch's state holder also serves a cached state for a second) later. Each wait is one request
    held in dash-memd, so polling nodes cost it nothing more than torch's once-a-second reads."""

    def __init__(self, handler: DynamicRendezvousHandler, backend: MemdRendezvousBackend):
        super().__init__(handler._this_node, handler._state_holder, handler._settings)
        self._backend = backend
        self._look_again: float | None = None  # seconds: the next wait ends by then even if nothing changed

    def look_again_in(self, seconds: float) -> None:
        self._look_again = seconds

    def run(self, state_handler, deadline, update_deadline=None) -> None:
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = _JoinWithoutWaitingForNobody(state_handler, self)
        token = _WAIT_FOR_CHANGE.set(self._wait_for_change)
        try:
            super().run(state_handler, deadline, update_deadline)
        finally:
            _WAIT_FOR_CHANGE.reset(token)

    def _wait_for_change(self, seconds: float) -> None:
        if self._look_again is not None:
            seconds, self._look_again = max(0.01, min(seconds, self._look_again)), None
        self._backend.wait_for_change(self._state_holder._token, seconds)
        self._state_holder._last_sync_time = -1  # the next sync reads dash-memd, not torch's cache


#: How long a round after the job's first waits for more nodes once every live node is in it: a node between
#: leaving the old round and joining the new one is briefly invisible (no heartbeat), and is milliseconds away.
ROUND_GRACE = timedelta(seconds=0.5)


class _JoinWithoutWaitingForNobody:
    """torch's join, except that a round after the job's first closes :data:`ROUND_GRACE` after MIN nodes are
    in it when every node that heartbeats is in it, rather than after the whole last call.

    After a membership change the nodes that go on are known: all of them
    heartbeat and none waits for a place, so there is nobody more to wait
    for (a node that starts later joins at a checkpoint). The job's first
    round keeps its last call, for nodes booting at about the same time.
    """

    def __init__(self, join: _RendezvousJoinOp, executor: _ChangeWaitingExecutor):
        self._join = join
        self._executor = executor

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        action = self._join(ctx, deadline)
        state, settings = ctx.state, ctx.settings
        if (action != _Action.SYNC or state.round == 0 or state.complete or state.deadline is None
                or ctx.node not in state.participants or state.wait_list or state.redundancy_list):
            return action
        now = datetime.now(timezone.utc)
        closes = state.deadline - settings.timeout.last_call + ROUND_GRACE
        if now < closes:
            self._executor.look_again_in((closes - now).total_seconds())  # not after the next change only
            return action
        lapse = settings.keep_alive_interval * settings.keep_alive_max_attempt
        alive = {node for node, beat in state.last_heartbeats.items() if now - beat <= lapse}
        return _Action.MARK_RENDEZVOUS_COMPLETE if alive <= set(state.participants) else action


class DashRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, with the round's members remembered, a leave that does not close, and a
    fresh TCPStore for every round (torch reuses the first round's, which dies with that round's rank 0)."""

    members: dict[Any, int]  # the round's participants (torch's node descriptors) and their ranks
    round: int

    def next_rendezvous(self):
        self._bootstrap_store_info = None  # a new world, a new store: the old one may have died with its node
        info = super().next_rendezvous()
        state = self._state_holder.state
        self.round = state.round
        self.members = dict(state.participants)
        if info.rank == 0 and self.round >= 2 and isinstance(self._store, MemdStore):
            try:  # keys of rounds before the previous one are of no use to anyone
                self._store.delete_prefix(STORE_ROUND_PREFIX.format(run_id=self._settings.run_id,
                                                                    round=self.round - 2))
            except DashError as e:
                log.debug("could not drop the store keys of round %d: %s", self.round - 2, e)
        return info

    @property
    def this_node(self):
        return self._this_node

    def departed(self) -> list[Any]:
        """Members of this round that left or stopped heartbeating (after a sync with dash-memd); all of them
        when the round itself has moved on without this node."""
        with self._heartbeat_lock:
            self._state_holder.sync()
            state = self._state_holder.state
        if state.round != self.round:
            return [node for node in self.members if node != self._this_node]
        return [node for node in self.members if node not in state.participants]

    def evict_late(self, late_after: timedelta) -> list[Any]:
        """Remove the members of this round whose last heartbeat is older than ``late_after``, now, rather than
        once they have missed every allowed heartbeat: for when this node's ranks just failed, so that the world
        is broken anyway and a member that is late is most likely gone. Returns those removed."""
        with self._heartbeat_lock:
            for _ in range(3):  # another node may change the state in between: compare-and-set, again
                self._state_holder._last_sync_time = -1  # a fresh read, not torch's cached one
                self._state_holder.sync()
                state = self._state_holder.state
                if state.round != self.round:
                    return []
                now = datetime.now(timezone.utc)
                late = [node for node in self.members if node != self._this_node and node in state.participants
                        and now - state.last_heartbeats.get(node, now) > late_after]
                if not late:
                    return []
                for node in late:
                    del state.participants[node]
                    state.last_heartbeats.pop(node, None)
                _remove_participant_epilogue(state, self._settings)
                self._state_holder.mark_dirty()
                if self._state_holder.sync():
                    return late
        return []

    def leave(self) -> None:
        """Leave the rendezvous without closing it: the others go on without this node."""
        self._stop_heartbeats()
        try:
            self._op_executor.run(_RendezvousExitOp(), time.monotonic() + self._settings.timeout.close.total_seconds())
        except Exception as e:  # its heartbeat lapses instead
            log.warning("could not leave the rendezvous cleanly (%s); the others notice within seconds", e)


def create_handler(options: LaunchOptions, params: RendezvousParameters) -> DashRendezvousHandler:
    """torch's ``create_handler`` for the dynamic rendezvous, on dash-memd's backend and store."""
    def seconds(key: str) -> timedelta | None:
        value = params.get_as_int(key + "_timeout")
        return None if value is None else timedelta(seconds=value)

    timeout = RendezvousTimeout(seconds("join"), seconds("last_call"), seconds("close"), seconds("heartbeat"))
    interval = params.get_as_int("keep_alive_interval", RDZV_DEFAULTS["keep_alive_interval"])
    attempts = params.get_as_int("keep_alive_max_attempt", RDZV_DEFAULTS["keep_alive_max_attempt"])
    backend = MemdRendezvousBackend(options, params.run_id, KeepAlive.bounded(interval, attempts))
    handler = DashRendezvousHandler.from_backend(
        params.run_id, MemdStore(options), backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=interval, keep_alive_max_attempt=attempts)
    handler._op_executor = _ChangeWaitingExecutor(handler, backend)
    return handler


def running_elsewhere(client: MemdClient, job: str, run_id: str) -> bool:
    """Whether nodes of the job's rendezvous are alive now: a heartbeat within the lapse that the job's own
    settings (sent with the state by its nodes) allow, judged as dash-memd judges a whole-job delete."""
    found = client.rendezvous_get(job, run_id)
    if found is None:
        return False
    try:
        return liveness(found[0], time.time()).live > 0
    except ValueError:  # not a state this dashrun reads: nobody can rendezvous on it, nothing to protect
        return False
