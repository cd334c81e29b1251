#!/usr/bin/env python3
"""The rank's staging copy: streaming stores with the checksum (dashrun.util._ntcopy) against torch's copy_.

The rank copies the model and optimizer state into its shared-memory buffer
on the training core while training goes on. This benchmark copies the same
bytes as ``bench_checkpoint.py`` (an MLP's 4 weight matrices and their two
AdamW moments, 257 MiB) in the stager's pieces into a memfd, alternating the
two engines round by round, pinned to one core, and prints the median CPU
time of each and their ratio. Then it repeats the comparison while a
memory-bound loop (a large copy) runs on the other core, as dash-agent and
dash-memd do while a checkpoint streams, and reports how many bytes that loop
moved meanwhile: what the staging copy takes from the rest of the machine.
Linux only (CPU affinity, memfd).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dashrun.rank import staging  # noqa: E402
from dashrun.rank.stager import PIECE  # noqa: E402


def state(size_mib: int, layers: int = 4) -> list[torch.Tensor]:
    """The benchmark MLP's weights and AdamW moments as flat byte tensors (touched)."""
    side = int(((size_mib << 20) / (layers * 3 * 4)) ** 0.5)
    return [torch.full((side * side * 4,), k, dtype=torch.uint8) for k in range(layers * 3)]


def stage_all(tensors: list[torch.Tensor], dst: torch.Tensor, streaming: bool) -> float:
    staging.streaming = streaming
    started = time.thread_time()
    offset = 0
    for t in tensors:
        for first in range(0, t.numel(), PIECE):
            end = min(first + PIECE, t.numel())
            staging.copy_into(dst[offset:offset + end - first], t[first:end])
            offset += end - first
    return time.thread_time() - started


def neighbour(core: int, nbytes: int, stop, moved) -> None:
    """A memory-bound loop on the other core: copies ``nbytes`` back and forth, counts the bytes."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    while not stop.is_set():
        b.copy_(a)
        with moved.get_lock():
            moved.value += nbytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if not staging.streaming:
        print("dashrun.util._ntcopy is not built or not usable here (no C compiler at install, or not x86-64 with "
              "SSE4.2): nothing to compare")
        return 1
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    tensors = state(args.size_mib)
    nbytes = sum(t.numel() for t in tensors)
    fd = os.memfd_create("bench-staging")
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)
    dst = torch.frombuffer(mapped, dtype=torch.uint8)
    dst.fill_(0)
    print(f"{nbytes / 2**20:.1f} MiB in {PIECE >> 20} MiB pieces, {args.rounds} rounds per engine after a warm-up, "
          f"copy on core {cores[0]}")
    engines = {"torch copy_": False, "streaming + CRC": True}

    def compare(label: str, during=None) -> dict[str, float]:
        times = {name: [] for name in engines}
        for r in range(args.rounds + 1):
            for name, streaming in (engines.items() if r % 2 else reversed(engines.items())):
                spent = stage_all(tensors, dst, streaming)
                if r:
                    times[name].append(spent)
                if during:
                    during(name, spent)
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["torch copy_"]
        print(label)
        for name, m in medians.items():
            print(f"  {name:<17} {m * 1e3:6.1f} ms CPU  ({nbytes / m / 2**30:5.2f} GiB/s)  {m / base:.2f}x")
        return medians

    compare("alone:")
    if len(cores) > 1:
        ctx = multiprocessing.get_context("spawn")
        stop, moved = ctx.Event(), ctx.Value("q", 0)
        loop = ctx.Process(target=neighbour, args=(cores[1], 64 << 20, stop, moved), daemon=True)
        loop.start()
        deadline = time.monotonic() + 30
        while moved.value < (128 << 20):  # its buffers touched, the loop running
            if time.monotonic() > deadline or not loop.is_alive():
                raise RuntimeError("the copy loop on the other core did not start")
            time.sleep(0.05)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        last = [time.perf_counter(), moved.value]

        def sample(name: str, _spent: float) -> None:
            now, total = time.perf_counter(), moved.value
            rates[name].append((total - last[1]) / (now - last[0]))
            last[:] = [now, total]

        try:
            compare(f"with a memory-bound copy loop on core {cores[1]}:", during=sample)
        finally:
            stop.set()
            loop.join(10)
        for name, r in rates.items():
            print(f"  the loop on core {cores[1]} while {name} ran: {statistics.median(r[1:]) / 2**30:.2f} GiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
