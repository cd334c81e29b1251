"""dash-agent off the ranks' cores: the placement policy, and the affinities of a real launch's processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from conftest import REPO, dashrun_cmd, kill_tree, wait_for

from dashrun.errors import UsageError
from dashrun.launch.placement import CORES_PER_AGENT_CORE, Placement, parse_agent_cpus, plan
from dashrun.util.cpus import format_cpus, parse_cpus, physical_cores, thread_affinity

HOLD = REPO / "tests" / "bin" / "hold.py"
linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")


def singles(*cpus: int) -> list[frozenset[int]]:
    return [frozenset({c}) for c in cpus]


# --- the policy -------------------------------------------------------------------------------------------------


def test_auto_keeps_the_highest_core_for_the_agent_and_gives_the_ranks_the_rest():
    p = plan("auto", 1, allowed=frozenset({0, 1}), cores=singles(0, 1))
    assert (p.agent, p.ranks) == ({1}, {0})
    # taskset -c 2,5,9: the highest allowed, not the machine's highest
    p = plan("auto", 2, allowed=frozenset({2, 5, 9}), cores=singles(2, 5, 9))
    assert (p.agent, p.ranks) == ({9}, {2, 5})


def test_auto_keeps_a_whole_physical_core_with_its_smt_siblings():
    cores = [frozenset({0, 4}), frozenset({1, 5}), frozenset({2, 6}), frozenset({3, 7})]
    p = plan("auto", 2, allowed=frozenset(range(8)), cores=cores)
    assert (p.agent, p.ranks) == ({3, 7}, {0, 1, 2, 4, 5, 6})


def test_auto_keeps_one_more_core_per_many_cores_but_never_takes_a_rank_s():
    many = 2 * CORES_PER_AGENT_CORE
    p = plan("auto", 8, allowed=frozenset(range(many)), cores=singles(*range(many)))
    assert p.agent == {many - 2, many - 1} and p.ranks == frozenset(range(many - 2))
    p = plan("auto", many - 1, allowed=frozenset(range(many)), cores=singles(*range(many)))
    assert p.agent == {many - 1}


@pytest.mark.parametrize("nproc, cores", [(2, singles(0, 1)), (3, singles(0, 1)), (1, [frozenset({0, 1})])])
def test_auto_places_nothing_without_a_core_to_spare(nproc, cores):
    """As many ranks as cores (or more), or one core with two SMT threads: nothing is placed."""
    assert not plan("auto", nproc, allowed=frozenset({0, 1}), cores=cores).placed


def test_auto_leaves_the_ranks_to_torch_numa_binding():
    assert not plan("auto", 1, numa_binding=True, allowed=frozenset({0, 1}), cores=singles(0, 1)).placed


def test_none_places_nothing_and_a_list_is_honoured_or_refused_in_one_line():
    allowed = frozenset(range(4))
    assert not plan("none", 1, allowed=allowed, cores=singles(0, 1, 2, 3)).placed
    p = plan(frozenset({0}), 1, allowed=allowed, cores=singles(0, 1, 2, 3))
    assert (p.agent, p.ranks) == ({0}, {1, 2, 3})
    with pytest.raises(UsageError, match="CPU 4-5, which this launcher may not use"):
        plan(frozenset({3, 4, 5}), 1, allowed=allowed)
    with pytest.raises(UsageError, match="leaves no CPU for the ranks"):
        plan(frozenset(range(4)), 1, allowed=allowed)


def test_a_placement_never_shares_a_cpu_between_agent_and_ranks():
    with pytest.raises(ValueError):
        Placement(frozenset({1}), frozenset({0, 1}))
    with pytest.raises(ValueError):
        Placement(frozenset({1}), None)


def test_agent_cpus_option_values():
    assert parse_agent_cpus(None) == parse_agent_cpus("") == parse_agent_cpus(" AUTO ") == "auto"
    assert parse_agent_cpus("none") == "none"
    assert parse_agent_cpus("0-2,7") == {0, 1, 2, 7}
    for bad in ("x", "3-1", "1,,2", "-1", "99999", "0-99999999", "1" * 5000):
        with pytest.raises(UsageError, match="--agent-cpus"):
            parse_agent_cpus(bad)


def test_cpu_lists_round_trip():
    for cpus in ({0}, {0, 1, 2, 3, 7}, {1, 3, 5}, set(range(64)) - {31}):
        assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus({0, 1, 2, 3, 7, 9, 10}) == "0-3,7,9-10"


@linux_only
def test_physical_cores_of_this_machine_partition_the_cpus():
    allowed = frozenset(os.sched_getaffinity(0))
    cores = physical_cores(allowed)
    assert frozenset().union(*cores) == allowed and sum(map(len, cores)) == len(allowed)


@linux_only
def test_a_process_started_under_thread_affinity_keeps_it_and_the_thread_gets_its_own_back():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs")
    cpu = max(before)
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with thread_affinity(frozenset({cpu})):
        child = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert json.loads(child) == [cpu]
    assert os.sched_getaffinity(0) == before


# --- a real launch ------------------------------------------------------------------------------------------------


def two_cores() -> frozenset[int]:
    """One CPU of each of two physical cores of this machine: the launch sees a two-core node wherever it runs."""
    cores = physical_cores(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two physical cores")
    return frozenset({min(cores[0]), min(cores[1])})


def affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of ``pid``."""
    found = set()
    for thread in psutil.Process(pid).threads():
        try:
            found.add(frozenset(os.sched_getaffinity(thread.id)))
        except OSError:
            pass  # the thread ended
    return found


def agent_pid(launcher: subprocess.Popen) -> int | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "dashrun.agent" in child.cmdline():
                return child.pid
        except psutil.Error:
            pass
    return None


class HeldLaunch:
    """``dashrun`` on a two-core view of this machine, its one rank holding still until released."""

    def __init__(self, memd, out, cpus, *options: str):
        self.out, self.log = out, out / "launcher.log"
        with open(self.log, "wb") as log:
            self.launcher = subprocess.Popen(
                dashrun_cmd(memd, *options, str(HOLD), str(out), job="placement", nproc=1),
                preexec_fn=lambda: os.sched_setaffinity(0, cpus), stdout=log, stderr=subprocess.STDOUT)

    def rank_pid(self) -> int:
        report = self.out / "rank0.json"
        wait_for(lambda: report.exists() or self.launcher.poll() is not None, 120, "the rank's report")
        assert self.launcher.poll() is None, self.log.read_text()[-2000:]
        return json.loads(report.read_text())["pid"]

    def finish(self) -> None:
        (self.out / "release").touch()
        try:
            assert self.launcher.wait(timeout=120) == 0, self.log.read_text()[-2000:]
        finally:
            kill_tree(self.launcher)


@linux_only
@pytest.mark.slow
def test_by_default_the_agent_and_all_its_threads_run_off_the_rank_s_core_also_when_restarted(memd, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.delenv("DASH_AGENT_CPUS", raising=False)
    cpus = two_cores()
    launch = HeldLaunch(memd, tmp_path, cpus)
    try:
        rank = launch.rank_pid()
        agent = agent_pid(launch.launcher)
        assert affinities(agent) == {frozenset({max(cpus)})}
        assert affinities(rank) == {frozenset({min(cpus)})}
        os.kill(agent, signal.SIGKILL)  # the launcher's supervisor restarts it, on the same CPU
        restarted = wait_for(lambda: (pid := agent_pid(launch.launcher)) != agent and pid, 60, "a restarted agent")
        assert affinities(restarted) == {frozenset({max(cpus)})}
    finally:
        launch.finish()


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize("option", ["none", "list"])
def test_none_leaves_both_where_the_launcher_runs_and_a_list_is_honoured(memd, tmp_path, option):
    cpus = two_cores()
    first = min(cpus)
    launch = HeldLaunch(memd, tmp_path, cpus, "--agent-cpus", "none" if option == "none" else str(first))
    try:
        rank, agent = launch.rank_pid(), agent_pid(launch.launcher)
        if option == "none":
            assert affinities(agent) == affinities(rank) == {cpus}
        else:
            assert affinities(agent) == {frozenset({first})}
            assert affinities(rank) == {cpus - {first}}
    finally:
        launch.finish()


def test_the_launcher_names_rendezvous_callers_as_torch_does():
    """The launcher's cheaper stand-in for torch's rendezvous helper names the same frames."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from dashrun.launch import launcher

    original = dynamic_rendezvous.get_method_name
    launcher._name_rendezvous_callers_cheaply()
    try:
        cheap = dynamic_rendezvous.get_method_name
        assert cheap is not original

        def a_step():
            return [(cheap(depth), original(depth)) for depth in (1, 2, 3)] + [(cheap(10_000), original(10_000))]

        def the_caller():
            return a_step()

        for ours, torchs in the_caller():
            assert ours == torchs
        assert the_caller()[2][0] == "the_caller"
    finally:
        dynamic_rendezvous.get_method_name = original
