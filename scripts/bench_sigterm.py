"""The scheduler's SIGTERM, timed: from the signal to the emergency checkpoint committed in dash-memd, and to
dashrun's exit 75 (the time a scheduler's grace period must cover).

Two CPU ranks train tests/bin/train.py (AdamW, tied weights, BatchNorm) under dashrun against a dash-memd on
loopback; after a few steps the launcher gets SIGTERM, as a Kubernetes container's first process does. Each
round's state is the model's parameters with AdamW's two moments. ``--width 2048`` is about 50 MiB of state.

    python scripts/bench_sigterm.py [--width 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, child_env, describe_machine, machine, med

from dashrun.testing.memd import Memd, dashrun_cmd
from dashrun.testing.processes import kill_tree, wait_for
from dashrun.util.tokens import write_token

__all__ = ["main"]

TRAIN = REPO / "tests" / "bin" / "train.py"


def _steps(log: Path) -> int:
    try:
        return len(re.findall(r"^\d+ ", log.read_text(), re.M))
    except FileNotFoundError:
        return 0


def one_round(memd: Memd, out: Path, job: str, width: int) -> tuple[float, float]:
    """(seconds from SIGTERM to the emergency checkpoint committed, to dashrun's exit 75)."""
    cmd = dashrun_cmd(memd, "--cloud", "none", str(TRAIN), "--steps", "100000", "--interval", "100000",
                      "--width", str(width), "--out", str(out), job=job)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        wait_for(lambda: _steps(out / "rank0.log") >= 5 or proc.poll() is not None, 300, "5 steps")
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
        exited = time.time()
    finally:
        kill_tree(proc)
    if proc.returncode != 75:
        raise SystemExit(f"dashrun exited {proc.returncode}, not 75:\n{stderr[-2000:]}")
    with memd.client() as client:
        info = client.latest(job)
    return info.committed_at - signalled, exited - signalled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    params = 64 * args.width + args.width * args.width + 3 * args.width
    print(describe_machine(machine()))
    print(f"state: about {params * 4 * 3 / 2**20:.0f} MiB (parameters and AdamW's two moments), 2 CPU ranks")
    with tempfile.TemporaryDirectory(prefix="bench-sigterm-") as tmp:
        tmp_path = Path(tmp)
        token = tmp_path / "token"
        write_token(token)
        memd = Memd(tmp_path / "memd", token, "--memory-limit", "2GiB", log_path=tmp_path / "memd.log").start()
        try:
            committed, exited = [], []
            for i in range(args.rounds):
                c, e = one_round(memd, tmp_path / f"out-{i}", f"sigterm-{i}", args.width)
                committed.append(c)
                exited.append(e)
                print(f"round {i}: committed {c:.2f} s, exit 75 {e:.2f} s after SIGTERM")
        finally:
            memd.stop()
    print(f"median: the emergency checkpoint committed {med(committed):.2f} s after SIGTERM; dashrun exited 75 "
          f"after {med(exited):.2f} s")


if __name__ == "__main__":
    sys.exit(main())
