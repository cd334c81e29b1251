"""What the benchmarks share: the machine's description, the children's environment, the physical limits a
figure is set against (memcpy, loopback TCP, a bare pair over dashrun's records), CPU accounting, and the
medians and units of the reports.

Processes, pinning and dash-memd/dash-agent come from the harness (``dashrun.testing``); each benchmark keeps
its own measurement. Imported by the scripts beside it (scripts/ is ``sys.path[0]`` when one runs).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dashrun.testing.daemons import DashDaemons, start_dash_daemons  # noqa: E402
from dashrun.testing.pinning import pin_process, pinned, placement  # noqa: E402
from dashrun.testing.processes import Processes  # noqa: E402

__all__ = ["CHUNK", "GiB", "MiB", "REPO", "CpuMonitor", "DashDaemons", "Processes", "Trainer", "build_model",
           "child_env", "core_busy", "describe_machine", "fmt_bw", "fmt_ms", "machine", "measure_loopback",
           "measure_memcpy", "measure_record_pair", "med", "pin_process", "pinned", "placement", "runqueue_wait",
           "start_dash_daemons", "timings"]

GiB = float(1 << 30)
MiB = float(1 << 20)
CHUNK = 8 << 20


def machine() -> dict:
    fields: dict[str, str] = {}
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "flags":
                flags = value
            elif key not in fields:  # the first processor describes them all
                fields[key] = value.strip()
    ram = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    return {"cpu": fields.get("model name", "unknown CPU"), "cpu_family": fields.get("cpu family"),
            "cpu_model": fields.get("model"), "cores": os.cpu_count(), "ram_bytes": ram, "accelerator": "CPU only",
            "virtualised": " hypervisor" in flags, "kernel": platform.release(), "python": platform.python_version()}


def describe_machine(m: dict) -> str:
    fam = f" (family {m['cpu_family']}, model {m['cpu_model']})" if m["cpu_family"] else ""
    return (f"{m['cpu']}{fam}, {m['cores']} cores, {m['ram_bytes'] / GiB:.1f} GiB RAM, "
            f"{m['accelerator']}{', VM' if m['virtualised'] else ''}")


def child_env() -> dict:
    """This environment, with the checkout importable (PYTHONPATH) in the children."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def timings(nbytes: int, times: list[float]) -> dict:
    """Repeated timings of moving ``nbytes``. The limit is the best of them (what the machine can do); the
    median, shown beside it, says how steady the machine was."""
    return {"bytes": nbytes, "times_s": times, "time_s": min(times), "bandwidth": nbytes / min(times),
            "median_bandwidth": nbytes / statistics.median(times)}


def measure_memcpy(nbytes: int, rounds: int = 5) -> dict:
    """The machine's fastest copy of ``nbytes``: torch's copy_ and libc's memcpy (which, for a copy this
    large, bypasses the cache as dashrun's staging does), alternated; the limit is the faster engine."""
    import ctypes

    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(2)  # both touched before timing
    engines = {"torch copy_": lambda: dst.copy_(src),
               "libc memcpy": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds + 1):
        for name, copy in engines.items():
            started = time.perf_counter()
            copy()
            times[name].append(time.perf_counter() - started)
    per_engine = {name: timings(nbytes, t[1:]) for name, t in times.items()}  # the first round warms up
    best = min(per_engine, key=lambda name: per_engine[name]["time_s"])
    return {**per_engine[best], "engine": best, "engines": per_engine}


_RECEIVER = textwrap.dedent("""
    import socket, sys
    n, rounds, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(n)
    view = memoryview(buf)
    for i in range(0, n, 4096):
        buf[i] = 1  # pre-touched
    conn.sendall(b"r")
    for _ in range(rounds):
        got = 0
        while got < n:
            k = conn.recv_into(view[got:], min(n - got, chunk))
            if not k:
                sys.exit(1)
            got += k
        conn.sendall(b"k")
""")


@contextlib.contextmanager
def _peer_process(name: str, code: str, args: list[str], core: int, procs: Processes):
    """A helper process of a pair, pinned to ``core``, that prints the port it listens on; yields the port."""
    proc = procs.start(name, pinned([sys.executable, "-c", code, *args], core), stdout=subprocess.PIPE)
    try:
        yield int(proc.stdout.readline())
    finally:
        procs.stop(proc, timeout=5)
        if proc.stdout:
            proc.stdout.close()


def measure_loopback(nbytes: int, core: int, procs: Processes, rounds: int = 4) -> dict:
    """Loopback TCP in 8 MiB and in 1 MiB (dash-agent's) pieces; the faster is the limit."""
    runs = [_loopback(nbytes, core, procs, rounds, chunk) for chunk in (8 << 20, 1 << 20)]
    return max(runs, key=lambda r: r["bandwidth"])


def _loopback(nbytes: int, core: int, procs: Processes, rounds: int, chunk: int) -> dict:
    import torch

    with _peer_process("tcp-receiver", _RECEIVER, [str(nbytes), str(rounds + 1), str(chunk)], core, procs) as port:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        view = memoryview(src.numpy()).cast("B")
        times = []
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sock.recv(1) != b"r":
                raise RuntimeError("TCP receiver did not start")
            for _ in range(rounds + 1):
                started = time.perf_counter()
                for start in range(0, nbytes, chunk):
                    sock.sendall(view[start:start + chunk])
                if sock.recv(1) != b"k":
                    raise RuntimeError("TCP receiver failed")
                times.append(time.perf_counter() - started)
        view.release()
        del src
    return {**timings(nbytes, times[1:]), "chunk": chunk}  # the first round warms up


_RECORD_SENDER = textwrap.dedent("""
    import socket, sys
    sys.path.insert(0, sys.argv[5])
    from dashrun.wire.sealed import Records, SignedRecords
    n, rounds, kind, keys = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    records = (Records if kind == "sealed" else SignedRecords)(conn, keys[:32], keys[32:])
    buf = bytearray(b"\\x07") * n  # touched, as dash-memd's RAM buffer is
    for _ in range(rounds):
        if conn.recv(1) != b"g":
            sys.exit(1)
        records.sendall(buf)
""")


def measure_record_pair(nbytes: int, core: int, procs: Processes, kind: str = "sealed", rounds: int = 4,
                        fresh: int = 0) -> dict:
    """The limit of a restore over dashrun's own record layer (:mod:`dashrun.wire.sealed`): a sender on ``core``
    (where dash-memd runs) seals ``nbytes`` in 1 MiB records, as dash-memd does (``kind`` "sealed": AES-128-GCM;
    "signed": the Poly1305 tags of ``--no-tls``), and this process opens them into a reused, touched buffer, as
    the restoring rank does; nothing else: no login, no frames, no checksum. ``fresh``: the last bytes of each
    round go into memory allocated that round instead (the last round's let go), as a relaunched rank's
    optimizer state, which has no memory before its restore."""
    import torch

    from dashrun.wire.sealed import MAX_RECORD, Records, SignedRecords

    keys = os.urandom(64)
    args = [str(nbytes), str(rounds + 1), kind, keys.hex(), str(REPO)]
    with _peer_process(f"{kind}-sender", _RECORD_SENDER, args, core, procs) as port:
        fresh = min(fresh, nbytes)
        dst = torch.ones(nbytes - fresh, dtype=torch.uint8)
        times = []
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            records = (Records if kind == "sealed" else SignedRecords)(sock, keys[32:], keys[:32])
            for _ in range(rounds + 1):
                started = time.perf_counter()
                new = torch.empty(fresh, dtype=torch.uint8)
                sock.sendall(b"g")
                for buffer in (dst, new):
                    view, got = memoryview(buffer.numpy()).cast("B"), 0
                    while got < len(view):
                        k = records.recv_into(view[got:], min(len(view) - got, MAX_RECORD))
                        if not k:
                            raise RuntimeError(f"the {kind} sender stopped")
                        got += k
                    view.release()
                times.append(time.perf_counter() - started)
                del new
        del dst
    return {**timings(nbytes, times[1:]), "kind": kind, "fresh_bytes": fresh}  # the first round warms up


class CpuMonitor:
    """Busy CPU time of the whole machine vs. of this benchmark's processes, over the measured phase."""

    def __init__(self, named: dict[str, int]):
        self.named = named  # label -> pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _machine(self) -> dict:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, _idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return {"busy": (user + nice + system + irq + softirq) / self.tick, "steal": steal / self.tick,
                "iowait": iowait / self.tick}

    def _ours(self) -> dict:
        import psutil

        out = {}
        me = psutil.Process()
        procs = {"benchmark (training process)": me}
        for label, pid in self.named.items():
            with contextlib.suppress(psutil.Error):
                procs[label] = psutil.Process(pid)
        for label, p in procs.items():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[label] = t.user + t.system
        with contextlib.suppress(psutil.Error):
            stage = {t.native_id for t in threading.enumerate() if t.name.startswith("dashrun-stage")}
            out["rank staging thread"] = sum(th.user_time + th.system_time for th in me.threads() if th.id in stage)
        return out

    def start(self) -> None:
        self.t0, self.m0, self.o0 = time.perf_counter(), self._machine(), self._ours()

    def stop(self) -> dict:
        wall, m1, o1 = time.perf_counter() - self.t0, self._machine(), self._ours()
        ours = {k: o1[k] - self.o0.get(k, 0.0) for k in o1}
        ours_total = sum(v for k, v in ours.items() if k != "rank staging thread")
        busy = m1["busy"] - self.m0["busy"]
        return {"wall_s": wall, "cores": os.cpu_count(), "machine_busy_s": busy,
                "steal_s": m1["steal"] - self.m0["steal"], "iowait_s": m1["iowait"] - self.m0["iowait"],
                "ours_s": ours, "foreign_s": max(0.0, busy - ours_total)}


def core_busy(core: int) -> float:
    """Busy seconds of one CPU since boot (user, nice, system, irq, softirq), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith(f"cpu{core} "):
                    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in line.split()[1:8])
                    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        pass
    return 0.0


def runqueue_wait() -> float:
    """Seconds this thread has waited for a CPU while runnable (0 where the kernel does not say)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if abs(ms) >= 99.5 else f"{ms:.1f} ms"


def fmt_bw(nbytes: float, seconds: float | None) -> str:
    return "–" if not seconds else f"{nbytes / seconds / GiB:.2f} GiB/s"


# --- the model (an MLP and its AdamW) every CPU benchmark checkpoints -----------------------------


def build_model(size_bytes: int, layers: int = 4, batch: int = 32):
    """An MLP whose fp32 params + AdamW exp_avg + exp_avg_sq hold at least ``size_bytes``."""
    import torch
    from torch import nn

    params = math.ceil(size_bytes / 12)
    width = max(64, math.ceil(math.sqrt(params / layers) / 32) * 32)
    while layers * (width * width + width) < params:
        width += 32
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        fused = True
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        fused = False
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)
    n_params = sum(p.numel() for p in model.parameters())
    return model, optimizer, (x, y), {"layers": layers, "width": width, "batch": batch, "params": n_params,
                                       "state_bytes": 12 * n_params, "adamw_fused": fused}


class Trainer:
    """One training step of the model, its gradients kept allocated between steps."""

    def __init__(self, model, optimizer, batch):
        import torch.nn.functional as F

        self.model, self.optimizer, (self.x, self.y) = model, optimizer, batch
        self._loss = F.mse_loss

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)  # grads stay allocated: no fresh pages per step
        self._loss(self.model(self.x), self.y).backward()
        self.optimizer.step()
