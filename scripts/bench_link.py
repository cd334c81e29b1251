#!/usr/bin/env python3
"""What the link to dash-memd costs: a shard put into dash-memd and read back, sealed against --no-tls.

Two real dash-memd processes, one with TLS (the login over TLS, then the
sealed records of ``dashrun/wire/sealed.py``) and one with ``--no-tls``, both
pinned to the second core; a MemdClient in this process (what dash-agent
calls) puts a shard of ``--size-mib`` and reads it back, rounds alternated
between the two. Reports per shard the wall time and the CPU seconds of
dash-memd and of this process, with the client on the first core (a node
sending to dash-memd on its own VM) and, with ``--same-core``, on dash-memd's
(this project's 2-core benchmarks, where dash-agent and dash-memd share a
core); and loopback TCP for the same bytes in the same run (the limit).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402  (scripts/ is sys.path[0] when this runs as a script)

from dashrun.testing.memd import Memd  # noqa: E402

MiB = 1 << 20


def start_memd(directory: Path, procs: benchlib.Processes, core: int, nbytes: int, plaintext: bool) -> Memd:
    from dashrun.util.tokens import write_token

    directory.mkdir(parents=True)
    write_token(directory / "token")
    memd = Memd(directory / "data", directory / "token", "--memory-limit", str(4 * nbytes),
                *(["--no-tls"] if plaintext else []), log_path=directory / "memd.log", core=core, timeout=60,
                cwd=HERE.parent, env=benchlib.child_env())
    procs.add("dash-memd", memd.start(port=0).proc)
    return memd


def measure(nbytes: int, rounds: int, client_core: int, memd_core: int, procs: benchlib.Processes,
            scratch: Path) -> dict:
    import psutil
    import torch

    from dashrun.wire.messages import ShardHeader

    benchlib.pin_process({client_core})
    payload = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    back = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    src, dst = memoryview(payload.numpy()), memoryview(back.numpy())
    links = {}
    for name, plaintext in (("sealed (TLS login)", False), ("--no-tls", True)):
        memd = start_memd(scratch / f"{client_core}-{plaintext}", procs, memd_core, nbytes, plaintext)
        links[name] = (psutil.Process(memd.pid), memd.client(timeout=120))
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in links}
    try:
        for step in range(1, rounds + 2):  # the first round warms up
            for name, (memd, client) in links.items():
                header = ShardHeader("link", step, 0, 1, nbytes, 0, nbytes, 0, 0, "ab" * 32)
                for way, call in (("put", lambda: client.put_shard(header, [src])),
                                  ("get", lambda: client.get_shard_into("link", step, 0, [dst]))):
                    memd_cpu, own_cpu, started = sum(memd.cpu_times()[:2]), time.process_time(), time.perf_counter()
                    call()
                    if step > 1:
                        got = samples[name].setdefault(way, [])
                        got.append((time.perf_counter() - started, sum(memd.cpu_times()[:2]) - memd_cpu,
                                    time.process_time() - own_cpu))
                if not torch.equal(payload, back):
                    raise RuntimeError(f"{name}: the shard read back differs")
                client.delete("link", keep=1)
    finally:
        for _, client in links.values():
            client.close()
    limit = benchlib.measure_loopback(nbytes, memd_core, procs)  # the receiver where dash-memd runs
    return {"samples": samples, "loopback_s": limit["time_s"]}


def report(nbytes: int, where: str, result: dict) -> None:
    print(f"\n{where}: {nbytes / MiB:.0f} MiB per shard; loopback TCP limit {result['loopback_s'] * 1e3:.0f} ms")
    print(f"  {'link':22} {'way':4} {'wall ms':>8} {'dash-memd CPU ms':>17} {'client CPU ms':>14}")
    medians = {}
    for name, ways in result["samples"].items():
        for way, rows in ways.items():
            wall, memd, own = (statistics.median(column) * 1e3 for column in zip(*rows))
            medians[name, way] = wall
            print(f"  {name:22} {way:4} {wall:8.0f} {memd:17.0f} {own:14.0f}")
    for way in ("put", "get"):
        print(f"  {way}: sealed / --no-tls {medians['sealed (TLS login)', way] / medians['--no-tls', way]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--same-core", action="store_true", help="also with the client on dash-memd's core")
    args = parser.parse_args(argv)
    nbytes = args.size_mib * MiB
    first, second, _separate = benchlib.placement()
    procs = benchlib.Processes()
    scratch = Path(tempfile.mkdtemp(prefix="dashbench-link-"))
    print(benchlib.describe_machine(benchlib.machine()))
    try:
        report(nbytes, "client on the other core", measure(nbytes, args.rounds, first, second, procs, scratch))
        if args.same_core:
            report(nbytes, "client on dash-memd's core", measure(nbytes, args.rounds, second, second, procs, scratch))
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
