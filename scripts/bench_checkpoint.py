#!/usr/bin/env python3
"""Checkpointing benchmark: dashrun against torch.save and DCP async_save, side by side, in one run.

One model (an MLP whose fp32 parameters + AdamW state hold ``--size-mib``), one
training process, one run. Four variants:

* **none** — training without checkpoints (the baseline);
* **torch.save** — ``torch.save`` of model + optimizer state into a file, ``fsync``,
  rename, every ``--interval`` steps (synchronous);
* **DCP async_save** — ``torch.distributed.checkpoint.async_save`` (its default
  thread-based checkpointer and default stager, ``FileSystemWriter`` with fsync)
  on a 1-rank gloo group; the previous save's future is awaited before the next;
* **dashrun** — a real ``dash-memd`` and a real ``dash-agent`` as processes, and
  ``dashrun.Checkpointer`` in this process (``DASH_AGENT_SOCKET``/``DASH_JOB_ID``),
  over TLS as dashrun runs by default;
* **dashrun --no-tls** — the same with another pair of daemons that speak
  plaintext, so that what TLS costs is measured side by side (RAM commit time,
  added training time, and their ratio).

And, in the same run, the physical limits of the machine for the same number of
bytes: memory copy, loopback TCP (receiver in another process, on the other
core), disk write + fsync in the same directory.

Placement: the training process is pinned to the first core, dash-memd,
dash-agent and the TCP receiver to the second; ``torch.set_num_threads(1)``.

Method. Every variant is warmed up first (``--warmup`` checkpoints: buffers
allocated and touched). The measured phase is interleaved, so that the drift of
a shared or virtualised machine hits every variant alike: it is made of blocks
of ``--interval`` steps; a checkpointing block saves after its first step (a
step with ``(step + 1) % interval == 0``, as everywhere) and the rest of the
block is the training that its background work overlaps. Every checkpointing
block runs between two baseline blocks, in an order that rotates per round.
Work still running at the end of a block (DCP's writer, dash-memd's disk
write) is awaited untimed, and reported, so it never lands in another block.

Figures per variant:

* stall per checkpoint — the time the training loop was blocked by it (dashrun:
  ``ckpt.stats`` — ``save()`` plus the optimizer-hook wait for the background
  copy; torch.save: the whole save + fsync; async_save: ``async_save()`` itself
  plus any wait for the previous future);
* added training time per checkpoint — (time of the blocks with a checkpoint −
  time of as many baseline steps) / checkpoints, the baseline steps being the
  blocks right before and after each checkpointing block; with its standard
  error, and split into CPU time of the training process, the training thread's
  wait for a CPU (schedstat), and what other processes ran on the training core;
* dashrun: time from ``save()`` until the checkpoint is committed in dash-memd's
  RAM and until it is on disk (``MemdClient.wait`` from helper threads), and
  the CPU time dash-agent, dash-memd and the rank's staging thread spent.

``--fsdp``: the same MLP sharded with FSDP2 (``fully_shard``) over 2 rank processes
(gloo), against ``torch.distributed.checkpoint.save`` and DCP ``async_save`` of what an
FSDP2 job hands DCP (``get_model_state_dict``/``get_optimizer_state_dict``), in the same
interleaved run: stall per checkpoint per GiB of a rank's state (the slowest rank's),
added training time per checkpoint and their ratios (see ``run_fsdp``).

Usage::

    python3 scripts/bench_checkpoint.py [--size-mib 256] [--steps 80] [--interval 10] [--json OUT]
    python3 scripts/bench_checkpoint.py --fsdp [--size-mib 256] [--steps 80] [--interval 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchlib import (CHUNK, CpuMonitor, DashDaemons, GiB, MiB, Processes, Trainer, build_model,  # noqa: E402
                      child_env, describe_machine, fmt_bw, fmt_ms, machine, measure_loopback, measure_memcpy,
                      pin_process, pinned, placement, start_dash_daemons, timings)
from variants import PLAIN_KEY, NoCheckpoint, TorchSave, Variant, interleave, summarise  # noqa: E402

#: Steps are numbered from here, so a step number keeps its number of digits during a run.
FIRST_STEP = 1000
TARGET_STALL_MS_PER_GIB = 10.0
TARGET_ADDED_PCT_OF_TORCH_SAVE = 10.0
TARGET_RAM_COMMIT_OVER_LIMIT = 1.5
TARGET_TLS_ADDED_OVER_PLAIN = 1.3
LABELS = {"torch.save": "torch.save + fsync", "dcp": "DCP async_save", "dashrun": "dashrun",
          PLAIN_KEY: "dashrun --no-tls"}


# --- physical limits ----------------------------------------------------------------------


def measure_disk(nbytes: int, directory: Path, rounds: int = 3) -> dict:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(9)
    view = memoryview(src.numpy()).cast("B")
    times = []
    for r in range(rounds + 1):
        path = directory / f"disk-probe-{r}"
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = 0
            while written < nbytes:
                written += os.write(fd, view[written:written + CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - started)
        if r:
            (directory / f"disk-probe-{r - 1}").unlink()
    (directory / f"disk-probe-{rounds}").unlink()
    view.release()
    del src
    return timings(nbytes, times[1:])  # the first round warms up


def measure_object_store(nbytes: int, core: int, procs: Processes, scratch: Path, rounds: int = 3) -> dict | None:
    """Upload and download of one checkpoint through dash-memd's object tier to moto's S3 server on loopback."""
    import importlib.util

    if importlib.util.find_spec("moto") is None:  # its server runs as a process
        return None
    import boto3
    import torch

    from dashrun.memd.store.tiers.object import ObjectTier
    from dashrun.memd.store.tiers.signing import manifest_key
    from dashrun.wire.messages import CheckpointInfo, ShardHeader
    from dashrun.wire.protocol import crc32c

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    proc = None
    try:
        client = boto3.client("s3")

        def answers() -> bool:
            try:
                client.list_buckets()
                return True
            except Exception:
                return False
        proc = procs.start_daemon("the S3 server", pinned([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                                           "-p", str(port)], core), ready=answers,
                                  log=scratch / "moto.log")
        client.create_bucket(Bucket="bench")
        tier = ObjectTier("s3://bench/ckpt", key=manifest_key(os.urandom(32)))  # signed as dash-memd signs
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(5)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        view, target = memoryview(src.numpy()).cast("B"), memoryview(dst.numpy()).cast("B")
        shard = ShardHeader("bench", 1, 0, 1, nbytes, 0, nbytes, 0, 0, "00" * 32, crc=crc32c(view))
        up, down = [], []
        for r in range(rounds + 1):
            info = CheckpointInfo("bench", r, 1, nbytes, "00" * 32, time.time(), (dataclasses.replace(shard, step=r),))
            started = time.perf_counter()
            tier.put(info, [view])
            up.append(time.perf_counter() - started)
            started = time.perf_counter()
            tier.read_into("bench", r, 0, target, shard=info.shards[0])
            down.append(time.perf_counter() - started)
            tier.delete("bench", r)
        tier.close()
        view.release()
        target.release()
        return {"upload": timings(nbytes, up[1:]), "download": timings(nbytes, down[1:]),
                "part_size": tier.part_size, "workers": tier.workers}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if proc is not None:
            procs.stop(proc, timeout=10)


# --- the variants (none and torch.save are variants.py's, with the interleaved run) ------------------


class DcpAsyncSave(Variant):
    key = "dcp"

    def __init__(self, model, optimizer, interval: int, directory: Path, *, state=None, process_group=None):
        super().__init__()
        self.model, self.optimizer, self.interval, self.dir = model, optimizer, interval, directory
        # What is saved, and the group DCP's collectives run in: an FSDP2 job passes its sharded state dicts and
        # a group of its own (the background save's collectives must not interleave with training's).
        self.state = state or (lambda: {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})
        self.process_group = process_group
        self._future = None
        self._record: dict = {}

    def setup(self) -> None:
        import torch.distributed as dist

        self.dir.mkdir(parents=True, exist_ok=True)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.FileStore(str(self.dir / "store"), 1), rank=0, world_size=1)

    def after_step(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if (step + 1) % self.interval:
            return
        started = time.perf_counter()
        if self._future is not None:  # as its documentation says: the previous one first
            self._future.result()
        waited = time.perf_counter() - started
        record = {"step": step, "waited_previous_s": waited}
        future = self._start(dcp, step, record)
        returned = time.perf_counter()
        record["async_save_s"] = returned - started - waited
        record["stall_s"] = returned - started
        begun = started + waited

        def done(_f, record=record, begun=begun):
            record["on_disk_s"] = time.perf_counter() - begun

        future.add_done_callback(done)
        self._future, self._record = future, record
        if self.measuring:
            self.saves.append(record)

    def _start(self, dcp, step: int, record: dict):
        """Start the save of ``step``; its future (done once on disk)."""
        return dcp.async_save(self.state(), checkpoint_id=str(self.dir / f"step-{step:08d}"),
                              process_group=self.process_group)

    def quiesce(self) -> None:
        if self._future is not None:
            started = time.perf_counter()
            self._future.result()
            self._record["still_writing_at_block_end_s"] = time.perf_counter() - started

    def close(self) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            self.quiesce()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.dir, ignore_errors=True)


class Dashrun(Variant):
    key = "dashrun"

    def __init__(self, model, optimizer, interval: int, directory: Path, procs: Processes, core: int,
                 agent_core: int | None = None, *, plaintext: bool = False):
        super().__init__()
        self.model, self.optimizer, self.interval, self.dir = model, optimizer, interval, directory
        self.procs, self.core = procs, core
        self.agent_core = core if agent_core is None else agent_core
        self.plaintext = plaintext  # both daemons and the waiting clients with --no-tls
        self.key = PLAIN_KEY if plaintext else Dashrun.key
        self.job = "bench-plain" if plaintext else "bench"
        self.memd = self.agent = None
        self.ckpt = None
        self._waiters = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="bench-wait")
        self._pending: list[concurrent.futures.Future] = []
        self._clients: list = []
        self._last_record: dict | None = None
        self.stall_measured_s = 0.0
        self.snapshots_measured = 0
        self.skipped_measured = 0
        self.nbytes = None

    def setup(self) -> None:
        d = start_dash_daemons(self.dir, self.procs, self.core, self.agent_core, plaintext=self.plaintext,
                               cwd=REPO, env=child_env())
        self.memd, self.agent, self.memd_log, self.agent_log = d.memd, d.agent, d.memd_log, d.agent_log
        self.connect(d)

    def connect(self, d: DashDaemons) -> None:
        """Point this process's Checkpointer at ``d``'s dash-agent, with clients of its dash-memd for the waits."""
        import dashrun
        from dashrun import env
        from dashrun.wire.memd_client import MemdClient
        from dashrun.wire.tls import TlsSettings

        os.environ[env.AGENT_SOCKET.name] = d.socket
        os.environ[env.JOB_ID.name] = self.job
        token = Path(d.token_file).read_bytes().strip()
        self._clients = [MemdClient(d.host, d.port, token, timeout=120, tls=TlsSettings(plaintext=d.plaintext))
                         for _ in range(3)]
        self._ram_client, self._disk_client, self._info_client = self._clients
        self.ckpt = dashrun.Checkpointer(model=self.model, optimizer=self.optimizer, interval=self.interval)

    def after_step(self, step: int) -> None:
        stats = self.ckpt.stats
        if self._last_record is not None:
            # A save's stall is complete once the step after it has run its optimizer hook.
            self._last_record["stall_s"] = stats.last_stall_s
            self._last_record = None
        started = time.perf_counter()
        saved = self.ckpt.save(step)
        returned = time.perf_counter()
        if not saved:
            return
        record = {"step": step, "save_call_s": returned - started}
        snapshot = getattr(self.ckpt, "_current", None)  # internals, for the profile only
        self._last_record = record
        if self.measuring:
            self.saves.append(record)

        def wait_copy():
            if snapshot is not None and snapshot.copied.wait(120):
                record["copied_s"] = time.perf_counter() - started
            if snapshot is not None and snapshot.handed.wait(120) and snapshot.result is not None:
                with contextlib.suppress(Exception):
                    snapshot.result.result(timeout=120)
                    record["agent_ack_s"] = time.perf_counter() - started

        def wait_ram():
            if self._ram_client.wait(self.job, step, 120):
                record["ram_s"] = time.perf_counter() - started

        def wait_disk():
            if self._disk_client.wait(self.job, step, 120, on_disk=True):
                record["on_disk_s"] = time.perf_counter() - started

        self._pending = [self._waiters.submit(fn) for fn in (wait_copy, wait_ram, wait_disk)]

    def begin_block(self) -> None:
        stats = self.ckpt.stats
        self._block0 = (stats.stall_s, stats.snapshots, stats.skipped)

    def end_block(self) -> None:
        # ckpt.stats over the block: save() and the optimizer-hook waits of the block's checkpoint.
        stats = self.ckpt.stats
        if self.measuring:
            self.stall_measured_s += stats.stall_s - self._block0[0]
            self.snapshots_measured += stats.snapshots - self._block0[1]
            self.skipped_measured += stats.skipped - self._block0[2]

    def quiesce(self) -> None:
        for f in self._pending:
            f.result(timeout=300)
        self._pending = []

    def finish(self) -> None:
        self.quiesce()
        info = self._info_client.latest(self.job)
        self.nbytes = info.nbytes if info else None

    def close(self) -> None:
        from dashrun import env

        self._waiters.shutdown(wait=False, cancel_futures=True)
        if self.ckpt is not None:
            with contextlib.suppress(Exception):
                self.ckpt.close()
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        os.environ.pop(env.AGENT_SOCKET.name, None)
        os.environ.pop(env.JOB_ID.name, None)
        for proc in (self.agent, self.memd):
            if proc is not None:
                self.procs.stop(proc, timeout=60)

    def result(self) -> dict:
        return {"saves": self.saves, "checkpoint_bytes": self.nbytes,
                "stats_stall_measured_s": self.stall_measured_s, "snapshots_measured": self.snapshots_measured,
                "skipped_measured": self.skipped_measured,
                "stats": dataclasses.asdict(self.ckpt.stats) if self.ckpt else None}


# --- report ------------------------------------------------------------------------------------


def tls_cost(tls: dict, plain: dict, ratios: dict) -> None:
    """What TLS costs dashrun: its added training time and RAM commit time over those of --no-tls, printed."""
    added, added_plain = tls["added_per_checkpoint_s"], plain["added_per_checkpoint_s"]
    if added is not None and added_plain and added_plain > 0:
        ratio = added / added_plain
        ratios["tls_added_over_plain"] = ratio
        if tls["added_stderr_s"] is not None and plain["added_stderr_s"] is not None and added:
            ratios["tls_added_over_plain_stderr"] = abs(ratio) * math.hypot(tls["added_stderr_s"] / added,
                                                                            plain["added_stderr_s"] / added_plain)
    if tls["ram_median_s"] and plain["ram_median_s"]:
        ratios["tls_ram_commit_over_plain"] = tls["ram_median_s"] / plain["ram_median_s"]
    print(f"TLS against --no-tls: committed in dash-memd RAM after {fmt_ms(tls['ram_median_s'])} against "
          f"{fmt_ms(plain['ram_median_s'])} ({ratios.get('tls_ram_commit_over_plain', float('nan')):.2f}x); added "
          f"training time per checkpoint {fmt_ms(added)} against {fmt_ms(added_plain)} "
          f"({ratios.get('tls_added_over_plain', float('nan')):.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=256, help="model + AdamW state size (default 256)")
    parser.add_argument("--steps", type=int, default=80,
                        help="measured steps per variant, a multiple of --interval (default 80; more: tighter "
                             "error bars)")
    parser.add_argument("--interval", type=int, default=10, help="steps between checkpoints (default 10)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="checkpoints per variant before measuring (default 3: dash-memd's buffer pool needs "
                             "keep-ram + 1 buffers before it stops allocating; minimum 2)")
    parser.add_argument("--batch", type=int, default=32, help="batch size of the MLP (default 32)")
    parser.add_argument("--variants", default=None,
                        help=f"checkpointing variants to run besides the baseline (default: all four, "
                             f"torch.save,dcp,dashrun,{PLAIN_KEY}; {PLAIN_KEY} is dashrun with --no-tls; with "
                             f"--fsdp: {','.join(FSDP_LABELS)})")
    parser.add_argument("--fsdp", action="store_true",
                        help=f"the model sharded with FSDP2 (fully_shard) over {FSDP_WORLD} rank processes: dashrun "
                             "against DCP save and DCP async_save")
    parser.add_argument("--unpinned-daemons", action="store_true",
                        help="--fsdp: dash-memd and dash-agent not pinned, where dashrun's launcher leaves "
                             "dash-agent on a node with no more cores than ranks (default: beside the last rank)")
    parser.add_argument("--fsdp-worker", metavar="CONFIG", help=argparse.SUPPRESS)  # one rank of --fsdp
    parser.add_argument("--json", metavar="OUT", help="write every number here")
    parser.add_argument("--no-restore", action="store_true",
                        help="skip restoring the same state afterwards (scripts/bench_restore.py's ways)")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the scratch directory (logs of dash-memd...)")
    parser.add_argument("--no-s3", action="store_true",
                        help="skip the object-store figures (upload and download to a local moto S3 server)")
    parser.add_argument("--agent-on-training-core", action="store_true",
                        help="pin dash-agent to the training core instead of dash-memd's: sender and receiver on "
                             "different cores, as when dash-memd is on another machine (the agent's work then "
                             "counts against training)")
    args = parser.parse_args(argv)
    if args.fsdp_worker:
        return fsdp_worker(args.fsdp_worker)
    if args.steps < args.interval or args.steps % args.interval:
        parser.error("--steps must be a positive multiple of --interval")
    args.warmup = max(2, args.warmup)
    if args.fsdp and args.agent_on_training_core:
        parser.error("--agent-on-training-core is for the one-process variants: --fsdp has a training core per "
                     "rank and pins dash-agent beside dash-memd")
    if args.fsdp:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        procs = Processes()
        scratch = Path(tempfile.mkdtemp(prefix="dashbench-", dir="/tmp"))
        try:
            return run_fsdp(args, procs, scratch, lambda msg: print(msg, flush=True))
        finally:
            procs.stop_all()
            if args.keep_tmp:
                print(f"scratch kept in {scratch}")
            else:
                shutil.rmtree(scratch, ignore_errors=True)
    args.variants = args.variants or f"torch.save,dcp,dashrun,{PLAIN_KEY}"
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(wanted) - set(LABELS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")

    # SIGTERM unwinds like Ctrl-C, so every process this benchmark started is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    train_core, side_core, separate = placement()
    pin_process({train_core})
    import torch

    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(msg, flush=True)

    procs = Processes()
    scratch = Path(tempfile.mkdtemp(prefix="dashbench-", dir="/tmp"))
    try:
        return run(args, wanted, train_core, side_core, separate, procs, scratch, log)
    finally:
        procs.stop_all()
        if args.keep_tmp:
            print(f"scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args, wanted, train_core, side_core, separate, procs, scratch, log) -> int:
    import torch

    began = time.perf_counter()
    mach = machine()
    model, optimizer, batch, mdesc = build_model(int(args.size_mib * MiB), batch=args.batch)
    trainer = Trainer(model, optimizer, batch)
    trainer.step()  # creates the AdamW state
    state_bytes = mdesc["state_bytes"]
    rounds = args.steps // args.interval
    agent_core = train_core if args.agent_on_training_core else side_core
    where = (f"training process and dash-agent pinned to core {train_core}; dash-memd and the TCP receiver pinned "
             f"to core {side_core}" if separate and args.agent_on_training_core else
             f"training process pinned to core {train_core}; dash-memd, dash-agent and the TCP receiver pinned "
             f"to core {side_core}" if separate else f"one core only: everything shares core {train_core}")
    log(f"machine: {describe_machine(mach)}; torch {torch.__version__}, torch.set_num_threads(1)")
    log(f"placement: {where}")
    log(f"model: MLP {mdesc['layers']} x Linear({mdesc['width']}, {mdesc['width']}), batch {mdesc['batch']}, "
        f"{mdesc['params'] / 1e6:.1f}M params, AdamW{' (fused)' if mdesc['adamw_fused'] else ''}; state "
        f"{state_bytes / MiB:.1f} MiB (params + exp_avg + exp_avg_sq, fp32)")
    log(f"schedule: a checkpoint every {args.interval} steps; {args.warmup} warm-up checkpoints per variant, then "
        f"{args.steps} measured steps ({rounds} checkpoints) per variant, interleaved in blocks of {args.interval} "
        f"steps in rotating order")

    log("physical limits (same byte count, best of repeats):")
    limits = {"memcpy": measure_memcpy(state_bytes)}
    engines = limits["memcpy"]["engines"]
    log(f"  memcpy ({limits['memcpy']['engine']}, 1 thread, core {train_core}):  "
        f"{fmt_bw(state_bytes, limits['memcpy']['time_s'])} ("
        + ", ".join(f"{name} {fmt_bw(state_bytes, e['time_s'])}" for name, e in engines.items()) + ")")
    limits["loopback_tcp"] = measure_loopback(state_bytes, side_core, procs)
    log(f"  loopback TCP (core {train_core} -> core {side_core}):      "
        f"{fmt_bw(state_bytes, limits['loopback_tcp']['time_s'])}")
    limits["disk"] = measure_disk(state_bytes, scratch)
    log(f"  disk write + fsync (in {scratch}): {fmt_bw(state_bytes, limits['disk']['time_s'])}")
    if not args.no_s3:
        s3 = measure_object_store(state_bytes, side_core, procs, scratch)
        if s3 is None:
            log("  object store: skipped (moto is not installed: pip install 'moto[server]')")
        else:
            limits["object_store"] = s3
            log(f"  object tier -> moto S3 on loopback (core {side_core}): upload "
                f"{fmt_bw(state_bytes, s3['upload']['time_s'])}, "
                f"download {fmt_bw(state_bytes, s3['download']['time_s'])}")

    variants: list[Variant] = [NoCheckpoint()]
    if "torch.save" in wanted:
        variants.append(TorchSave(model, optimizer, args.interval, scratch / "torchsave"))
    if "dcp" in wanted:
        variants.append(DcpAsyncSave(model, optimizer, args.interval, scratch / "dcp"))
    dashes = [Dashrun(model, optimizer, args.interval, scratch / key, procs, side_core, agent_core,
                      plaintext=key == PLAIN_KEY) for key in ("dashrun", PLAIN_KEY) if key in wanted]
    variants += dashes
    try:
        for v in variants:
            v.setup()
        named = {}
        for dash in dashes:
            suffix = " (--no-tls)" if dash.plaintext else ""
            named.update({f"dash-memd{suffix}": dash.memd.pid, f"dash-agent{suffix}": dash.agent.pid})
            log(f"{LABELS[dash.key]}: dash-memd pid {dash.memd.pid}, dash-agent pid {dash.agent.pid} "
                f"(logs in {dash.dir})")
        log("training:")
        run_ = interleave(trainer, variants, interval=args.interval, warmup_rounds=args.warmup, rounds=rounds,
                          monitor=CpuMonitor(named), train_core=train_core, log=log)
        for dash in dashes:
            dash.finish()
        results = {v.key: v.result() for v in variants}
        summary = {v.key: summarise(v.key, v, run_) for v in variants}
    finally:
        for v in reversed(variants):
            with contextlib.suppress(Exception):
                v.close()

    report(args, mach, where, mdesc, limits, run_, results, summary, began, scratch)
    if not args.no_restore:  # restore beside save: the same state, every way of reading it back
        import bench_restore

        restored = bench_restore.measure([int(args.size_mib * MiB)], 3, procs, (train_core, side_core),
                                         plain=PLAIN_KEY in wanted)
        bench_restore.report(restored, mach)
        if args.json:
            payload = json.loads(Path(args.json).read_text())
            Path(args.json).write_text(json.dumps({**payload, "restore": restored}, indent=1, default=str))
    return 0


def report(args, mach, where, mdesc, limits, run_, results, summary, began, scratch) -> None:
    import torch

    state_bytes = mdesc["state_bytes"]
    rounds = args.steps // args.interval
    ck_bytes = (results.get("dashrun") or results.get(PLAIN_KEY) or {}).get("checkpoint_bytes") or state_bytes
    mem_t = ck_bytes / limits["memcpy"]["bandwidth"]
    tcp_t = ck_bytes / limits["loopback_tcp"]["bandwidth"]
    disk_t = ck_bytes / limits["disk"]["bandwidth"]
    base = summary["none"]
    cpu = run_["cpu"]
    print()
    print(f"baseline (no checkpointing): {base['blocks']} blocks of {args.interval} steps, {base['block_mean_s']:.2f}s "
          f"per block on average (so {args.steps} steps in {base['block_mean_s'] * rounds:.2f}s), median step "
          f"{base['step_median_s'] * 1e3:.0f} ms")
    for key in LABELS:
        if key not in summary:
            continue
        s = summary[key]
        label = LABELS[key]
        se = f" ± {fmt_ms(s['added_stderr_s'])} s.e." if s["added_stderr_s"] is not None else ""
        print(f"{label}: stall per checkpoint median {fmt_ms(s['stall_median_s'])} (mean {fmt_ms(s['stall_mean_s'])},"
              f" max {fmt_ms(s['stall_max_s'])}); added training time per checkpoint "
              f"{fmt_ms(s['added_per_checkpoint_s'])}{se} (median {fmt_ms(s['added_paired_median_s'])}; "
              "against all baseline blocks "
              f"{fmt_ms(s['added_vs_all_baseline_blocks_s'])}); on disk after "
              f"{fmt_ms(s['on_disk_median_s'])}")
        print(f"  of the added time per checkpoint: CPU time of the training process "
              f"{fmt_ms(s.get('added_process_cpu_s_per_checkpoint'))} (training thread "
              f"{fmt_ms(s.get('added_train_thread_cpu_s_per_checkpoint'))}), the training thread waiting for a "
              f"CPU {fmt_ms(s.get('added_train_thread_runqueue_s_per_checkpoint'))}; other processes on the training "
              f"core {fmt_ms(s.get('added_others_on_core_s_per_checkpoint'))}")
        if key == "dcp":
            print(f"  async_save() blocks {fmt_ms(s['async_save_median_s'])}; wait for the previous future at most "
                  f"{fmt_ms(s['waited_previous_max_s'])}; still writing at the end of its block (awaited untimed): "
                  f"median {fmt_ms(s['still_writing_at_block_end_median_s'])}")
        if key in ("dashrun", PLAIN_KEY):
            r = results[key]
            print(f"  stall = save() {fmt_ms(s['save_call_median_s'])} + optimizer-hook wait "
                  f"{fmt_ms(s['hook_wait_median_s'])} (medians); ckpt.stats over the measured blocks: "
                  f"{fmt_ms(r['stats_stall_measured_s'] / max(1, r['snapshots_measured']))} per snapshot; "
                  f"snapshots {r['snapshots_measured']}, skipped {r['skipped_measured']}, failed "
                  f"{r['stats']['failed'] if r['stats'] else '?'}")
            print(f"  {ck_bytes / MiB:.1f} MiB per checkpoint; after save(): background copy done "
                  f"{fmt_ms(s['copied_median_s'])}, committed in dash-memd RAM {fmt_ms(s['ram_median_s'])} "
                  f"({fmt_bw(ck_bytes, s['ram_median_s'])}), agent's ack to the rank {fmt_ms(s['agent_ack_median_s'])},"
                  f" on disk {fmt_ms(s['on_disk_median_s'])} ({fmt_bw(ck_bytes, s['on_disk_median_s'])})")
            n = max(1, r["snapshots_measured"])
            suffix = " (--no-tls)" if key == PLAIN_KEY else ""
            print("  CPU time per checkpoint (whole measured phase / its checkpoints): " + ", ".join(
                f"{k} {cpu['ours_s'][k] / n * 1e3:.0f} ms" for k in (f"dash-agent{suffix}", f"dash-memd{suffix}")
                if k in cpu["ours_s"]) + (f"; the rank staging threads of both dashrun variants "
                                          f"{cpu['ours_s']['rank staging thread'] * 1e3:.0f} ms in all"
                                          if "rank staging thread" in cpu["ours_s"] else ""))
    print(f"physical limits for {ck_bytes / MiB:.1f} MiB (best of repeats; median in brackets): memcpy "
          f"{fmt_ms(mem_t)} ({limits['memcpy']['bandwidth'] / GiB:.2f} GiB/s; "
          f"{limits['memcpy']['median_bandwidth'] / GiB:.2f}), loopback TCP {fmt_ms(tcp_t)} "
          f"({limits['loopback_tcp']['bandwidth'] / GiB:.2f} GiB/s; "
          f"{limits['loopback_tcp']['median_bandwidth'] / GiB:.2f})"
          f", disk write+fsync {fmt_ms(disk_t)} ({limits['disk']['bandwidth'] / GiB:.2f} GiB/s; "
          f"{limits['disk']['median_bandwidth'] / GiB:.2f})")
    foreign_pct = 100 * cpu["foreign_s"] / (cpu["wall_s"] * cpu["cores"])
    print(f"machine load during the measured phase ({cpu['wall_s']:.0f}s): CPU used by other processes "
          f"{cpu['foreign_s']:.1f}s = {foreign_pct:.0f}% of {cpu['cores']} cores, steal {cpu['steal_s']:.1f}s"
          + ("  -- WARNING: the machine was shared; figures are noisy" if foreign_pct > 5 else ""))

    ratios: dict = {}
    if "dashrun" in summary:
        d = summary["dashrun"]
        ratios["stall_ms_per_gib"] = d["stall_median_s"] * 1e3 / (ck_bytes / GiB)
        ratios["stall_mean_ms_per_gib"] = d["stall_mean_s"] * 1e3 / (ck_bytes / GiB)
        ts = summary.get("torch.save")
        if ts and ts["added_per_checkpoint_s"] and ts["added_per_checkpoint_s"] > 0:
            ratios["added_pct_of_torch_save"] = 100 * d["added_per_checkpoint_s"] / ts["added_per_checkpoint_s"]
            if ts["added_paired_median_s"] and ts["added_paired_median_s"] > 0:
                ratios["added_paired_median_pct_of_torch_save"] = (100 * d["added_paired_median_s"]
                                                                   / ts["added_paired_median_s"])
        if d["ram_median_s"]:
            ratios["ram_commit_over_limit"] = d["ram_median_s"] / (mem_t + tcp_t)
        if d["on_disk_median_s"]:
            ratios["on_disk_over_limit"] = d["on_disk_median_s"] / (mem_t + tcp_t + disk_t)
        added_se_pct = None
        if "added_pct_of_torch_save" in ratios and d["added_stderr_s"] is not None:
            added_se_pct = 100 * d["added_stderr_s"] / summary["torch.save"]["added_per_checkpoint_s"]
            ratios["added_pct_stderr"] = added_se_pct
        notes = []
        if added_se_pct is not None:
            notes.append(f"± {added_se_pct:.1f} s.e.")
        if "added_paired_median_pct_of_torch_save" in ratios:
            notes.append(f"median {ratios['added_paired_median_pct_of_torch_save']:.1f}")
        checks = [
            ("dashrun stall per checkpoint, ms per GiB", ratios.get("stall_ms_per_gib"), TARGET_STALL_MS_PER_GIB,
             f"median; mean {ratios['stall_mean_ms_per_gib']:.1f}", None),
            ("dashrun added training time per checkpoint, % of torch.save's", ratios.get("added_pct_of_torch_save"),
             TARGET_ADDED_PCT_OF_TORCH_SAVE, "; ".join(notes), added_se_pct),
            ("dashrun RAM commit / (memcpy + loopback TCP)", ratios.get("ram_commit_over_limit"),
             TARGET_RAM_COMMIT_OVER_LIMIT, "", None),
        ]
        p = summary.get(PLAIN_KEY)
        if p is not None:
            tls_cost(d, p, ratios)
            checks.append(("dashrun added training time per checkpoint, TLS / --no-tls",
                           ratios.get("tls_added_over_plain"), TARGET_TLS_ADDED_OVER_PLAIN,
                           f"{fmt_ms(d['added_per_checkpoint_s'])} / {fmt_ms(p['added_per_checkpoint_s'])}",
                           ratios.get("tls_added_over_plain_stderr")))
        ratios["targets"] = {}
        print()
        print("targets:")
        for label, value, target, note, se in checks:
            ok = value is not None and value <= target
            unresolved = se is not None and value is not None and abs(value - target) < 2 * se
            ratios["targets"][label] = {"value": value, "target": target, "met": ok, "note": note,
                                        "within_2_stderr_of_target": unresolved}
            shown = "n/a" if value is None else f"{value:.2f}"
            verdict = "MET" if ok else "MISSED" if value is not None else "not measured"
            if unresolved:
                verdict += " (within 2 s.e. of the target: not resolved by this run)"
            print(f"  {label}: {shown}{f' ({note})' if note else ''}; target <= {target:g}: {verdict}")
        if "on_disk_over_limit" in ratios:
            print(f"  (not a target) dashrun on disk / (memcpy + loopback TCP + disk): "
                  f"{ratios['on_disk_over_limit']:.2f}")

    md = [(f"Machine: {describe_machine(mach)}; {where}. Model: MLP {mdesc['layers']} x {mdesc['width']}², "
           f"AdamW; {state_bytes / MiB:.0f} MiB of state"
           f"{f', {ck_bytes / MiB:.1f} MiB per dashrun checkpoint' if 'dashrun' in summary else ''}. A "
           f"checkpoint every {args.interval} steps ({args.interval} x {base['step_median_s'] * 1e3:.0f} ms); "
           f"{rounds} checkpoints per variant measured after {args.warmup} warm-up ones, variants interleaved. "
            f"torch {torch.__version__}. Other processes used {foreign_pct:.0f}% of the CPUs meanwhile."),
          "",
          "| | stall per checkpoint | added training time per checkpoint | safe in remote RAM after "
          "| safe on disk after |",
          "|---|---:|---:|---:|---:|",
          f"| no checkpointing | – | – ({args.steps} steps: {base['block_mean_s'] * rounds:.1f} s) | – | – |"]
    if "torch.save" in summary:
        s = summary["torch.save"]
        md.append(f"| `torch.save` + fsync | {fmt_ms(s['stall_median_s'])} | {fmt_ms(s['added_per_checkpoint_s'])} "
                  f"| – | {fmt_ms(s['on_disk_median_s'])} |")
    if "dcp" in summary:
        s = summary["dcp"]
        md.append(f"| DCP `async_save` | {fmt_ms(s['stall_median_s'])} | {fmt_ms(s['added_per_checkpoint_s'])} "
                  f"| – | {fmt_ms(s['on_disk_median_s'])} |")
    for key, label in (("dashrun", "**dashrun**"), (PLAIN_KEY, "dashrun `--no-tls`")):
        if key not in summary:
            continue
        s = summary[key]
        md.append(f"| {label} | {fmt_ms(s['stall_median_s'])} | {fmt_ms(s['added_per_checkpoint_s'])} | "
                  f"{fmt_ms(s['ram_median_s'])} ({fmt_bw(ck_bytes, s['ram_median_s'])}) | "
                  f"{fmt_ms(s['on_disk_median_s'])} ({fmt_bw(ck_bytes, s['on_disk_median_s'])}) |")
    md.append(f"| physical limit | – | – | {fmt_ms(mem_t + tcp_t)} (memcpy {fmt_bw(ck_bytes, mem_t)}, then "
              f"loopback TCP {fmt_bw(ck_bytes, tcp_t)}) | {fmt_ms(mem_t + tcp_t + disk_t)} (then disk write+fsync "
              f"{fmt_bw(ck_bytes, disk_t)}) |")
    if "object_store" in limits:
        s3 = limits["object_store"]
        tcp_bw = limits["loopback_tcp"]["bandwidth"]
        md += ["", f"Object tier, one {state_bytes / MiB:.0f} MiB checkpoint to moto's S3 server on loopback "
                   f"({s3['part_size'] >> 20} MiB parts, {s3['workers']} at a time, CRC-32C checked both ways; best "
                   f"of {len(s3['upload']['times_s'])}):",
               "", "| | bandwidth | vs loopback TCP |", "|---|---:|---:|",
               f"| upload (`put`) | {s3['upload']['bandwidth'] / GiB:.2f} GiB/s | "
               f"{s3['upload']['bandwidth'] / tcp_bw:.2f}x |",
               f"| download (`read_into`) | {s3['download']['bandwidth'] / GiB:.2f} GiB/s | "
               f"{s3['download']['bandwidth'] / tcp_bw:.2f}x |",
               f"| loopback TCP (raw) | {tcp_bw / GiB:.2f} GiB/s | 1x |"]
    if ratios.get("targets"):
        md += ["", "| target | measured | met |", "|---|---:|---|"]
        for label, t in ratios["targets"].items():
            v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
            met = "yes" if t["met"] else "no" if t["value"] is not None else "not measured"
            if t["within_2_stderr_of_target"]:
                met += " (within 2 s.e.)"
            note = f" ({t['note']})" if t["note"] else ""
            md.append(f"| {label} <= {t['target']:g} | {v}{note} | {met} |")
    print()
    print("\n".join(md))
    print()
    print(f"(benchmark took {time.perf_counter() - began:.0f} s)")

    if args.json:
        payload = {"machine": mach, "placement": where, "model": mdesc, "interval": args.interval,
                   "steps": args.steps, "warmup_checkpoints": args.warmup, "limits": limits,
                   "interleaved": {k: v for k, v in run_.items()}, "variants": results, "summary": summary,
                   "ratios": ratios, "checkpoint_bytes": ck_bytes, "markdown": "\n".join(md)}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        print(f"wrote {args.json}")


# --- FSDP2 on 2 ranks ----------------------------------------------------------------------------
#
# ``--fsdp``: the same MLP, sharded with ``fully_shard`` over 2 rank processes (gloo), each running the interleaved
# blocks above in lockstep (FSDP's collectives keep them together). Variants: none, DCP ``save`` (synchronous),
# DCP ``async_save`` (its default thread), dashrun. DCP gets what an FSDP2 job hands it (``get_model_state_dict``
# and ``get_optimizer_state_dict``: sharded, by parameter name) and a gloo group of its own, as torchtitan does; the
# Checkpointer gets the model and the optimizer. One dash-memd and one dash-agent serve both ranks, as on one node.

FSDP_WORLD = 2
FSDP_JOB = "bench-fsdp"
FSDP_LABELS = {"dcp.save": "DCP save", "dcp": "DCP async_save", "dcp.stager": "DCP async_save + DefaultStager",
               "dashrun": "dashrun"}
TARGET_ADDED_PCT_OF_DCP_SAVE = 10.0
TARGET_ADDED_OVER_ASYNC_SAVE = 0.5
TARGET_STALL_OVER_ASYNC_SAVE = 1.0


def fsdp_state(model, optimizer):
    """What an FSDP2 job hands DCP: its sharded model and optimizer state dicts, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return lambda: {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


class DcpSave(Variant):
    """``torch.distributed.checkpoint.save`` (synchronous, FileSystemWriter with fsync): the stall is the save."""

    key = "dcp.save"

    def __init__(self, interval: int, directory: Path, *, state, process_group=None):
        super().__init__()
        self.interval, self.dir, self.state, self.process_group = interval, directory, state, process_group

    def setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def after_step(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if (step + 1) % self.interval:
            return
        started = time.perf_counter()
        dcp.save(self.state(), checkpoint_id=str(self.dir / f"step-{step:08d}"), process_group=self.process_group)
        stall = time.perf_counter() - started
        if self.measuring:
            self.saves.append({"step": step, "stall_s": stall, "on_disk_s": stall})

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def prune_checkpoints(directory: Path, keep: int = 1) -> None:
    """Remove all but the newest ``keep`` step directories (untimed, between blocks): bounded disk use."""
    steps = sorted(p for p in directory.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class FsdpDcpAsyncSave(DcpAsyncSave):
    def quiesce(self) -> None:
        super().quiesce()
        if int(os.environ.get("RANK", "0")) == 0:  # both ranks' files of a step are complete once its future is
            prune_checkpoints(self.dir, keep=2)


class FsdpDcpStagedAsyncSave(FsdpDcpAsyncSave):
    """DCP ``async_save`` with the stager torch makes for it (``DefaultStager``: pinned memory where CUDA is —
    not on CPU —, shared memory, the copy on a thread of its own): ``async_save`` returns once the copy has
    started; the next ``optimizer.step()`` waits for the copy to finish (the state must not change under it),
    and that wait counts in the stall, as dashrun's optimizer hook's does."""

    key = "dcp.stager"

    def setup(self) -> None:
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().setup()
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))
        self._staging = None
        self._hook = self.optimizer.register_step_pre_hook(self._wait_for_copy)

    def _start(self, dcp, step: int, record: dict):
        response = dcp.async_save(self.state(), checkpoint_id=str(self.dir / f"step-{step:08d}"),
                                  process_group=self.process_group, async_stager=self.stager)
        self._staging = (response.staging_completion, record)
        return response.upload_completion

    def _wait_for_copy(self, *_args) -> None:
        if self._staging is None:
            return
        staging, record = self._staging
        self._staging = None
        started = time.perf_counter()
        staging.result()
        record["copy_wait_s"] = waited = time.perf_counter() - started
        record["stall_s"] += waited

    def close(self) -> None:
        self._wait_for_copy()
        self._hook.remove()
        super().close()
        self.stager.close()


class FsdpDcpSave(DcpSave):
    def quiesce(self) -> None:
        if int(os.environ.get("RANK", "0")) == 0:  # dcp.save ends with a collective: every rank's files are there
            prune_checkpoints(self.dir, keep=1)


class FsdpDashrun(Dashrun):
    """dashrun in one rank of the job: the daemons are the benchmark's (shared by the ranks, as on one node)."""

    def __init__(self, model, optimizer, interval: int, directory: Path, daemons: DashDaemons):
        super().__init__(model, optimizer, interval, directory, procs=None, core=0, plaintext=daemons.plaintext)
        self.key, self.job, self.daemons = Dashrun.key, FSDP_JOB, daemons

    def setup(self) -> None:
        self.connect(self.daemons)


def local_state_bytes(model, optimizer) -> int:
    """Bytes of this rank's shards of the parameters and the optimizer state (what it stages)."""
    import torch
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p) for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def fsdp_worker(config_path: str) -> int:
    """One rank of the FSDP2 benchmark (started by ``run_fsdp``): trains, measures, writes its figures as JSON."""
    config = json.loads(Path(config_path).read_text())
    rank = int(os.environ["RANK"])
    core = config["rank_cores"][rank]
    pin_process({core})
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dcp_group = dist.new_group(backend="gloo")  # DCP's collectives apart from training's (as torchtitan does)
    model, _, batch, mdesc = build_model(int(config["size_bytes"]), batch=config["batch"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # after fully_shard: over the sharded parameters
    mdesc["adamw_fused"] = False
    trainer = Trainer(model, optimizer, batch)
    trainer.step()  # creates the AdamW state
    scratch = Path(config["scratch"])
    state = fsdp_state(model, optimizer)
    variants: list[Variant] = [NoCheckpoint()]
    if "dcp.save" in config["variants"]:
        variants.append(FsdpDcpSave(config["interval"], scratch / "dcp-save", state=state, process_group=dcp_group))
    if "dcp" in config["variants"]:
        variants.append(FsdpDcpAsyncSave(model, optimizer, config["interval"], scratch / "dcp-async", state=state,
                                         process_group=dcp_group))
    if "dcp.stager" in config["variants"]:
        variants.append(FsdpDcpStagedAsyncSave(model, optimizer, config["interval"], scratch / "dcp-staged",
                                               state=state, process_group=dcp_group))
    if "dashrun" in config["variants"]:
        variants.append(FsdpDashrun(model, optimizer, config["interval"], scratch / "dashrun",
                                    DashDaemons(**config["daemons"])))

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    try:
        for v in variants:
            v.setup()
        run_ = interleave(trainer, variants, interval=config["interval"], warmup_rounds=config["warmup"],
                          rounds=config["rounds"], monitor=CpuMonitor(config["daemon_pids"]), train_core=core,
                          log=log)
        for v in variants:
            if isinstance(v, Dashrun):
                v.finish()
        results = {v.key: v.result() for v in variants}
        summary = {v.key: summarise(v.key, v, run_) for v in variants}
    finally:
        for v in reversed(variants):
            with contextlib.suppress(Exception):
                v.close()
    payload = {"rank": rank, "core": core, "model": mdesc, "local_state_bytes": local_state_bytes(model, optimizer),
               "run": run_, "results": results, "summary": summary}
    Path(config["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(payload, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def run_fsdp(args, procs: Processes, scratch: Path, log) -> int:
    """The FSDP2 benchmark: daemons here, 2 rank processes that train and measure, their figures reported here."""
    import torch

    began = time.perf_counter()
    mach = machine()
    cores = sorted(os.sched_getaffinity(0))
    rank_cores = [cores[r % len(cores)] for r in range(FSDP_WORLD)]
    side_core = cores[FSDP_WORLD] if len(cores) > FSDP_WORLD else cores[-1]
    where = (f"rank 0 and rank 1 pinned to cores {rank_cores[0]} and {rank_cores[1]}; " + (
        "dash-memd and dash-agent not pinned (as dashrun's launcher leaves dash-agent on a node with no core to "
        "spare)" if args.unpinned_daemons else
        f"dash-memd and dash-agent pinned to core {side_core}" + ("" if len(cores) > FSDP_WORLD else
                                                                  f" (only {len(cores)} cores: shared with rank 1)")))
    wanted = [v.strip() for v in (args.variants or ",".join(FSDP_LABELS)).split(",") if v.strip()]
    unknown = set(wanted) - set(FSDP_LABELS)
    if unknown:
        raise SystemExit(f"--fsdp: unknown variants {', '.join(sorted(unknown))} (these: {', '.join(FSDP_LABELS)})")
    rounds = args.steps // args.interval
    log(f"machine: {describe_machine(mach)}; torch {torch.__version__}, torch.set_num_threads(1) per rank")
    log(f"FSDP2 on {FSDP_WORLD} ranks (gloo, fully_shard per Linear and on the root); placement: {where}")
    log(f"schedule: a checkpoint every {args.interval} steps; {args.warmup} warm-up checkpoints per variant, then "
        f"{args.steps} measured steps ({rounds} checkpoints) per variant, interleaved")
    daemons = None
    if "dashrun" in wanted:
        daemon_core = None if args.unpinned_daemons else side_core
        daemons = start_dash_daemons(scratch / "daemons", procs, daemon_core, daemon_core, cwd=REPO, env=child_env())
        log(f"dashrun: dash-memd pid {daemons.memd.pid}, dash-agent pid {daemons.agent.pid} (logs in "
            f"{scratch / 'daemons'})")
    out = scratch / "results"
    out.mkdir()
    config = {"size_bytes": int(args.size_mib * MiB), "batch": args.batch, "interval": args.interval,
              "warmup": args.warmup, "rounds": rounds, "variants": wanted, "scratch": str(scratch),
              "rank_cores": rank_cores, "out": str(out), "daemons": daemons.to_json() if daemons else None,
              "daemon_pids": {"dash-memd": daemons.memd.pid, "dash-agent": daemons.agent.pid} if daemons else {}}
    config_path = scratch / "fsdp.json"
    config_path.write_text(json.dumps(config))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = probe.getsockname()[1]
    ranks = []
    for rank in range(FSDP_WORLD):
        env = {**child_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(FSDP_WORLD),
               "LOCAL_WORLD_SIZE": str(FSDP_WORLD), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master_port)}
        cmd = pinned([sys.executable, str(Path(__file__).resolve()), "--fsdp-worker", str(config_path)],
                     rank_cores[rank])
        # rank 0 speaks on this terminal (its progress); rank 1 into a log
        extra = {"stdout": None} if rank == 0 else {"log": scratch / f"rank{rank}.log"}
        ranks.append(procs.start(f"rank {rank}", cmd, cwd=REPO, env=env, **extra))
    # Steps take longer as the state grows (the model is the state): the deadline grows with both.
    deadline = time.monotonic() + max(600.0, 20.0 * args.steps) * max(1.0, args.size_mib / 256)
    while any(p.poll() is None for p in ranks) and not any(p.returncode for p in ranks):
        if time.monotonic() > deadline:
            raise SystemExit("--fsdp: the ranks did not finish in time")
        time.sleep(0.2)  # polling child processes, not synchronising with them
    failed = [r for r, p in enumerate(ranks) if p.returncode]
    if failed:
        for p in ranks:
            procs.stop(p, timeout=10)
        tail = (scratch / "rank1.log").read_text(errors="replace")[-3000:] if (scratch / "rank1.log").exists() else ""
        raise SystemExit(f"--fsdp: rank {failed[0]} failed (exit {ranks[failed[0]].returncode}); rank 1's log:\n{tail}")
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(FSDP_WORLD)]
    report_fsdp(args, mach, where, per_rank, began)
    return 0


def report_fsdp(args, mach, where, per_rank: list[dict], began: float) -> None:
    import torch

    rank0 = per_rank[0]
    summary, mdesc = rank0["summary"], rank0["model"]
    local = max(r["local_state_bytes"] for r in per_rank)
    rounds = args.steps // args.interval
    base = summary["none"]

    def stall(key: str) -> float | None:
        """The slowest rank's median stall: a collective makes the others wait for it."""
        values = [r["summary"][key]["stall_median_s"] for r in per_rank if r["summary"][key]["stall_median_s"]]
        return max(values) if values else None

    print()
    print(f"FSDP2, {FSDP_WORLD} ranks: MLP {mdesc['layers']} x Linear({mdesc['width']}, {mdesc['width']}), "
          f"{mdesc['state_bytes'] / MiB:.1f} MiB of state in all, {local / MiB:.1f} MiB per rank (params + AdamW "
          f"exp_avg + exp_avg_sq, fp32); baseline block {base['block_mean_s']:.2f}s ({args.interval} steps)")
    for key, label in FSDP_LABELS.items():
        if key not in summary:
            continue
        s = summary[key]
        se = f" ± {fmt_ms(s['added_stderr_s'])} s.e." if s["added_stderr_s"] is not None else ""
        stalls = ", ".join(f"rank {r['rank']} {fmt_ms(r['summary'][key]['stall_median_s'])}" for r in per_rank)
        print(f"{label}: stall per checkpoint (median) {stalls}; added training time per checkpoint "
              f"{fmt_ms(s['added_per_checkpoint_s'])}{se} (median {fmt_ms(s['added_paired_median_s'])}); on disk "
              f"after {fmt_ms(s['on_disk_median_s'])}")
        if key == "dashrun":
            r = rank0["results"][key]
            print(f"  stall = save() {fmt_ms(s['save_call_median_s'])} + optimizer-hook wait "
                  f"{fmt_ms(s['hook_wait_median_s'])} (rank 0, medians); snapshots {r['snapshots_measured']}, "
                  f"skipped {r['skipped_measured']}; committed in dash-memd RAM after {fmt_ms(s['ram_median_s'])}"
                  + (f" ({r['checkpoint_bytes'] / MiB:.1f} MiB per checkpoint)" if r["checkpoint_bytes"] else ""))

    ratios: dict = {}
    checks = []
    d, ds = summary.get("dashrun"), summary.get("dcp.save")
    if d:
        ratios["stall_ms_per_gib_local"] = stall("dashrun") * 1e3 / (local / GiB) if stall("dashrun") else None
        checks.append(("dashrun stall per checkpoint, ms per GiB of a rank's state",
                       ratios["stall_ms_per_gib_local"], TARGET_STALL_MS_PER_GIB, "slowest rank's median"))
        if ds and ds["added_per_checkpoint_s"] and ds["added_per_checkpoint_s"] > 0:
            ratios["added_pct_of_dcp_save"] = 100 * d["added_per_checkpoint_s"] / ds["added_per_checkpoint_s"]
            note = (f"± {100 * d['added_stderr_s'] / ds['added_per_checkpoint_s']:.1f} s.e."
                    if d["added_stderr_s"] is not None else "")
            checks.append(("dashrun added training time per checkpoint, % of DCP save's",
                           ratios["added_pct_of_dcp_save"], TARGET_ADDED_PCT_OF_DCP_SAVE, note))
        for key in ("dcp", "dcp.stager"):
            da = summary.get(key)
            label = FSDP_LABELS[key]
            if da and da["added_per_checkpoint_s"] and da["added_per_checkpoint_s"] > 0:
                ratios[f"added_over_{key}"] = d["added_per_checkpoint_s"] / da["added_per_checkpoint_s"]
                checks.append((f"dashrun added training time per checkpoint / {label}'s",
                               ratios[f"added_over_{key}"], TARGET_ADDED_OVER_ASYNC_SAVE,
                               f"{fmt_ms(d['added_per_checkpoint_s'])} / {fmt_ms(da['added_per_checkpoint_s'])}"))
            if da and stall("dashrun") and stall(key):
                ratios[f"stall_over_{key}"] = stall("dashrun") / stall(key)
                checks.append((f"dashrun stall per checkpoint / {label}'s", ratios[f"stall_over_{key}"],
                               TARGET_STALL_OVER_ASYNC_SAVE, f"{fmt_ms(stall('dashrun'))} / {fmt_ms(stall(key))}"))
    ratios["targets"] = {}
    if checks:
        print()
        print("targets:")
    for label, value, target, note in checks:
        ok = value is not None and value <= target
        ratios["targets"][label] = {"value": value, "target": target, "met": ok, "note": note}
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"  {label}: {shown}{f' ({note})' if note else ''}; target <= {target:g}: "
              f"{'MET' if ok else 'MISSED' if value is not None else 'not measured'}")

    md = [(f"Machine: {describe_machine(mach)}; {where}. FSDP2 on {FSDP_WORLD} ranks (gloo): MLP {mdesc['layers']} x "
           f"{mdesc['width']}², AdamW; {mdesc['state_bytes'] / MiB:.0f} MiB of state, {local / MiB:.0f} MiB per rank. "
           f"A checkpoint every {args.interval} steps ({args.interval} x {base['step_median_s'] * 1e3:.0f} ms); "
           f"{rounds} checkpoints per variant measured after {args.warmup} warm-up ones, variants interleaved. "
           f"torch {torch.__version__}."),
          "",
          "| | stall per checkpoint (slowest rank) | added training time per checkpoint | safe in remote RAM after "
          "| safe on disk after |",
          "|---|---:|---:|---:|---:|",
          f"| no checkpointing | – | – ({args.steps} steps: {base['block_mean_s'] * rounds:.1f} s) | – | – |"]
    for key, label in (("dcp.save", "DCP `save`"), ("dcp", "DCP `async_save`"),
                       ("dcp.stager", "DCP `async_save` + `DefaultStager`"), ("dashrun", "**dashrun**")):
        if key in summary:
            s = summary[key]
            md.append(f"| {label} | {fmt_ms(stall(key))} | {fmt_ms(s['added_per_checkpoint_s'])} | "
                      f"{fmt_ms(s.get('ram_median_s'))} | {fmt_ms(s['on_disk_median_s'])} |")
    if ratios["targets"]:
        md += ["", "| target | measured | met |", "|---|---:|---|"]
        for label, t in ratios["targets"].items():
            v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
            met = "yes" if t["met"] else "no" if t["value"] is not None else "not measured"
            note = f" ({t['note']})" if t["note"] else ""
            md.append(f"| {label} <= {t['target']:g} | {v}{note} | {met} |")
    print()
    print("\n".join(md))
    print()
    print(f"(benchmark took {time.perf_counter() - began:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": mach, "placement": where, "fsdp_world": FSDP_WORLD,
                                               "interval": args.interval, "steps": args.steps,
                                               "warmup_checkpoints": args.warmup, "ranks": per_rank,
                                               "ratios": ratios, "markdown": "\n".join(md)}, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
