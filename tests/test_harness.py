"""The harness works, and it can fail: the leak check catches and names what a test leaves running, wait_for
fails at its deadline, kill_tree reaches grandchildren, dash-memd starts and stops, pinned if asked, and says why it
did not; the benchmarks' pinned pair serves and stops with its Processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from dashrun.testing import leaks
from dashrun.testing.daemons import start_dash_daemons
from dashrun.testing.memd import Memd
from dashrun.testing.processes import NotServing, Processes, WaitTimeout, kill_tree, wait_for
from dashrun.util import daemon
from dashrun.util.tokens import write_token

#: A shell that starts a grandchild and prints its pid, then waits for it.
GRANDCHILD = "sleep 3131 & echo $!; wait"

def test_the_leak_check_names_and_kills_a_leaked_child():
    with leaks.tagged() as watch:
        leaked = subprocess.Popen(["sleep", "3030"])
    with pytest.raises(leaks.Leaked, match=r"sleep 3030") as caught:
        leaks.check(watch, deadline=0.5)
    assert f"pid {leaked.pid}" in str(caught.value)
    assert leaked.wait(timeout=10) == -9  # killed by the check, and its exit code left to its Popen
    leaks.check(watch, deadline=0.5)  # nothing left


def test_the_leak_check_finds_a_process_that_left_the_tree():
    with leaks.tagged() as watch:
        subprocess.run([sys.executable, "-c", "import os, subprocess, sys\n"
                        "if os.fork() == 0:\n    os.setsid()\n    subprocess.Popen(['sleep', '3232'])\n"
                        "    os._exit(0)\nos.wait()"], check=True, timeout=30)
        orphans = wait_for(lambda: [p for p in psutil.process_iter(["cmdline"])
                                    if p.info["cmdline"] == ["sleep", "3232"]], 10, "the double-forked sleep")
    assert all(p.ppid() != os.getpid() for p in orphans)  # out of this process's tree
    assert not any(p.pid == orphans[0].pid for p in psutil.Process().children(recursive=True))
    with pytest.raises(leaks.Leaked, match=r"sleep 3232"):
        leaks.check(watch, deadline=0.5)
    assert not psutil.pid_exists(orphans[0].pid) or orphans[0].status() == psutil.STATUS_ZOMBIE


def test_the_leak_check_waits_for_a_process_that_is_ending():
    with leaks.tagged() as watch:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    started = time.monotonic()
    leaks.check(watch, deadline=20)
    assert time.monotonic() - started < 15


def test_the_leak_check_spares_exempt_and_kept_processes():
    with leaks.tagged() as watch:
        kept = subprocess.Popen(["sleep", "3333"])
        exempted = subprocess.Popen(["sleep", "3434"])
    leaks.exempt(exempted.pid)
    try:
        leaks.check(watch, deadline=0.2, keep=[kept.pid])
        assert kept.poll() is None and exempted.poll() is None
    finally:
        for proc in (kept, exempted):
            proc.kill()
            proc.wait()


def test_a_tag_is_put_back_after_its_block():
    before = os.environ.get(leaks.TAG)
    with leaks.tagged("inner") as watch:
        assert os.environ[leaks.TAG] == watch.tag == "inner"
        assert leaks.TAG not in leaks.untagged_env()
    assert os.environ.get(leaks.TAG) == before


def test_wait_for_fails_at_its_deadline_with_what_it_waited_for():
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="the moon to turn blue"):
        wait_for(lambda: False, 0.3, "the moon to turn blue")
    assert 0.3 <= time.monotonic() - started < 5
    assert isinstance(WaitTimeout(), AssertionError)  # a test shows it as its failure
    assert wait_for(lambda: 42, 1, "an answer") == 42


def test_kill_tree_kills_grandchildren():
    shell = subprocess.Popen(["sh", "-c", GRANDCHILD], stdout=subprocess.PIPE, text=True)
    grandchild = psutil.Process(int(shell.stdout.readline()))
    kill_tree(shell)
    shell.stdout.close()
    assert shell.returncode == -9
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE


def test_processes_stops_everything_it_started(tmp_path):
    with Processes() as procs:
        a = procs.start("a", ["sleep", "3535"])
        b = procs.start("b", ["sh", "-c", GRANDCHILD], stdout=subprocess.PIPE, log=tmp_path / "b.log", text=True)
        grandchild = psutil.Process(int(b.stdout.readline()))  # started, so stop_all must find it
    b.stdout.close()
    assert a.returncode is not None and b.returncode is not None
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
    assert procs.procs == []


def test_memd_starts_serves_and_stops(tmp_path):
    write_token(tmp_path / "token")
    memd = Memd(tmp_path / "data", tmp_path / "token", "--memory-limit", "64MiB", log_path=tmp_path / "memd.log")
    memd.start(port=0)
    try:
        assert memd.port > 0 and memd.proc.poll() is None
        with memd.client() as client:
            assert client.latest("nobody") is None
    finally:
        assert memd.stop() == 0
    assert memd.proc.poll() == 0


def test_memd_pinned_to_a_core_and_a_failed_start_says_why(tmp_path):
    write_token(tmp_path / "token")
    core = max(os.sched_getaffinity(0))
    memd = Memd(tmp_path / "data", tmp_path / "token", "--memory-limit", "64MiB", log_path=tmp_path / "memd.log",
                core=core)
    memd.start(port=0)
    try:
        assert psutil.Process(memd.pid).cpu_affinity() == [core]
    finally:
        assert memd.stop(timeout=30) == 0
    broken = Memd(tmp_path / "data", tmp_path / "token", log_path=tmp_path / "broken.log", timeout=10,
                  entry=("-c", "import sys; print('no memd here'); sys.exit(3)"))
    with pytest.raises(NotServing, match="no memd here") as caught:
        broken.start(port=0)
    assert caught.value.reason.startswith("dash-memd exited with code 3 before it was ready")
    assert "no memd here" not in caught.value.reason


def test_the_benchmarks_pair_serves_pinned_and_stops_with_its_processes(tmp_path):
    core = min(os.sched_getaffinity(0))
    with Processes() as procs:
        pair = start_dash_daemons(tmp_path / "pair", procs, core, core, plaintext=True)
        assert [name for name, _ in procs.procs] == ["dash-memd", "dash-agent"]
        assert all(psutil.Process(p.pid).cpu_affinity() == [core] for p in (pair.memd, pair.agent))
        assert daemon.accepting(pair.socket)()
        assert "--no-tls" in psutil.Process(pair.agent.pid).cmdline()
    assert pair.memd.poll() is not None and pair.agent.poll() is not None


def test_memd_runs_in_a_fleet_nodes_namespace_on_its_address(fleet_factory, memd_factory):
    fleet = fleet_factory(1)
    memd = memd_factory("--memory-limit", "64MiB", netns=fleet[0])
    assert memd.address.startswith(f"{fleet[0].address}:")
    found = subprocess.run(["ip", "netns", "identify", str(memd.proc.pid)], capture_output=True, text=True, timeout=30)
    assert found.stdout.strip() == fleet[0].namespace  # the daemon itself, not a wrapper, is in the namespace
    with memd.client() as client:  # from the root namespace, over the bridge
        assert client.latest("nobody") is None


def test_a_nodes_link_is_shaped_each_way_apart(fleet_factory):
    """tc's token bucket holds the shaped direction to its rate; the other direction stays a veth's (far faster:
    4x is a bound no machine misses)."""
    fleet = fleet_factory(1)
    node, nbytes, rate = fleet[0], 1 << 20, 8e6 / 8  # 8mbit: about a second for 1 MiB
    node.shape("8mbit")
    assert fleet.measure(node, None, nbytes) <= 1.25 * rate
    assert fleet.measure(None, node, nbytes) > 4 * rate
    node.shape(None)
    node.shape_inbound("8mbit")
    assert fleet.measure(None, node, nbytes) <= 1.25 * rate
    assert fleet.measure(node, None, nbytes) > 4 * rate
    node.shape_inbound(None)
    assert fleet.measure(None, node, nbytes) > 4 * rate


def test_pairs_measured_at_once_share_a_shaped_link(fleet_factory):
    """Two bare pairs into one node whose inbound link is shaped move at once, so they share its rate: neither
    gets near all of it (one after the other, each would)."""
    fleet = fleet_factory(3)
    # 2 s of the link for each pair's bytes: a sender that starts half a second after the other (a loaded
    # machine) still shares it for most of its time
    node, nbytes, rate = fleet[0], 2 << 20, 16e6 / 8
    node.shape_inbound("16mbit")
    rates = fleet.measure_pairs([(fleet[1], node), (fleet[2], node)], nbytes)
    assert len(rates) == 2 and max(rates) <= 0.85 * rate
    node.shape_inbound(None)
    assert min(fleet.measure_pairs([(fleet[1], node), (fleet[2], node)], nbytes)) > 2 * rate
