"""Many nodes into one dash-memd: receives wait for RAM in turn instead of being refused; the fan-in benchmark runs."""

import json
import subprocess
import sys
import threading

import pytest
from conftest import REPO, wait_for
from test_catalogue import deliver, headers

from dashrun.errors import NoSpaceError
from dashrun.memd.store.catalogue import Catalogue
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.testing import netns


def full_catalogue(tmp_path) -> Catalogue:
    """A catalogue whose RAM is full of two checkpoints of job "j" (two shards of 8 KiB each) not yet on disk."""
    cat = Catalogue(RamTier(40_000), DiskTier(tmp_path / "d"), keep_ram=5, keep_disk=5)
    for step in (1, 2):
        for header in headers(step=step, rep_total=8192):
            deliver(cat, header)
    assert cat.ram.reserve(8192) is None  # full
    return cat


class Receive(threading.Thread):
    """begin_shard() on a thread of its own, as dash-memd's connection threads call it."""

    def __init__(self, cat: Catalogue, header, order: list):
        super().__init__(daemon=True)
        self.cat, self.header, self.order = cat, header, order
        self.ticket = self.error = None

    def run(self) -> None:
        try:
            self.ticket = self.cat.receiver.begin_shard(self.header)
            self.order.append(self.header.job)
        except NoSpaceError as e:
            self.error = e


def waiting(cat: Catalogue, count: int) -> bool:
    with cat.ledger.cond:
        return len(cat.ledger.room_waiters) == count


def test_a_receive_into_full_ram_waits_for_the_disk_writer_which_writes_the_newest_first(tmp_path):
    cat = full_catalogue(tmp_path)
    order: list[str] = []
    receive = Receive(cat, headers(job="k", step=1, rep_total=8192)[0], order)
    receive.start()
    wait_for(lambda: waiting(cat, 1), 10, "the receive to wait for room")
    assert receive.error is None and receive.ticket is None
    # One write makes room: the writer skips step 1 for step 2 (its write makes step 1 safe too).
    assert cat.disk_writer.persist_next(timeout=0)
    assert cat.disk_writer.persist_next(timeout=0)
    receive.join(10)
    assert receive.ticket is not None, receive.error
    job = next(j for j in cat.jobs() if j["job"] == "j")
    tiers = {c["step"]: c["tiers"] for c in job["checkpoints"]}
    assert "disk" in tiers[2] and "disk" not in tiers.get(1, [])
    cat.receiver.abort_shard(receive.ticket)


def test_a_wait_for_a_step_on_disk_ends_when_the_writer_passed_it_over_for_a_newer_one(tmp_path):
    cat = full_catalogue(tmp_path)
    receive = Receive(cat, headers(job="k", step=1, rep_total=8192)[0], [])
    receive.start()
    wait_for(lambda: waiting(cat, 1), 10, "the receive to wait for room")
    done = []
    waiter = threading.Thread(target=lambda: done.append(cat.wait("j", 1, 30, on_disk=True)), daemon=True)
    waiter.start()
    # step 2 written, step 1 passed over
    assert cat.disk_writer.persist_next(timeout=0) and cat.disk_writer.persist_next(timeout=0)
    waiter.join(10)
    assert done == [True]
    assert cat.wait("j", 2, 0, on_disk=True) and not cat.wait("j", 3, 0, on_disk=True)
    receive.join(10)
    cat.receiver.abort_shard(receive.ticket)


def test_receives_that_wait_for_room_get_it_in_the_order_they_came(tmp_path):
    cat = full_catalogue(tmp_path)
    order: list[str] = []
    big = Receive(cat, headers(job="first", step=1, rep_total=16384, world=1)[0], order)  # needs 17 KiB
    big.start()
    wait_for(lambda: waiting(cat, 1), 10, "the first receive to wait")
    small = Receive(cat, headers(job="second", step=1, rep_total=8192)[0], order)  # needs 8 KiB
    small.start()
    wait_for(lambda: waiting(cat, 2), 10, "the second receive to wait")
    # Room for the small one alone would come first; the big one came first and is served first.
    cat.disk_writer.persist_next(timeout=0)
    cat.disk_writer.persist_next(timeout=0)
    for receive in (big, small):
        receive.join(10)
    assert order == ["first", "second"], (order, big.error, small.error)


def test_a_receive_still_refused_once_no_room_came_in_time(tmp_path):
    cat = full_catalogue(tmp_path)
    cat.retention.room_wait = 0.3
    with pytest.raises(NoSpaceError, match="stayed full"):
        cat.receiver.begin_shard(headers(job="k", step=1, rep_total=8192)[0])
    assert waiting(cat, 0)


@pytest.mark.slow
def test_the_fanin_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "fanin.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_fanin.py"), "--nodes", "2", "--ranks", "1", "--state-mib", "1",
         "--checkpoints", "2", "--warmup", "1", "--modes", "tls,pressed", "--workdir", str(tmp_path / "work"),
         "--json", str(out), "--no-speed-targets"], capture_output=True, text=True, timeout=300)
    # The speed targets are not this machine's to meet (it is shared); the memory bound and the restores are.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    result = json.loads(out.read_text())
    run = result["results"][0]
    assert result["loopback"]["bandwidth"] > 0
    assert set(run["latency"]) == {"sim-000", "sim-001"} and run["commits"] >= 2 * 3
    assert run["ingest"] and run["ingest"] > 0
    assert run["restore_problems"] == [] and run["restore_max_s"] > 0
    assert run["idle_rss"] > 0 and run["rss_max"] >= run["idle_rss"]
    assert "aggregate ingest" in proc.stdout and "restore, all nodes at once" in proc.stdout
    # Unpressed, RAM held everything; pressed (1.25 checkpoints per node), receives evicted to make room, and
    # dash-memd stayed within its limit and overhead (else the benchmark exits 1).
    unpressed, pressed = result["results"]
    assert unpressed["pressure"] == {"evictions": 0, "room_waits": 0, "room_wait_s": 0}
    assert pressed["mode"] == "pressed" and pressed["pressure"]["evictions"] > 0
    assert pressed["memory_limit"] == int(1.25 * 2 * (1 << 20)) and pressed["restore_problems"] == []
    assert "RAM pressure while sending" in proc.stdout


@pytest.mark.slow
def test_the_fanin_benchmark_on_shaped_links_is_held_to_dash_memds_link(tmp_path):
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "fanin.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_fanin.py"), "--shaped", "--memd-rate", "8MiB",
         "--node-rate", "8MiB", "--nodes", "2", "--ranks", "1", "--state-mib", "2", "--checkpoints", "3",
         "--warmup", "1", "--modes", "tls", "--data-in-memory", "--workdir", str(tmp_path / "work"),
         "--json", str(out), "--no-speed-targets"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    run = result["results"][0]
    # The bare pair over dash-memd's veth sees the rate it was shaped to, and the nodes' checkpoints, which
    # alone could go faster (each node's link is as wide), cannot pass it.
    assert 0.6 * (8 << 20) < result["memd_link"] < 1.1 * (8 << 20)
    assert 0 < run["ingest"] < 1.3 * result["memd_link"]
    assert set(run["node_bytes"]) == {"sim-000", "sim-001"} and all(b > 0 for b in run["node_bytes"].values())
    assert run["restore_problems"] == []
    assert "x dash-memd's link" in proc.stdout and "the fair share" in proc.stdout
