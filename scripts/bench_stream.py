#!/usr/bin/env python3
"""How fast one checkpoint streams into dash-memd when sender and dash-memd share a core.

In ``bench_checkpoint.py`` dash-agent and dash-memd share the second core, so
the agent's send and dash-memd's receive and CRC run one after the other.
This benchmark measures that stream alone, from a shard already staged in
shared memory, side by side in one run with what a bare sender/receiver pair
of processes does on the same bytes:

* dash-memd: a real dash-memd and MemdClient.put_shard (what dash-agent calls),
  both pinned to one core, over plaintext TCP (``--no-tls``: the landing buffer
  is the plaintext receive's; a TLS receive decrypts each record straight into
  the RAM buffer); each round waits until the shard is on disk, so
  the disk writer never overlaps the next round; with the checksum known
  beforehand (the rank's, computed as it staged: what dash-agent does with
  dashrun's C helper). Three variants, alternated round by round: as dashrun
  runs (the sender yields the CPU after each piece to a peer on this machine;
  dash-memd receives each piece into a cache-sized landing buffer and moves it
  on with streaming stores that checksum), with the yields but dash-memd
  receiving straight into its RAM buffer, and with neither;
* bare pair, one core, the receiver checksumming each piece as dash-memd
  does, with and without a yield after each piece;
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
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dashrun.testing.memd import ENTRY, Memd  # noqa: E402
from dashrun.util.files import populated  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402
from dashrun.wire import channel  # noqa: E402
from dashrun.wire.channel import CHUNK  # noqa: E402
from dashrun.wire.messages import ShardHeader  # noqa: E402
from dashrun.wire.protocol import crc32c  # noqa: E402


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


# dash-memd receiving straight into its RAM buffer, as before the landing buffer (for the comparison only).
_MEMD_STRAIGHT_IN = ("from dashrun.wire import channel; channel._ntcopy = None; "
                     "from dashrun.memd.cli import main; main()")


def through_memd(view: memoryview, core: int, rounds: int, pause: float,
                 variants: dict[str, tuple[bool, bool]]) -> dict:
    """put_shard into real dash-memd processes on one core, the variants alternated round by round.

    ``variants``: name -> (the sender yields to its local peer, dash-memd receives through its landing buffer).
    """
    scratch = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    write_token(scratch / "token")
    memds: dict[bool, Memd] = {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        clients = {}
        for landing in sorted({landing for _, landing in variants.values()}):
            where = scratch / ("landing" if landing else "straight-in")
            where.mkdir()
            memds[landing] = Memd(where / "data", scratch / "token", "--memory-limit", f"{4 * len(view) + (1 << 30)}",
                                  "--no-tls", log_path=where / "memd.log", core=core, timeout=60,
                                  entry=ENTRY if landing else ("-c", _MEMD_STRAIGHT_IN), cwd=REPO).start(port=0)
            clients[landing] = memds[landing].client()
        os.sched_setaffinity(0, {core})  # the sender (dash-agent's part) shares dash-memd's core
        known = crc32c(view)  # the rank's, computed as it staged: the sender only sends; dash-memd still verifies
        step = 0
        for r in range(rounds + 1):
            names = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in names:
                yields, landing = variants[name]
                channel.YIELD_TO_LOCAL_PEER = yields
                client = clients[landing]
                header = ShardHeader(job="bench-stream", step=step, rank=0, world=1, rep_total=len(view),
                                     rep_start=0, rep_end=len(view), private_len=0, meta_len=0, layout="0" * 64)
                started = time.perf_counter()
                client.put_shard(header, [view], crc=lambda: known)
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - started)
                if not client.wait("bench-stream", step, 120, on_disk=True):
                    raise RuntimeError(f"dash-memd did not write the shard to disk: see {scratch}")
                step += 1
                time.sleep(pause)
        for client in clients.values():
            client.close()
    finally:
        channel.YIELD_TO_LOCAL_PEER = True
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        for memd in memds.values():
            memd.stop(timeout=60)
    shutil.rmtree(scratch, ignore_errors=True)  # its checkpoints would fill the disk; after a failure the log stays
    return times


def bare_pair(view: memoryview, sender_core: int, receiver_core: int, rounds: int, pause: float,
              crc: bool, yield_each: bool = False) -> list[float]:
    nbytes = len(view)
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    pid = os.fork()
    if pid == 0:  # the receiver: into one reused, touched buffer, mapped as dash-memd's pool maps them
        try:
            os.sched_setaffinity(0, {receiver_core})
            listener.settimeout(60)  # the sender failed before connecting: do not wait forever
            conn, _ = listener.accept()
            conn.settimeout(120)
            # A bytearray (private memory) received 1.7x slower on this VM than this shared mapping.
            into = memoryview(populated(nbytes))
            for _ in range(rounds + 1):
                running = 0
                for start in range(0, nbytes, CHUNK):  # piece by piece, each checksummed as it lands (as dash-memd)
                    piece = into[start:start + CHUNK]
                    got = 0
                    while got < len(piece):
                        n = conn.recv_into(piece[got:])
                        if not n:
                            raise RuntimeError("the sender hung up")
                        got += n
                    if crc:
                        running = crc32c(piece, running)
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
                started = time.perf_counter()
                for start in range(0, nbytes, CHUNK):
                    piece = view[start:start + CHUNK]
                    sock.sendall(piece)
                    if yield_each:
                        os.sched_yield()
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
    streamed = through_memd(view, side_core, rounds, pause, {
        "as dashrun": (True, True), "no landing buffer": (True, False), "neither": (False, False)})
    rows = [
        ("bare pair, two cores (the loopback limit)", bare_pair(view, train_core, side_core, rounds, pause, False)),
        ("bare pair, one core, receiver checksums", bare_pair(view, side_core, side_core, rounds, pause, True)),
        ("the same, the sender yielding after each piece",
         bare_pair(view, side_core, side_core, rounds, pause, True, yield_each=True)),
        ("MemdClient.put_shard into dash-memd, one core: no yields, no landing buffer", streamed["neither"]),
        ("the same, a yield after each piece", streamed["no landing buffer"]),
        ("the same, and through dash-memd's landing buffer (as dashrun runs)", streamed["as dashrun"]),
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
