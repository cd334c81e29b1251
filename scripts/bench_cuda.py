#!/usr/bin/env python3
"""What a checkpoint costs a training loop on the GPU: dashrun against torch.save and DCP async_save.

One run, one model on one GPU (an MLP whose fp32 parameters and AdamW state
hold ``--size-mib``), a real dash-memd and dash-agent on loopback. Blocks of
``--interval`` steps, a checkpoint (none for the baseline) and one step more
(whose optimizer step dashrun makes wait for its copy) are interleaved
round-robin so that the machine's drift hits every variant alike; every block
ends with ``torch.cuda.synchronize()``, so a block's time includes whatever
the GPU still had to do for it.

Per variant: the stall per checkpoint (the time the training loop was blocked:
dashrun's ``ckpt.stats``, torch.save's save + fsync, async_save's call), the
added training time per checkpoint (median block time minus the baseline's),
and for dashrun the time until the checkpoint is committed in dash-memd's RAM,
from ``save()`` and from when the GPU had run the steps queued before it (the
CPU runs ahead of the GPU, and no checkpoint can leave before its state
exists), next to the physical limit: the device-to-host copy of the same bytes
into pinned memory, then loopback TCP. The training process should have the
GPU to itself.

Usage::

    python3 scripts/bench_cuda.py [--size-mib 2048] [--rounds 4] [--warmup 3] [--interval 10] [--batch 4096]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import dashrun  # noqa: E402
from dashrun.rank.staging import bytes_of  # noqa: E402
from dashrun.testing.agent import Agent  # noqa: E402
from dashrun.testing.memd import Memd  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402
from dashrun.wire.memd_client import MemdClient  # noqa: E402

GiB = float(1 << 30)


def build(size_bytes: int, batch: int, device: torch.device, layers: int = 4):
    params = math.ceil(size_bytes / 12)  # fp32 weights + AdamW's two moments
    width = max(64, math.ceil(math.sqrt(params / layers) / 64) * 64)
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
    model = nn.Sequential(*mods).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)

    def step():
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()  # AdamW's state exists from here on
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
    return model, opt, step, {"width": width, "layers": layers, "batch": batch, "state_bytes": state_bytes}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_seconds(model, opt, device: torch.device, rounds: int = 3) -> tuple[float, torch.Tensor]:
    """Best time to copy every tensor of the state into one pinned host buffer; and that buffer."""
    tensors = list(model.state_dict().values()) + [t for s in opt.state.values() for t in s.values()
                                                    if isinstance(t, torch.Tensor) and t.device == device]
    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = math.inf
    for _ in range(rounds + 1):
        sync(device)
        started, offset = time.perf_counter(), 0
        for t in tensors:
            n = t.numel() * t.element_size()
            host[offset:offset + n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            offset += n
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best, host


def loopback_seconds(data: memoryview, rounds: int = 3) -> float:
    """Best time to send ``data`` over loopback TCP into a preallocated buffer (1 MiB pieces, as dash-agent)."""
    nbytes, piece = len(data), 1 << 20
    into = bytearray(nbytes)
    into[:] = data  # touched before timing
    listener = socket.create_server(("127.0.0.1", 0))
    times: list[float] = []

    def receive():
        conn, _ = listener.accept()
        with conn:
            view = memoryview(into)
            for _ in range(rounds + 1):
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], min(piece, nbytes - got))
                    if not n:
                        return  # the sender gave up
                    got += n
                conn.sendall(b"k")

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    with socket.create_connection(listener.getsockname(), timeout=120) as sock:
        for _ in range(rounds + 1):
            started = time.perf_counter()
            for start in range(0, nbytes, piece):
                sock.sendall(data[start:start + piece])
            if sock.recv(1) != b"k":
                raise RuntimeError("the loopback receiver failed")
            times.append(time.perf_counter() - started)
    receiver.join(timeout=60)
    listener.close()
    return min(times[1:])


class Daemons:
    """dash-memd and dash-agent on loopback, as the launcher would start them (the harness's)."""

    def __init__(self, scratch: Path, memory_limit: int):
        token = scratch / "token"
        write_token(token)
        self.memd = Memd(scratch / "data", token, "--memory-limit", str(memory_limit),
                         log_path=scratch / "dash-memd.log", timeout=60, cwd=REPO).start(port=0)
        self.socket = scratch / "agent.sock"
        try:
            self.agent = Agent(self.memd, self.socket, scratch / "dash-agent.log", {"DASH_CLOUD": "none"},
                               options=(), timeout=60, cwd=REPO)
        except BaseException:
            self.memd.stop(timeout=60)  # no dash-memd left behind when the agent fails to start
            raise

    def client(self) -> MemdClient:
        return self.memd.client(timeout=120)

    def stop(self) -> None:
        self.agent.stop(timeout=60)
        self.memd.stop(timeout=60)


def measure(args, device: torch.device, model, opt, step, scratch: Path, daemons: Daemons):
    """The interleaved blocks, then the limits; returns (figures per variant, variant names, d2h s, loopback s)."""
    os.environ.update({"DASH_AGENT_SOCKET": str(daemons.socket), "DASH_JOB_ID": "bench-cuda", "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    ckpt = dashrun.Checkpointer(model=model, optimizer=opt, interval=1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.FileStore(str(scratch / "store"), 1), rank=0, world_size=1)
    results: dict[str, dict[str, list[float]]] = {}
    counter = [0]
    pending_dcp = [None]
    waiter = daemons.client()

    def torch_save():
        path = scratch / "torch.pt"
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return {}

    def dcp_save():  # the previous one is done: every block waits for its writer
        pending_dcp[0] = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                        checkpoint_id=str(scratch / f"dcp-{counter[0]}"))
        return {}

    def dashrun_save():
        started = time.perf_counter()
        ckpt.save(counter[0], force=True)
        # The state is final once the GPU has run the steps queued before save(): the CPU runs ahead of
        # the GPU, so the checkpoint cannot leave before then. Timed apart (internals, for the profile only).
        snapshot, final = ckpt._current, {}

        def until_final():
            if snapshot.gpu_ready is not None:
                snapshot.gpu_ready.synchronize()
            final["at"] = time.perf_counter()

        watcher = threading.Thread(target=until_final, daemon=True)
        watcher.start()
        return {"started": started, "step": counter[0], "final": final, "watcher": watcher}

    variants = {"no checkpoint": None, "torch.save + fsync": torch_save, "DCP async_save": dcp_save,
                "dashrun": dashrun_save}
    for rnd in range(args.warmup + args.rounds):
        for name, save in variants.items():
            sync(device)
            started = time.perf_counter()
            for _ in range(args.interval):
                step()
                counter[0] += 1
            stalled_before, stall, extra = ckpt.stats.stall_s, 0.0, {}
            if save is not None:
                before = time.perf_counter()
                extra = save()
                stall = time.perf_counter() - before
            step()  # the next step: dashrun's optimizer hook waits (on the GPU) for the side-stream copy
            if name == "dashrun":  # save() and the hook's wait, as the Checkpointer counts them
                stall = ckpt.stats.stall_s - stalled_before
            sync(device)
            record = {"block": time.perf_counter() - started, "stall": stall}
            if name == "dashrun" and waiter.wait("bench-cuda", extra["step"], 120):
                committed = time.perf_counter()
                extra["watcher"].join()
                record["ram"] = committed - extra["started"]
                record["gpu_backlog"] = extra["final"]["at"] - extra["started"]
            if name == "DCP async_save" and pending_dcp[0] is not None:
                pending_dcp[0].result()  # its writer never spills into another variant's block
            if rnd >= args.warmup:
                for key, value in record.items():
                    results.setdefault(name, {}).setdefault(key, []).append(value)
    ckpt.wait()
    restores = measure_restores(ckpt, model, opt, device, scratch)
    ckpt.close()
    d2h, host = d2h_seconds(model, opt, device)
    tcp = loopback_seconds(bytes_of(host))
    del host
    waiter.close()
    dist.destroy_process_group()
    return results, list(variants), d2h, tcp, restores


def measure_restores(ckpt, model, opt, device: torch.device, scratch: Path, rounds: int = 3
                     ) -> dict[str, list[float]]:
    """Restore times of the newest checkpoint onto the GPU: dashrun's restore() from dash-memd's RAM, against
    torch.load (and with mmap=True) of the warm torch.save file + load_state_dict."""
    def torch_load(mmap: bool):
        state = torch.load(scratch / "torch.pt", map_location=device, mmap=mmap)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    ways = {"dashrun restore() from dash-memd RAM": ckpt.restore,
            "torch.load + load_state_dict": lambda: torch_load(False),
            "torch.load(mmap=True) + load_state_dict": lambda: torch_load(True)}
    times: dict[str, list[float]] = {}
    for rnd in range(rounds + 1):  # the first round warms up
        for name, fn in ways.items():
            sync(device)
            started = time.perf_counter()
            fn()
            sync(device)
            if rnd:
                times.setdefault(name, []).append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=2048, help="parameters + AdamW state (default 2048)")
    parser.add_argument("--rounds", type=int, default=4, help="measured blocks per variant (default 4)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="blocks per variant before those (default 3: dashrun's two staging buffers and "
                             "dash-memd's pool of three are touched and pinned once, not per checkpoint)")
    parser.add_argument("--interval", type=int, default=10, help="steps per block; one checkpoint each")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model, opt, step, shape = build(int(args.size_mib * (1 << 20)), args.batch, device)
    nbytes = shape["state_bytes"]
    scratch = Path(tempfile.mkdtemp(prefix="bench-cuda-"))
    daemons = Daemons(scratch, memory_limit=4 * nbytes + (1 << 30))
    try:
        results, variants, d2h, tcp, restores = measure(args, device, model, opt, step, scratch, daemons)
    finally:
        daemons.stop()
    shutil.rmtree(scratch, ignore_errors=True)

    gib = nbytes / GiB
    name_of = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name_of}, torch {torch.__version__}; MLP {shape['layers']}x{shape['width']}, batch {shape['batch']}, "
          f"{nbytes / (1 << 20):.0f} MiB of fp32 parameters + AdamW state; a checkpoint every {args.interval} "
          f"steps; {args.rounds} blocks per variant after {args.warmup} to warm up")
    base = statistics.median(results["no checkpoint"]["block"])
    print("| | stall per checkpoint | per GiB | added training time per checkpoint | safe in dash-memd RAM after |")
    print("|---|---:|---:|---:|---:|")
    print(f"| no checkpointing | – | – | – ({args.interval + 1} steps: {base * 1e3:.0f} ms) | – |")
    for name in list(variants)[1:]:
        r = results[name]
        stall = statistics.median(r["stall"])
        added = statistics.median(r["block"]) - base
        ram = "–"
        if r.get("ram"):
            ram = (f"{statistics.median(r['ram']) * 1e3:.0f} ms; "
                   f"{statistics.median(a - b for a, b in zip(r['ram'], r['gpu_backlog'])) * 1e3:.0f} ms "
                   "after the GPU finished the step")
        print(f"| {name} | {stall * 1e3:.1f} ms | {stall * 1e3 / gib:.1f} ms | {added * 1e3:.0f} ms | {ram} |")
    print(f"| physical limit | – | – | – | {(d2h + tcp) * 1e3:.0f} ms (device-to-host into pinned memory "
          f"{gib / d2h:.1f} GiB/s, then loopback TCP {gib / tcp:.2f} GiB/s) |")
    print("| restore onto the device | best | median |")
    print("|---|---:|---:|")
    for name, times in restores.items():
        print(f"| {name} | {min(times) * 1e3:.0f} ms | {statistics.median(times) * 1e3:.0f} ms |")
    d = results["dashrun"]
    print("dashrun per block: stall " + ", ".join(f"{t * 1e3:.1f}" for t in d["stall"]) + " ms; GPU work still "
          "queued at save() " + ", ".join(f"{t * 1e3:.0f}" for t in d.get("gpu_backlog", [])) + " ms; in dash-memd "
          "RAM after " + ", ".join(f"{t * 1e3:.0f}" for t in d.get("ram", [])) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
