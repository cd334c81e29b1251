#!/usr/bin/env python3
"""How fast one checkpoint streams into dash-memd when sender and dash-memd share a core.

In ``bench_checkpoint.py`` dash-agent and dash-memd share the second core, so
the agent's send and dash-memd's receive and CRC run one after the other.
This benchmark measures that stream alone, from a shard already staged in
shared memory, side by side in one run with what a bare sender/receiver pair
of processes does on the same bytes:

* dash-memd: a real dash-memd and MemdClient.put_shard (what dash-agent calls),
  both pinned to one core; each round waits until the shard is on disk, so
  the disk writer never overlaps the next round; once with the sender
  checksumming as it sends, once with the checksum known beforehand (the
  rank's, computed as it staged: what dash-agent does with dashrun's C
  helper);
* bare pair, one core, with and without CRC-32C of every piece;
* bare pair, two cores (sender on the other core): the loopback limit that
  ``bench_checkpoint.py`` compares against.

Every round is followed by an idle pause (``--pause``), as checkpoints are
spaced by training steps. Prints the median and best of the rounds after one
warm-up, and each ratio to the two-core pair. Linux only (CPU affinity, memfd).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dashrun.channel import CHUNK  # noqa: E402
from dashrun.client import MemdClient  # noqa: E402
from dashrun.protocol import ShardHeader, crc32c  # noqa: E402
from dashrun.units import write_token  # noqa: E402


def staged(nbytes: int) -> memoryview:
    """A shard in shared memory, as a rank leaves it for dash-agent (pages touched)."""
    fd = os.memfd_create("bench-stream")
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)
    os.close(fd)
    pattern = os.urandom(CHUNK)
    for start in range(0, nbytes, CHUNK):
        mapped[start:start + CHUNK] = pattern[:nbytes - start]
    return memoryview(mapped)


def through_memd(view: memoryview, core: int, rounds: int, pause: float, rank_crc: bool = False) -> list[float]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    token = write_token(scratch / "token")
    ready = scratch / "ready"
    memd = subprocess.Popen(
        [sys.executable, "-m", "dashrun.memd", "start", "--listen", "127.0.0.1:0", "--data-dir", str(scratch / "data"),
         "--memory-limit", f"{4 * len(view) + (1 << 30)}", "--token-file", str(scratch / "token"),
         "--ready-file", str(ready)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(scratch / "memd.log", "wb"),
        preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if memd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dash-memd did not start: see {scratch / 'memd.log'}")
            time.sleep(0.05)
        host, port = ready.read_text().strip().rsplit(":", 1)
        os.sched_setaffinity(0, {core})  # the sender (dash-agent's part) shares dash-memd's core
        times = []
        # With the rank's checksum (computed as it staged), the sender only sends; dash-memd still verifies.
        known = crc32c(view) if rank_crc else None
        with MemdClient(host, int(port), token) as client:
            for step in range(rounds + 1):
                header = ShardHeader(job="bench-stream", step=step, rank=0, world=1, rep_total=len(view), rep_start=0,
                                     rep_end=len(view), private_len=0, meta_len=0, layout="0" * 64)
                started = time.perf_counter()
                client.put_shard(header, [view], crc=(lambda: known) if rank_crc else None)
                times.append(time.perf_counter() - started)
                if not client.wait("bench-stream", step, 120, on_disk=True):
                    raise RuntimeError(f"dash-memd did not write the shard to disk: see {scratch / 'memd.log'}")
                time.sleep(pause)
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        memd.terminate()
        memd.wait(timeout=60)
    shutil.rmtree(scratch, ignore_errors=True)  # its checkpoints would fill the disk; after a failure the log stays
    return times[1:]


def bare_pair(view: memoryview, sender_core: int, receiver_core: int, rounds: int, pause: float,
              crc: bool) -> list[float]:
    nbytes = len(view)
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    pid = os.fork()
    if pid == 0:  # the receiver: into one reused buffer, as dash-memd's pool does
        try:
            os.sched_setaffinity(0, {receiver_core})
            listener.settimeout(60)  # the sender failed before connecting: do not wait forever
            conn, _ = listener.accept()
            conn.settimeout(120)
            into = memoryview(bytearray(nbytes))
            for _ in range(rounds + 1):
                got, running = 0, 0
                while got < nbytes:
                    n = conn.recv_into(into[got:], min(CHUNK, nbytes - got))
                    if crc:
                        running = crc32c(into[got:got + n], running)
                    got += n
                conn.sendall(b"k")
        finally:
            os._exit(0)
    listener.close()
    try:
        os.sched_setaffinity(0, {sender_core})
        times = []
        with socket.create_connection(address, timeout=120) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds + 1):
                started, running = time.perf_counter(), 0
                for start in range(0, nbytes, CHUNK):
                    piece = view[start:start + CHUNK]
                    if crc:
                        running = crc32c(piece, running)
                    sock.sendall(piece)
                if sock.recv(1) != b"k":
                    raise RuntimeError("the receiver failed")
                times.append(time.perf_counter() - started)
                time.sleep(pause)
        return times[1:]
    finally:
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds of each (after one warm-up)")
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds idle after each round, as checkpoints are spaced by training steps (back to "
                             "back, this VM streams markedly slower)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("bench_stream: needs two cores", file=sys.stderr)
        return 2
    train_core, side_core = cores[0], cores[-1]
    view = staged(args.size_mib << 20)
    rounds, pause = args.rounds, args.pause
    rows = [
        ("bare pair, two cores (the loopback limit)", bare_pair(view, train_core, side_core, rounds, pause, False)),
        ("bare pair, one core, no CRC", bare_pair(view, side_core, side_core, rounds, pause, False)),
        ("bare pair, one core, CRC-32C both sides", bare_pair(view, side_core, side_core, rounds, pause, True)),
        ("MemdClient.put_shard into dash-memd, one core", through_memd(view, side_core, rounds, pause)),
        ("the same with the rank's checksum (dash-agent only sends)",
         through_memd(view, side_core, rounds, pause, rank_crc=True)),
    ]
    limit = statistics.median(rows[0][1])
    gib = len(view) / (1 << 30)
    print(f"{args.size_mib} MiB from shared memory over loopback TCP, {CHUNK >> 20} MiB pieces, "
          f"{rounds} rounds each, {pause:g} s apart; one core = core {side_core}, the other = core {train_core}")
    print("| | median | best | GiB/s (median) | vs two-core pair |")
    print("|---|---:|---:|---:|---:|")
    for name, times in rows:
        median = statistics.median(times)
        print(f"| {name} | {median * 1e3:.0f} ms | {min(times) * 1e3:.0f} ms | {gib / median:.2f} | "
              f"{median / limit:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
