#!/usr/bin/env python3
"""The data set cache against a shaped bucket: epoch 1 (from the source), epoch 2 (the node's cache, page cache
dropped), and a replacement node's refill from its peers, from dash-memd's cache and from the source, side by side.

The bucket is a moto S3 server in a network namespace (dashrun.testing.netns) whose outbound link is a tc
token bucket (``--rate``, tc's units), standing for the bucket's bandwidth; this process reads it through the
bridge. dash-memd (with ``--data-cache``) runs in the root namespace, as the stable VM, and so do two nodes'
dash-agents (n1 serving the cache epoch 1 filled, n2 the second copies n1 gave it), on loopback. Epoch 2's
bandwidth is
set against the local disk's own, read the same way (a file of the data set's size, page cache dropped). Needs
root (namespaces, tc, drop_caches)::

    sudo python scripts/bench_data.py --objects 64 --size 4MiB --rate 400mbit
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchlib import MiB, describe_machine, machine

from dashrun.data.files import CachedFiles
from dashrun.data.peers import MemdListings, PeerData
from dashrun.testing import netns
from dashrun.testing.agent import Agent
from dashrun.testing.memd import Memd
from dashrun.testing.processes import free_port, kill_tree, wait_for
from dashrun.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY
from dashrun.util.tokens import read_token, write_token
from dashrun.util.units import parse_size
from dashrun.wire.credentials import Credential
from dashrun.wire.peer_client import PeerClient

JOB = "bench-data"


def fmt_bw(bytes_per_second: float) -> str:
    return f"{bytes_per_second / MiB:.0f} MiB/s"


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_all(files: CachedFiles, workers: int) -> float:
    """Seconds to make every object local and read it whole, ``workers`` at a time (as a DataLoader's)."""
    def one(key: str) -> int:
        with open(files.local_path(key), "rb") as f:
            return len(f.read())

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(one, files.keys()))
    assert total == files.listing.nbytes
    return time.perf_counter() - start


def disk_read_bandwidth(where: Path, nbytes: int) -> float:
    path = where / "disk-baseline.bin"
    with open(path, "wb") as f:
        piece = os.urandom(8 << 20)
        for _ in range(0, nbytes, len(piece)):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache()
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return size / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--size", default="4MiB", help="bytes per object")
    parser.add_argument("--rate", default="400mbit", help="the bucket's link (tc tbf rate)")
    parser.add_argument("--workers", type=int, default=8, help="objects read at once")
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        print(f"bench_data: needs network namespaces: {reason}", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    token = work / "token"
    write_token(token)
    port = free_port()
    with netns.Fleet(1) as fleet:
        bucket_node = fleet[0]
        moto = bucket_node.popen([sys.executable, "-m", "moto.server", "-H", bucket_node.address, "-p", str(port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        memd = Memd(work / "memd", token, "--memory-limit", "256MiB", "--data-cache", str(work / "memd-cache"),
                    log_path=work / "memd.log")
        agents: list[Agent] = []
        try:
            endpoint = f"http://{bucket_node.address}:{port}"
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                               "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
                               "AWS_EC2_METADATA_DISABLED": "true"})
            wait_for(lambda: _answers(endpoint), 60, "the bucket to answer")
            memd.start()
            import boto3

            s3 = boto3.client("s3")
            s3.create_bucket(Bucket="data")
            for i in range(args.objects):
                s3.put_object(Bucket="data", Key=f"shards/{i:05d}.bin", Body=os.urandom(size))
            bucket_node.shape(args.rate)
            url = "s3://data/shards/"
            link = fleet.measure(bucket_node, None, 32 << 20)

            credential = Credential.parse(read_token(token)).for_job(JOB)
            for name in ("n1", "n2"):  # each node's agent serves its node's data cache to the others
                agents.append(Agent(memd, work / f"{name}.sock", work / f"{name}.log", {
                    "DASH_JOB_ID": JOB, "DASH_NODE": name, "DASH_REPLICAS": "1", "DASH_PEER_PORT": "0",
                    "DASH_PEER_MEMORY_LIMIT": "64MiB", "DASH_DATA_CACHE": str(work / name)}))
            listings = MemdListings(memd.client)
            wait_for(lambda: len(listings.members(JOB)) == 2, 30, "both agents in dash-memd's fleet view")

            def node(name: str, via_memd: bool, via_peers: bool = False) -> CachedFiles:
                remote = MemdListings(memd.client)
                peers = PeerData(lambda: remote.members(JOB), lambda p: PeerClient(p[1], p[2], credential), name)
                return CachedFiles(url, cache_dir=work / name, remote=remote,
                                   providers=[("peer", peers)] * via_peers + [("dash-memd", remote)] * via_memd)

            with node("n1", via_memd=True, via_peers=True) as a:  # a second copy of each object to n2
                epoch1 = read_all(a, args.workers)
            dropped = drop_page_cache()
            with node("n1", via_memd=True) as a:
                epoch2 = read_all(a, args.workers)
            with node("node-p", via_memd=False, via_peers=True) as p:
                from_peers = read_all(p, args.workers)
                assert p.fetched == {"peer": args.objects}, p.fetched
            total = args.objects * size
            disk = disk_read_bandwidth(work, total)
            with node("node-b", via_memd=True) as b:
                from_memd = read_all(b, args.workers)
                assert b.fetched == {"dash-memd": args.objects}, b.fetched
            with node("node-c", via_memd=False) as c:
                from_source = read_all(c, args.workers)
                assert c.fetched == {"source": args.objects}, c.fetched
            rows = [("epoch 1: from the shaped bucket", epoch1), ("epoch 2: the node's cache", epoch2),
                    ("refill: a fresh node from its two peers' caches", from_peers),
                    ("refill: a fresh node from dash-memd's cache", from_memd),
                    ("refill: a fresh node from the shaped bucket", from_source)]
        finally:
            bucket_node.shape(None)
            for agent in agents:
                agent.stop()
            memd.stop()
            kill_tree(moto)
            shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {describe_machine(machine())}")
    print(f"data set: {args.objects} objects x {args.size} = {total / (1 << 20):.0f} MiB; bucket link {args.rate} "
          f"(measured {fmt_bw(link)}); {args.workers} readers; page cache dropped before epoch 2: {dropped}")
    print("| read | seconds | bandwidth |")
    print("|---|---|---|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.2f} | {fmt_bw(total / seconds)} |")
    print(f"| the local disk, read alone (page cache dropped) | {total / disk:.2f} | {fmt_bw(disk)} |")
    print(f"epoch 2 / local disk: {total / epoch2 / disk:.2f}x; refill from the peers vs the bucket: "
          f"{from_source / from_peers:.1f}x faster; from dash-memd vs the bucket: {from_source / from_memd:.1f}x")
    return 0


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
