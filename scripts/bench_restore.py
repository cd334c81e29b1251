#!/usr/bin/env python3
"""Restore benchmark: dashrun's restore() against torch.load and DCP load, side by side, in one run.

For each state size (an MLP's fp32 parameters + AdamW state, as in
``bench_checkpoint.py``), one process holds the model and restores the same
checkpoint again and again, each way in turn (interleaved rounds, best and
median per way), each time as a relaunched rank would: its parameters
allocated and touched, its optimizer without state yet:

* **loopback limit** — the same bytes over loopback TCP into a reused buffer,
  receiver on the other core: the network's speed on this machine; and the
  **bare pairs**: a sender on dash-memd's core and this process moving the same
  bytes over dashrun's own records (``dashrun/wire/sealed.py``: AES-128-GCM,
  and the signed records of ``--no-tls``) into a reused buffer, nothing else:
  the limit of a restore that must decrypt every byte; and the same pairs with
  the optimizer state's bytes received into memory new each round, as a
  relaunched rank's restore must put them (its optimizer has no state yet);
* **torch.load** — ``torch.load`` of a file in the page cache (warm) +
  ``load_state_dict`` of the model and the optimizer; and with ``mmap=True``;
* **DCP load** — ``torch.distributed.checkpoint.load`` of a ``dcp.save`` directory
  (warm) into the model's and optimizer's state dicts + ``set_state_dict``;
* **dashrun, dash-memd RAM** — ``Checkpointer.restore()`` through a real
  dash-agent from a real dash-memd that holds the checkpoint in RAM (TLS, and
  ``--no-tls``), as the only rank of its node: the rank has the agent read the
  state piece by piece into a few reused buffers and copies it into its
  tensors; and as the first rank of a node of two (**2-rank node**): the
  agent fetches it into an image for both, the rank loads it from there;
* **DCP load, dashrun.dcp.Reader** — the same ``dcp.load``, of a ``dcp.save``
  through ``dashrun.dcp.Writer`` (a job of its own), read from dash-memd's RAM
  by ``dashrun.dcp.Reader`` in the restoring process, with no dash-agent (TLS,
  and ``--no-tls``), which is also how the only rank of a node reads under
  dashrun; and as the first rank of a node of two under dashrun
  (**2-rank node**), through the node's dash-agent, which fetches an image for
  both;
* **dashrun, this node** — the same, when the node already holds the image
  (another local rank fetched it, or the agent fetched it ahead as it started);
* **dashrun, dash-memd disk** — dash-memd restarted before the round, so that it
  reads the checkpoint from its disk.

Beside each way's times, the CPU seconds each process spent on a restore
(medians): dash-memd, dash-agent, the restoring process — on this machine
they share its cores, where a node would have dash-memd on another machine.

Then the relaunch: from the command until ``restore()`` returned, for a script
that builds the model and restores it, launched by ``dashrun`` against a
running dash-memd, and by ``torchrun`` with ``torch.load`` + ``load_state_dict``
of a warm file (``--relaunch-rounds``, at the first size), with when the rank
started (its first line ran), imported torch and built the model.

Placement, as dashrun places a two-core node: the restoring process on the
first core; dash-memd and dash-agent on the second.

``--ram-only`` keeps torch.load, dash-memd's RAM for the only rank of a node and the pairs, whose state
fits beside one dash-memd at 4 GiB on a VM of 24 (no DCP directory, no second stack with ``--no-plain``).

With ``--peers`` (root): restore from the fleet's own RAM against dash-memd behind a thin link, in network
namespaces, and what replicas cost the training nodes (``scripts/bench_peers.py`` says how).

Usage::

    python3 scripts/bench_restore.py [--sizes-mib 256,1024,2048] [--rounds 3] [--json OUT]
    python3 scripts/bench_restore.py --sizes-mib 4096 --ram-only --no-plain --relaunch-rounds 0
    python3 scripts/bench_restore.py --peers [--size-mib 64] [--memd-rate 200mbit] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402  (scripts/ is sys.path[0] when this runs as a script)

from dashrun.util import daemon  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30

RELAUNCHED = """
import os, sys, time
started = float(os.environ["BENCH_STARTED"])
began = time.time() - started
sys.path.insert(0, {scripts!r})
import torch
torch.set_num_threads(1)
imported = time.time() - started
from benchlib import build_model
model, optimizer, _batch, _ = build_model({size})
built = time.time() - started
if sys.argv[1] == "torch.load":
    state = torch.load({path!r})
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"] + 1
else:
    import dashrun
    step = dashrun.Checkpointer(model=model, optimizer=optimizer, interval=10**9).restore()
print("RESTORED", step, time.time() - started, began, imported, built, flush=True)
"""


class Stack:
    """A dash-memd and a dash-agent for one way of restoring (TLS or not), restartable."""

    def __init__(self, workdir: Path, procs: benchlib.Processes, core: int, *, plaintext: bool, memory: int):
        from dashrun.util.tokens import write_token
        from dashrun.wire.tls import TlsSettings

        self.dir, self.procs, self.core = workdir, procs, core
        self.tls = TlsSettings(plaintext=plaintext)
        workdir.mkdir(parents=True, exist_ok=True)
        self.token_file = workdir / "token"
        self.token = write_token(self.token_file)
        self.memory = memory
        self.listen = "127.0.0.1:0"
        self.memd = self.agent = None
        self.job = "restore-plain" if plaintext else "restore"
        self.dcp_job = f"{self.job}-dcp"

    def start_memd(self) -> None:
        ready = self.dir / "memd.ready"
        ready.unlink(missing_ok=True)
        self.memd = self.procs.start_daemon("dash-memd", benchlib.pinned(
            [sys.executable, "-m", "dashrun.memd", "start", "--listen", self.listen, "--data-dir",
             str(self.dir / "memd-data"), "--memory-limit", str(self.memory), "--token-file", str(self.token_file),
             "--ready-file", str(ready), *self.tls.args()], self.core), ready=daemon.file_written(ready),
            log=self.dir / "memd.log", cwd=REPO, env=benchlib.child_env())
        self.listen = ready.read_text().strip()  # the same port when restarted

    def restart_memd(self) -> None:
        self.procs.stop(self.memd, timeout=60)
        self.start_memd()

    def start_agent(self) -> None:
        sock = self.dir / "agent.sock"
        env = {**benchlib.child_env(), "DASH_NO_PREFETCH": "1"}
        env.pop("DASH_JOB_ID", None)
        self.agent = self.procs.start_daemon("dash-agent", benchlib.pinned(
            [sys.executable, "-m", "dashrun.agent", "--memd", self.listen, "--token-file", str(self.token_file),
             "--socket", str(sock), *self.tls.args()], self.core), ready=daemon.accepting(sock),
            log=self.dir / "agent.log", cwd=REPO, env=env)
        self.socket = sock

    def client(self):
        from dashrun.wire.memd_client import MemdClient

        host, port = self.listen.rsplit(":", 1)
        return MemdClient(host, int(port), self.token, timeout=300, tls=self.tls)

    def rank(self, local_world: int = 1):
        """This process as the rank of a node of ``local_world`` ranks, talking to this stack's agent and told
        where dash-memd is, as dashrun's launcher tells its ranks."""
        told = {"DASH_MEMD": self.listen, "DASH_TOKEN_FILE": str(self.token_file),
                **({"DASH_NO_TLS": "1"} if self.tls.plaintext else {})}
        return mock.patch.dict(os.environ, DASH_AGENT_SOCKET=str(self.socket), DASH_JOB_ID=self.job,
                               LOCAL_WORLD_SIZE=str(local_world), **told)


#: The processes whose CPU time a restore is charged, as the report names them.
CPU_OF = ("dash-memd", "dash-agent", "restoring process")


def cpu_seconds(stack: Stack | None) -> dict[str, float]:
    """CPU seconds (user + system, every thread) each process has used so far: this one, and ``stack``'s
    dash-memd and dash-agent."""
    import psutil

    spent = os.times()
    used = {"restoring process": spent.user + spent.system}
    if stack is not None:
        for label, proc in (("dash-memd", stack.memd), ("dash-agent", stack.agent)):
            times = psutil.Process(proc.pid).cpu_times()
            used[label] = times.user + times.system
    return used


def timed(fn, before=None, stack: Stack | None = None, after=None) -> tuple[float, dict[str, float], float | None]:
    """(seconds ``fn()`` took, the CPU seconds each process spent meanwhile, seconds ``after()`` took then)."""
    if before is not None:
        before()
    cpu = cpu_seconds(stack)
    started = time.perf_counter()
    fn()
    took = time.perf_counter() - started
    used = {label: used - cpu[label] for label, used in cpu_seconds(stack).items()}
    if after is None:
        return took, used, None
    started = time.perf_counter()
    after()
    return took, used, time.perf_counter() - started


def summary(rounds: list[tuple[float, dict[str, float], float | None]], nbytes: int) -> dict:
    times = [took for took, _, _ in rounds]
    cpu = {label: statistics.median(used[label] for _, used, _ in rounds) for label in rounds[0][1]}
    first = [step for _, _, step in rounds if step is not None]
    return {"times_s": times, "best_s": min(times), "median_s": statistics.median(times),
            "bandwidth": nbytes / min(times), "cpu_s": cpu,
            **({"first_step_s": statistics.median(first), "first_steps_s": first} if first else {})}


def measure_size(size: int, rounds: int, workdir: Path, procs: benchlib.Processes, cores: tuple[int, int],
                 plain: bool, first_step: bool = False, ram_only: bool = False) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dashrun
    import dashrun.dcp as ddcp

    train_core, side_core = cores
    model, optimizer, batch, described = benchlib.build_model(size)
    benchlib.Trainer(model, optimizer, batch).step()  # the optimizer has its state, as at a checkpoint
    step = 41
    fresh = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim())  # what a relaunched rank gives new memory

    stacks = [Stack(workdir / "tls", procs, side_core, plaintext=False, memory=size * 3)]
    if plain:
        stacks.append(Stack(workdir / "plain", procs, side_core, plaintext=True, memory=size * 3))
    for stack in stacks:
        stack.start_memd()
        stack.start_agent()
        with stack.rank():
            ckpt = dashrun.Checkpointer(model=model, optimizer=optimizer, interval=10**9)
            ckpt.save(step, force=True)
            if not ckpt.wait(timeout=600):
                raise RuntimeError("the checkpoint was not committed")
            ckpt.close()
        with stack.client() as client:
            if not client.wait(stack.job, step, 600, on_disk=True):
                raise RuntimeError("the checkpoint did not reach dash-memd's disk")
            nbytes = client.latest(stack.job).nbytes

    path = workdir / "state.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
    dcp_dir = workdir / "dcp"
    if not ram_only:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(dcp_dir))
        for stack in stacks:  # the same through dash-memd: DCP's own save with dashrun.dcp.Writer, as another job
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=step, no_dist=True,
                     storage_writer=ddcp.Writer(stack.dcp_job, stack.listen, stack.token_file, tls=stack.tls))
        del model_sd, optim_sd

    def torch_load(mmap: bool):
        state = torch.load(path, mmap=mmap)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def dcp_load():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(dcp_dir))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def dcp_reader_load(stack: Stack, local_world: int = 0):
        """DCP's load through dashrun.dcp.Reader: in this process (``local_world`` 0, as outside dashrun), or
        as a rank under dashrun on a node of ``local_world`` ranks (several: through dash-agent's image)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        if local_world:
            with stack.rank(local_world):
                reader = ddcp.Reader(stack.dcp_job, tls=stack.tls)
        else:
            reader = ddcp.Reader(stack.dcp_job, memd=stack.listen, token_file=stack.token_file, tls=stack.tls)
        try:
            with stack.rank(local_world or 1):  # the agent is asked, and told the node's ranks, while it loads
                dcp.load(state, checkpoint_id=step, storage_reader=reader, no_dist=True)
        finally:
            reader.close()
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def restore(stack: Stack, local_world: int = 1):
        with stack.rank(local_world):
            ckpt = dashrun.Checkpointer(model=model, optimizer=optimizer, interval=10**9)
            try:
                if ckpt.restore() != step + 1:
                    raise RuntimeError("restore() did not find the checkpoint")
            finally:
                ckpt.close()

    def relaunched() -> None:
        """As in a relaunched rank: the model built (its parameters touched), the optimizer without state yet
        and no gradients (an earlier way's are let go, and with them the memory they held). DCP's load then
        gives the optimizer its state first, as in a new process (``get_state_dict`` steps it with zero
        gradients: it has nothing to load into otherwise, and would load the model alone)."""
        optimizer.state.clear()
        optimizer.zero_grad(set_to_none=True)
        gc.collect()

    # The first training step after a restore, timed apart (--first-step): a restore that maps state
    # copy-on-write (mmap=True, this node's image) leaves the copying of the optimizer's pages to it.
    step_after = benchlib.Trainer(model, optimizer, batch).step if first_step else None

    way = functools.partial(timed, after=step_after)

    times: dict[str, list[tuple[float, dict[str, float], float | None]]] = {}
    ways = {"torch.load": lambda: torch_load(False), "torch.load(mmap=True)": lambda: torch_load(True),
            "DCP load": dcp_load}
    if ram_only:  # what a state of 4 GiB leaves room for on a VM of 24: no DCP directory, torch.load alone
        ways = {"torch.load": ways["torch.load"]}
    for _ in range(rounds + 1):  # the first round warms up (page cache, buffers)
        for name, fn in ways.items():
            times.setdefault(name, []).append(way(fn, relaunched))
        for stack in stacks:
            label = "dashrun --no-tls" if stack.tls.plaintext else "dashrun"
            # A node of one rank reads the state from dash-memd's RAM straight into its tensors.
            times.setdefault(f"{label}, dash-memd RAM", []).append(
                way(lambda: restore(stack, 1), relaunched, stack))
            if ram_only:
                continue
            # A node of two ranks: the first restore fetches the image from dash-memd's RAM, the second is
            # served the image this node holds.
            times.setdefault(f"{label}, dash-memd RAM, 2-rank node", []).append(
                way(lambda: restore(stack, 2), relaunched, stack))
            times.setdefault(f"{label}, this node", []).append(way(lambda: restore(stack, 2), relaunched, stack))
            # DCP's own load, from dash-memd's RAM through dashrun.dcp.Reader in this process (no dash-agent).
            times.setdefault(f"DCP load, dashrun.dcp.Reader{label[7:]}", []).append(
                way(lambda: dcp_reader_load(stack), relaunched, stack))
            # The same as the first rank of a node of two under dashrun: dash-agent fetches the node's image.
            # Then, untimed, the other rank's load: the agent lets go of an image once both ranks have it.
            first = way(lambda: dcp_reader_load(stack, 2), relaunched, stack)
            dcp_reader_load(stack, 2)
            times.setdefault(f"DCP load, dashrun.dcp.Reader{label[7:]}, 2-rank node", []).append(first)
    for stack in () if ram_only else stacks:  # from disk: dash-memd restarted before each round, RAM empty
        label = "dashrun --no-tls" if stack.tls.plaintext else "dashrun"
        for _ in range(rounds):
            stack.restart_memd()
            times.setdefault(f"{label}, dash-memd disk", []).append(way(lambda: restore(stack), relaunched, stack))
    times = {name: t[1:] if len(t) > rounds else t for name, t in times.items()}
    if ram_only:  # the pairs need the room dash-memd's RAM and the agent's staging buffer hold
        for stack in stacks:
            procs.stop(stack.agent, timeout=60)
            procs.stop(stack.memd, timeout=60)
    loopback = benchlib.measure_loopback(nbytes, side_core, procs)
    pairs = {kind: benchlib.measure_record_pair(nbytes, side_core, procs, kind) for kind in ("sealed", "signed")}
    # The same into new memory where the relaunched rank has none: its optimizer's state
    for kind in ("sealed", "signed"):
        pairs[f"{kind}, new memory"] = benchlib.measure_record_pair(nbytes, side_core, procs, kind, fresh=fresh)
    return {"state_bytes": described["state_bytes"], "checkpoint_bytes": nbytes, "model": described,
            "loopback": loopback, "record_pairs": pairs,
            "ways": {name: summary(t, nbytes) for name, t in times.items()}, "relaunch": None,
            "_stacks": stacks, "_path": str(path)}


def measure_relaunch(result: dict, size: int, rounds: int, workdir: Path, train_core: int) -> dict:
    """From the command to restore() returning: dashrun against torchrun + torch.load, interleaved."""
    stack: Stack = result["_stacks"][0]
    script = workdir / "relaunched.py"
    script.write_text(RELAUNCHED.format(scripts=str(HERE), size=size, path=result["_path"]))
    host_port = stack.listen
    commands = {
        "torchrun + torch.load": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                  str(script), "torch.load"],
        "dashrun + restore()": [sys.executable, "-m", "dashrun", "--memd", host_port, "--token-file",
                                str(stack.token_file), "--job-id", stack.job, "--nproc-per-node", "1",
                                *stack.tls.args(), str(script), "dashrun"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    phases: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for name, cmd in commands.items():
            env = {**benchlib.child_env(), "BENCH_STARTED": repr(time.time())}
            for key in ("DASH_AGENT_SOCKET", "DASH_JOB_ID", "LOCAL_WORLD_SIZE", "DASH_NO_PREFETCH"):
                env.pop(key, None)
            out = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True,
                                 text=True, timeout=900)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESTORED")]
            if out.returncode != 0 or not lines:
                raise RuntimeError(f"{name} failed (exit {out.returncode}): {out.stderr[-2000:]}")
            _, _, total, began, imported, built = lines[-1].split()
            times[name].append(float(total))
            phases.setdefault(name, []).append({"rank_started_s": float(began), "torch_imported_s": float(imported),
                                                "model_built_s": float(built), "restored_s": float(total)})
    return {name: {"times_s": t, "best_s": min(t), "median_s": statistics.median(t), "phases": phases[name]}
            for name, t in times.items()}


def report(results: list[dict], machine: dict) -> None:
    print(f"\nmachine: {benchlib.describe_machine(machine)}")
    for r in results:
        nbytes = r["checkpoint_bytes"]
        limit = r["loopback"]["time_s"]
        print(f"\nstate {nbytes / MiB:.0f} MiB; loopback TCP limit {limit:.3f} s ({nbytes / limit / GiB:.2f} GiB/s)")
        first = "first_step_s" in r["ways"]["torch.load"]
        print(f"  {'way':46} {'best s':>8} {'median s':>9} {'GiB/s':>7} {'x limit':>8} {'x torch.load':>13}"
              + (f" {'1st step s':>11} {'both s':>7}" if first else ""))
        base = r["ways"]["torch.load"]["median_s"]
        for name, w in r["ways"].items():
            print(f"  {name:46} {w['best_s']:8.3f} {w['median_s']:9.3f} {nbytes / w['best_s'] / GiB:7.2f} "
                  f"{w['median_s'] / limit:8.2f} {w['median_s'] / base:13.2f}"
                  + (f" {w['first_step_s']:11.3f} {w['median_s'] + w['first_step_s']:7.3f}" if first else ""))
        print(f"  CPU seconds per restore (medians; the machine has {os.cpu_count()} CPUs)")
        print(f"  {'way':46} {'dash-memd':>10} {'dash-agent':>11} {'restoring':>10} {'all':>6} {'all / wall':>11}")
        for name, w in r["ways"].items():
            cpu = w["cpu_s"]
            memd, agent, restoring = (f"{cpu[label]:.2f}" if label in cpu else "-" for label in CPU_OF)
            total = sum(cpu.values())
            print(f"  {name:46} {memd:>10} {agent:>11} {restoring:>10} {total:6.2f} {total / w['median_s']:11.2f}")
        pairs = r["record_pairs"]
        print(f"  bare pairs, the same bytes into a reused buffer, sender on dash-memd's core: sealed records "
              f"{pairs['sealed']['time_s']:.3f} s, signed records (--no-tls) {pairs['signed']['time_s']:.3f} s, "
              f"plain TCP {limit:.3f} s")
        ram = {label: r["ways"].get(f"{label}, dash-memd RAM") for label in ("dashrun", "dashrun --no-tls")}
        if "sealed, new memory" in pairs:
            fresh = pairs["sealed, new memory"]
            print(f"  the pairs with their last {fresh['fresh_bytes'] / MiB:.0f} MiB (the optimizer's state) into "
                  f"memory new each round, as the relaunched rank's: sealed {fresh['time_s']:.3f} s, signed "
                  f"{pairs['signed, new memory']['time_s']:.3f} s")
        if ram["dashrun"]:
            print(f"  dash-memd RAM, one rank: {ram['dashrun']['median_s'] / pairs['sealed']['time_s']:.2f}x the "
                  f"sealed pair (target <= 1.3x)"
                  + (f", {ram['dashrun']['median_s'] / pairs['sealed, new memory']['time_s']:.2f}x the sealed pair "
                     "into new memory" if "sealed, new memory" in pairs else ""))
        if ram["dashrun --no-tls"]:
            plain = ram["dashrun --no-tls"]["median_s"]
            print(f"  dash-memd RAM, one rank, --no-tls: {plain / limit:.2f}x plain TCP (target <= 1.3x), "
                  f"{plain / pairs['signed']['time_s']:.2f}x the signed pair"
                  + (f", {plain / pairs['signed, new memory']['time_s']:.2f}x the signed pair into new memory"
                     if "signed, new memory" in pairs else ""))
        if r["relaunch"]:
            print("  relaunch, command to restore() returned:")
            base = r["relaunch"]["torchrun + torch.load"]["median_s"]
            for name, w in r["relaunch"].items():
                phase = {key: statistics.median(p[key] for p in w["phases"]) for key in w["phases"][0]}
                print(f"    {name:32} best {w['best_s']:.2f} s  median {w['median_s']:.2f} s  "
                      f"({w['median_s'] / base:.2f}x torchrun + torch.load); medians: the rank started at "
                      f"{phase['rank_started_s']:.2f} s, imported torch at {phase['torch_imported_s']:.2f} s, "
                      f"built the model at {phase['model_built_s']:.2f} s")


def measure(sizes: list[int], rounds: int, procs: benchlib.Processes, cores: tuple[int, int], *, plain: bool,
            relaunch_rounds: int = 0, first_step: bool = False, ram_only: bool = False) -> list[dict]:
    """Every way of restoring at each state size (and the relaunch at the first), in scratch directories."""
    results = []
    for index, size in enumerate(sizes):
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-restore-{size // MiB}-"))
        try:
            result = measure_size(size, rounds, workdir, procs, cores, plain, first_step, ram_only)
            if index == 0 and relaunch_rounds and not ram_only:
                result["relaunch"] = measure_relaunch(result, size, relaunch_rounds, workdir, cores[0])
            result.pop("_stacks"), result.pop("_path")
            results.append(result)
        finally:
            procs.stop_all()
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def main() -> None:
    if "--peers" in sys.argv[1:]:
        import bench_peers

        bench_peers.main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="256,1024,2048", help="state sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--relaunch-rounds", type=int, default=3, help="0: skip the relaunch comparison")
    parser.add_argument("--no-plain", action="store_true", help="skip the --no-tls rows")
    parser.add_argument("--first-step", action="store_true",
                        help="also time the first training step after each restore (what copy-on-write left to it)")
    parser.add_argument("--ram-only", action="store_true",
                        help="only torch.load, dash-memd's RAM (one rank) and the pairs, no relaunch: "
                        "what a 4 GiB state has room for")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    train_core, side_core, _separate = benchlib.placement()
    benchlib.pin_process({train_core})
    machine = benchlib.machine()
    procs = benchlib.Processes()
    try:
        results = measure([int(s) * MiB for s in args.sizes_mib.split(",")], args.rounds, procs,
                          (train_core, side_core), plain=not args.no_plain, relaunch_rounds=args.relaunch_rounds,
                          first_step=args.first_step, ram_only=args.ram_only)
    finally:
        procs.stop_all()
    report(results, machine)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main()
