"""What work on the other core costs a training step on this one: memory's bandwidth, or nothing.

The bench model's training step (``benchlib.build_model``, one thread) runs on core 0, alone and then while a
loop runs on core 1: a copy of 64 MiB (memory to memory, as dash-agent's copies of a shard), a copy of 256 KiB
(within the core's cache), AES-128-GCM of 256 KiB (in cache, as the records' cipher), and Python arithmetic.
Each is timed against the alone-steps measured right before it, ``--rounds`` times; it prints the median step
and the ratio to the alone one.

    python3 scripts/bench_interference.py [--size-mib 64] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import benchlib

MiB = 1 << 20

#: The loop on the other core, by name; it runs until killed.
LOOP = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[2])})
kind = sys.argv[1]
if kind in ("memcpy-64MiB", "memcpy-256KiB"):
    import torch
    torch.set_num_threads(1)
    a = torch.ones((64 << 20) if kind == "memcpy-64MiB" else (256 << 10), dtype=torch.uint8)
    b = torch.zeros_like(a)
    print("ready", flush=True)
    while True:
        b.copy_(a)
elif kind == "aes-gcm-256KiB":
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    aead, data, nonce = AESGCM(bytes(16)), bytes(256 << 10), bytes(12)
    print("ready", flush=True)
    while True:
        aead.encrypt(nonce, data, None)
else:
    x = 0
    print("ready", flush=True)
    while True:
        x += 1
"""
KINDS = ("memcpy-64MiB", "memcpy-256KiB", "aes-gcm-256KiB", "arithmetic")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=64, help="the model + AdamW state (default 64)")
    parser.add_argument("--steps", type=int, default=100, help="steps per timing (default 100)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_interference.py: needs two cores")
    train_core, other_core = sorted(os.sched_getaffinity(0))[:2]
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {train_core})
    model, optimizer, batch, described = benchlib.build_model(args.size_mib * MiB)
    trainer = benchlib.Trainer(model, optimizer, batch)
    for _ in range(5):
        trainer.step()

    def step_s() -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            trainer.step()
        return (time.perf_counter() - started) / args.steps

    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    steps: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "alone")}
    for _ in range(args.rounds):
        for kind in KINDS:
            alone = step_s()
            loop = subprocess.Popen([sys.executable, "-c", LOOP, kind, str(other_core)], stdout=subprocess.PIPE,
                                    text=True)
            try:
                if loop.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the {kind} loop did not start")
                beside = step_s()
            finally:
                loop.kill()
                loop.wait()
                loop.stdout.close()
            steps["alone"].append(alone)
            steps[kind].append(beside)
            ratios[kind].append(beside / alone)
    print(f"machine: {benchlib.describe_machine(benchlib.machine())}")
    print(f"model: an MLP of {described['layers']} x {described['width']}, AdamW, "
          f"{described['state_bytes'] / MiB:.1f} MiB of state; a training step on core {train_core}, the loop on "
          f"core {other_core}, {args.rounds} rounds of {args.steps} steps")
    print(f"  {'beside':16} {'step, median':>13} {'÷ alone (each round)':>28}")
    print(f"  {'nothing':16} {statistics.median(steps['alone']) * 1e3:10.1f} ms")
    for kind in KINDS:
        each = ", ".join(f"{r:.2f}" for r in ratios[kind])
        print(f"  {kind:16} {statistics.median(steps[kind]) * 1e3:10.1f} ms {each:>28}")


if __name__ == "__main__":
    main()
