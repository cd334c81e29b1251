#!/usr/bin/env python3
"""Simulated nodes against one dash-memd: the harness of ``soak.py`` (and of fan-in benchmarks).

A simulated node is what dashrun runs on a node, made light enough that
sixteen of them share two cores: a real ``dash-agent`` process, and a group
of real rank processes that checkpoint through :class:`dashrun.Checkpointer`
over gloo, exactly as a training script does, but "train" a small state
whose bytes are a function of the job and the step (:func:`expected_state`),
so that any checkpoint can be checked byte for byte. The group imports
torch once and forks its ranks; when one rank dies it kills the others and
forks them all again, and they restore from the newest committed checkpoint,
as torchrun's elastic agent restarts a worker group. Each node runs a job of
its own, so nodes never wait for each other. The harness restarts a node's
agent when it dies, as the launcher does.

Each node's directory holds the agent's and the ranks' logs and ``claims``,
where the ranks append what dashrun told them, each line ending with the
time (``time.monotonic()``, one clock for every process of the machine):
``committed STEP SAVED_AT AT`` when rank 0's ``Checkpointer.wait()`` said
its newest snapshot is committed (``SAVED_AT``: when ``save()`` of that step
was called), ``restored STEP ok AT`` (or ``bad``) after each rank checked
what ``restore()`` gave it, and ``up STEP AT`` once a rank is ready to run
STEP (after its restore, if any).

With a gate (``NodeSpec.gate``), the ranks step and save only while the
node's ``gate`` file exists; they agree on it every step, so that a
benchmark can start and stop every node's checkpointing at once and keep
restored ranks from saving (``SimNode.open_gate``/``close_gate``); each rank
appends ``idle STEP AT`` when it stops at the closed gate.

Run as ``fleet.py group ...`` it is a node's group of ranks (started by
:class:`SimNode`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import itertools
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from dashrun.testing.agent import Agent  # noqa: E402
from dashrun.testing.memd import Memd  # noqa: E402
from dashrun.wire.memd_client import MemdClient  # noqa: E402

__all__ = ["NodeSpec", "SimNode", "expected_state", "fleet_memd", "verify_checkpoint"]

HERE = Path(__file__).resolve()


def fleet_memd(workdir: Path, token_file: Path, *extra: str, data_dir: Path | None = None, netns=None) -> Memd:
    """The fleet's dash-memd (the harness's): its data (unless ``data_dir`` says where) and log in ``workdir``;
    killed (SIGKILL) and started again on the same port and data; ``netns``: the fleet node it runs in."""
    return Memd(data_dir or workdir / "memd-data", token_file, *extra, log_path=workdir / "memd.log", timeout=120,
                netns=netns)


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """What each simulated node runs."""

    ranks: int = 2
    #: bytes of replicated state (split between the ranks), in KiB
    state_kib: int = 64
    #: seconds of "training" per step
    step_time: float = 0.2
    #: steps between checkpoints
    interval: int = 5
    #: rank 0 asks whether its newest snapshot is committed after every this many snapshots
    confirm_every: int = 3
    #: the ranks step only while the node's gate file exists (see the module's docstring)
    gate: bool = False


#: Elements between two that hold the step number in :func:`expected_state` (4 KiB of float32): every shard
#: of a checkpoint carries its step, so shards of different steps mixed into one checkpoint are caught.
STEP_STRIDE = 1024


@functools.lru_cache(maxsize=4)
def _job_base(job: str, numel: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(zlib.crc32(job.encode())))


def expected_state(job: str, step: int, numel: int):
    """The parameters every rank of ``job`` holds after ``step``: the same bytes wherever they are computed.

    Random bytes of the job, with the step written into every :data:`STEP_STRIDE`-th element: as checkable
    as random bytes per step, but cheap to make each step (sixteen nodes' ranks share two cores)."""
    state = _job_base(job, numel).clone()
    state[::STEP_STRIDE] = float(step)
    return state


def fill_state(out, job: str, step: int) -> None:
    """Make ``out`` (a tensor already holding this job's :func:`expected_state` of some step) that of ``step``."""
    out[::STEP_STRIDE] = float(step)


def numel_of(spec_kib: int) -> int:
    return spec_kib * 1024 // 4


def verify_checkpoint(client: MemdClient, job: str, step: int, state_kib: int) -> str | None:
    """Read a committed checkpoint back (every shard's CRC-32C checked) and compare it with the state it must
    hold; None if it is right, else what is wrong."""
    import torch

    from dashrun.launch.export import fetch_state

    info, state = fetch_state(client, job, step)
    if not torch.equal(state["model"]["weight"], expected_state(job, step, numel_of(state_kib))):
        return f"{job} step {step}: wrong parameters"
    for rank in range(info.world):
        if state["per_rank"][str(rank)]["data"] != {"rank": rank, "position": step}:
            return f"{job} step {step}: wrong state of rank {rank}"
    return None


class SimNode:
    """One simulated node: its dash-agent and its group of ranks (a job of its own), under the harness."""

    def __init__(self, index: int, memd: Memd, workdir: Path, spec: NodeSpec, netns=None):
        self.index = index
        self.netns = netns  # the fleet node (dashrun.testing.netns) its agent runs in; its ranks reach it anyway
        self.job = f"sim-{index:03d}"
        self.memd = memd
        self.spec = spec
        self.dir = workdir / f"node-{index:03d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.dir / "agent.sock"
        self.claims_path = self.dir / "claims"
        self.agent: subprocess.Popen | None = None
        self.group: subprocess.Popen | None = None
        self.agent_restarts = self.group_restarts = 0

    def start(self) -> SimNode:
        self._start_agent()
        self._start_group()
        return self

    def _start_agent(self) -> None:
        self.agent = Agent(self.memd, self.socket_path, self.dir / "agent.log",
                           options=("--job-id", self.job, "--cloud", "none", "--memd-timeout", "10",
                                    "--drain-timeout", "5"),
                           timeout=120, what=f"dash-agent of {self.job}", netns=self.netns,
                           start_new_session=True).proc

    def _start_group(self) -> None:
        spec = self.spec
        with open(self.dir / "group.log", "ab") as log:
            self.group = subprocess.Popen(
                [sys.executable, str(HERE), "group", "--job", self.job, "--socket", str(self.socket_path),
                 "--dir", str(self.dir), "--ranks", str(spec.ranks), "--state-kib", str(spec.state_kib),
                 "--step-time", str(spec.step_time), "--interval", str(spec.interval),
                 "--confirm-every", str(spec.confirm_every), *(["--gate"] if spec.gate else [])],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def supervise(self) -> None:
        """Restart what died: the agent (as dashrun's launcher does), the group (it never exits by itself)."""
        if self.agent.poll() is not None:
            self.agent_restarts += 1
            self._start_agent()
        if self.group.poll() is not None:
            self.group_restarts += 1
            self._start_group()

    def rank_pids(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.group.pid).children()]
        except psutil.NoSuchProcess:
            return []

    def kill_rank(self, rng: random.Random) -> bool:
        pids = self.rank_pids()
        if not pids:
            return False
        _kill(rng.choice(pids))
        return True

    def kill_agent(self) -> None:
        _kill(self.agent.pid)
        self.agent.wait()

    def kill_ranks(self) -> list[int]:
        """SIGKILL every rank process of the node at once (its group forks them again); returns their pids."""
        pids = self.rank_pids()
        for pid in pids:
            _kill(pid)
        return pids

    @property
    def gate_path(self) -> Path:
        return self.dir / "gate"

    def open_gate(self) -> None:
        self.gate_path.touch()

    def close_gate(self) -> None:
        self.gate_path.unlink(missing_ok=True)

    def lines(self, word: str) -> list[str]:
        try:
            text = self.claims_path.read_text()
        except FileNotFoundError:
            return []
        return [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(word + " ")]

    def claims(self) -> list[int]:
        """The steps the node's rank 0 was told are committed, oldest first."""
        return [int(s.split()[0]) for s in self.lines("committed")]

    def commits(self) -> list[tuple[int, float, float]]:
        """(step, when save() was called, when rank 0 was told it is committed) of each confirmation, oldest
        first (``time.monotonic()``)."""
        return [(int(step), float(saved), float(at)) for step, saved, at in map(str.split, self.lines("committed"))]

    def restores(self) -> tuple[int, int]:
        """(restores that gave the state they should, restores that did not)."""
        results = [s.split()[1] for s in self.lines("restored")]
        return results.count("ok"), len(results) - results.count("ok")

    def restored_at(self) -> list[tuple[int, bool, float]]:
        """(step, right?, when) of each rank's restore, oldest first."""
        return [(int(step), result == "ok", float(at)) for step, result, at in map(str.split, self.lines("restored"))]

    def times(self, word: str) -> list[float]:
        """When each ``up`` or ``idle`` line was written."""
        return [float(s.split()[-1]) for s in self.lines(word)]

    def errors(self) -> int:
        """Rank processes that stopped on an error (see the node's rank logs)."""
        return len(self.lines("error"))

    def stop(self) -> None:
        for proc in (self.group, self.agent):
            if proc is not None and proc.poll() is None:
                for p in _tree(proc.pid):
                    _kill(p)
                proc.wait()


def _tree(pid: int) -> list[int]:
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- a node's group of ranks (``fleet.py group``) -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def group_main(args: argparse.Namespace) -> None:
    """Fork the ranks; when one exits, kill the rest and fork them all again (a new generation)."""
    import torch  # once, here: the forked ranks share it

    importlib.import_module("dashrun.rank.checkpointer")  # once, here, for the forks
    torch.set_num_threads(1)
    # The first optimizer made in a process imports seconds' worth of torch: here, once, not in every fork.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], lr=0.0).step()
    ranks: dict[int, int] = {}  # pid -> rank
    signal.signal(signal.SIGTERM, lambda *_: _stop_group(ranks, 0))
    for generation in itertools.count():
        port = _free_port()
        for rank in range(args.ranks):
            pid = os.fork()
            if pid == 0:
                _rank_process(args, rank, port)
            ranks[pid] = rank
        pid, _ = os.wait()  # the first rank to go takes its generation with it
        ranks.pop(pid, None)
        for other in ranks:
            _kill(other)
        for other in list(ranks):
            os.waitpid(other, 0)
        ranks.clear()


def _stop_group(ranks: dict[int, int], code: int) -> None:
    for pid in ranks:
        _kill(pid)
    os._exit(code)


def _rank_process(args: argparse.Namespace, rank: int, port: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 0
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks),
                          LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          DASH_AGENT_SOCKET=args.socket, DASH_JOB_ID=args.job)
        handler = logging.FileHandler(Path(args.dir) / f"rank-{rank}.log")
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(message)s", "%H:%M:%S"))
        logging.getLogger("dashrun").addHandler(handler)
        logging.getLogger("dashrun").setLevel(logging.INFO)
        rank_loop(args, rank)
    except BaseException as e:  # the group forks the generation again; the harness counts these
        code = 1
        with open(Path(args.dir) / f"rank-{rank}.log", "a") as log:
            traceback.print_exc(file=log)
        _append(Path(args.dir) / "claims", f"error rank {rank}: {type(e).__name__}")
    finally:
        os._exit(code)


class Cursor:
    """The rank's private state: which rank it is and the step it is at."""

    def __init__(self, rank: int):
        self.rank, self.position = rank, -1

    def state_dict(self) -> dict:
        return {"rank": self.rank, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.position = state["rank"], state["position"]


def rank_loop(args: argparse.Namespace, rank: int) -> None:
    """One rank: restore and check what came back, then a step and a save() every ``step_time``, forever."""
    import torch
    import torch.distributed as dist

    from dashrun.rank.checkpointer import Checkpointer

    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    numel = numel_of(args.state_kib)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)
    # As in training, the parameters change only in optimizer.step(), whose pre-hook waits for the copy of the
    # last snapshot: save() need not clone them (it would, 16 MiB a save, were nothing to say they are stable).
    optimizer = torch.optim.SGD([model.weight], lr=0.0)
    cursor = Cursor(rank)
    ckpt = Checkpointer(model=model, optimizer=optimizer, data=cursor, interval=args.interval)
    claims = Path(args.dir) / "claims"
    start = ckpt.restore()
    if start:
        right = torch.equal(model.weight.data, expected_state(args.job, start - 1, numel)) and \
            cursor.state_dict() == {"rank": rank, "position": start - 1}
        _append(claims, f"restored {start - 1} {'ok' if right else 'bad'} {time.monotonic():.6f}")
    _append(claims, f"up {start} {time.monotonic():.6f}")
    model.weight.data.copy_(expected_state(args.job, start, numel))
    gate = _Gate(Path(args.dir) / "gate", args.ranks) if args.gate else None
    snapshots = 0
    step = start
    while True:
        if gate is not None and not gate.open(step, claims):
            continue
        optimizer.step()  # changes nothing (no gradients); its hook makes the parameters ours again
        fill_state(model.weight.data, args.job, step)
        cursor.position = step
        saved_at = time.monotonic()
        if ckpt.save(step):
            snapshots += 1
            if rank == 0 and snapshots % args.confirm_every == 0 and ckpt.wait(timeout=10.0):
                _append(claims, f"committed {step} {saved_at:.6f} {time.monotonic():.6f}")
        time.sleep(args.step_time)
        step += 1


class _Gate:
    """The node's gate file, as every rank of the group agrees it is at each step (a MIN all-reduce)."""

    #: Seconds between two looks at a closed gate.
    POLL = 0.05

    def __init__(self, path: Path, ranks: int):
        import torch

        self.path, self.ranks = path, ranks
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.was_open = False

    def open(self, step: int, claims: Path) -> bool:
        import torch.distributed as dist

        self.flag[0] = int(self.path.exists())
        if self.ranks > 1:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MIN)
        is_open = bool(self.flag[0])
        if self.was_open and not is_open:
            _append(claims, f"idle {step} {time.monotonic():.6f}")
        self.was_open = is_open
        if not is_open:
            time.sleep(self.POLL)  # a closed gate: the ranks look again, together
        return is_open


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    group = sub.add_parser("group", help="a node's group of ranks (started by SimNode)")
    group.add_argument("--job", required=True)
    group.add_argument("--socket", required=True)
    group.add_argument("--dir", required=True)
    group.add_argument("--ranks", type=int, default=2)
    group.add_argument("--state-kib", type=int, default=64)
    group.add_argument("--step-time", type=float, default=0.2)
    group.add_argument("--interval", type=int, default=5)
    group.add_argument("--confirm-every", type=int, default=3)
    group.add_argument("--gate", action="store_true")
    args = parser.parse_args()
    group_main(args)


if __name__ == "__main__":
    main()
