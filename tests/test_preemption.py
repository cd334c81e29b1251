"""Spot interruption notices end to end: the fake metadata service, real agents, ranks and dash-memd.

A notice makes every rank of the job checkpoint the same step, wait until it is
committed, stop, and dashrun exit 75; the same command then resumes at the very
next step (zero steps lost), ending bit for bit where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
from conftest import REFERENCE_STEPS, TRAIN, dashrun_cmd, kill_tree, load_fake_metadata, wait_for
from runs import assert_identical, last_step, preempted_at, starts

pytestmark = pytest.mark.slow

FakeMetadata = load_fake_metadata().FakeMetadata
NO_PERIODIC = ["--steps", str(REFERENCE_STEPS), "--interval", "1000"]  # only a notice makes a checkpoint
PREEMPTED = 75


@pytest.fixture
def fake_factory():
    started = []

    def make(cloud: str, **kwargs) -> FakeMetadata:
        fake = FakeMetadata(cloud, **kwargs).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.stop()


def watched(fake: FakeMetadata, cloud: str) -> list[str]:
    return ["--cloud", cloud, "--metadata-endpoint", fake.url, "--poll-interval", "0.2"]


def launch(cmd: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    return proc.returncode, stderr


def resume(memd, out, job: str) -> None:
    """The relaunch on a replacement node (no notice there) resumes where the notice stopped the job."""
    result = subprocess.run(dashrun_cmd(memd, "--cloud", "none", str(TRAIN), *NO_PERIODIC, "--out", str(out), job=job),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("cloud, lead", [("aws", 120.0), ("gcp", None), ("azure", 30.0)])
def test_a_notice_mid_run_loses_zero_steps(memd, fake_factory, tmp_path, reference, cloud, lead):
    fake = fake_factory(cloud)
    out, job = tmp_path / "out", f"notice-{cloud}"
    proc = launch(dashrun_cmd(memd, *watched(fake, cloud), str(TRAIN), *NO_PERIODIC, "--out", str(out),
                              "--delay", "0.1", job=job))
    wait_for(lambda: last_step(out) >= 8 or proc.poll() is not None, 180, "training to reach step 8")
    fake.notice(lead=lead) if lead is not None else fake.notice()
    code, stderr = finish(proc)
    assert code == PREEMPTED, stderr[-3000:]
    step = preempted_at(out, 0)[0]
    assert preempted_at(out, 1) == [step] and last_step(out) == step  # every rank, the same step, none after
    assert f"preempted by {cloud}" in stderr and f"step {step} is safe in dash-memd" in stderr
    with memd.client() as client:
        info = client.latest(job)
        notice = next(j for j in client.list()["jobs"] if j["job"] == job)["notice"]
    assert info.step == step
    assert notice["cloud"] == cloud and not notice["early"]
    # Safe before the cloud takes the machine: committed (dash-memd's clock) before the notice's own deadline.
    assert info.committed_at < notice["deadline"], (info.committed_at, notice)
    if cloud == "azure":  # told the platform it may go ahead, once the state was safe
        wait_for(lambda: fake.acknowledgements, 30, "the Preempt event to be acknowledged")

    resume(memd, out, job)
    assert starts(out) == [0, step + 1]  # zero steps lost
    assert_identical(reference, out)


def test_a_notice_during_a_save(memd, fake_factory, tmp_path, reference):
    fake = fake_factory("aws")
    out, job = tmp_path / "out", "during-save"
    proc = launch(dashrun_cmd(memd, *watched(fake, "aws"), str(TRAIN), "--steps", str(REFERENCE_STEPS),
                              "--interval", "5", "--out", str(out), "--delay", "0.05", job=job))
    wait_for(lambda: last_step(out) >= 4 or proc.poll() is not None, 180, "the periodic checkpoint of step 4")
    fake.notice()  # while step 4's snapshot is staged and streamed
    code, stderr = finish(proc)
    assert code == PREEMPTED, stderr[-3000:]
    step = preempted_at(out)[0]
    with memd.client() as client:
        assert client.latest(job).step == step
    resume(memd, out, job)
    assert starts(out) == [0, step + 1]
    assert_identical(reference, out)


def test_a_notice_while_restoring(memd, fake_factory, tmp_path, reference):
    out, job = tmp_path / "out", "during-restore"
    first = fake_factory("gcp")
    proc = launch(dashrun_cmd(memd, *watched(first, "gcp"), str(TRAIN), *NO_PERIODIC, "--out", str(out),
                              "--delay", "0.1", job=job))
    wait_for(lambda: last_step(out) >= 5 or proc.poll() is not None, 180, "step 5")
    first.notice()
    assert finish(proc)[0] == PREEMPTED
    step = preempted_at(out)[0]

    again = fake_factory("gcp")
    again.notice()  # the replacement node is preempted too, while its ranks restore
    code, stderr = finish(launch(dashrun_cmd(memd, *watched(again, "gcp"), str(TRAIN), *NO_PERIODIC,
                                             "--out", str(out), job=job)))
    assert code == PREEMPTED, stderr[-3000:]
    second = preempted_at(out)[1]
    assert second > step and starts(out) == [0, step + 1]
    resume(memd, out, job)
    assert starts(out) == [0, step + 1, second + 1]
    assert_identical(reference, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_notice_on_one_node_of_two(memd, fake_factory, tmp_path, reference):
    """Node A gets the notice, node B none: B's rank takes the same emergency step, and both exit 75."""
    fake = fake_factory("aws")
    out, job = tmp_path / "out", "two-nodes"
    endpoint = f"127.0.0.1:{_free_port()}"

    def node(host_store: bool, *cloud: str) -> list[str]:
        return dashrun_cmd(memd, *cloud, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                           "--rdzv-id", job, "--rdzv-conf", f"is_host={int(host_store)}", str(TRAIN), *NO_PERIODIC,
                           "--out", str(out), "--delay", "0.1", job=job, nproc=1)

    # One rank per node: torchrun leaves OMP_NUM_THREADS alone then, and the reference ran with 1 thread.
    nodes = [launch(node(True, *watched(fake, "aws")), OMP_NUM_THREADS="1"),
             launch(node(False, "--cloud", "none"), OMP_NUM_THREADS="1")]
    wait_for(lambda: min(last_step(out, 0), last_step(out, 1)) >= 6 or any(p.poll() is not None for p in nodes),
             180, "both nodes to train")
    fake.notice()
    results = [finish(p) for p in nodes]
    assert [code for code, _ in results] == [PREEMPTED, PREEMPTED], results[1][1][-3000:]
    assert "another node" in results[1][1]
    steps = {preempted_at(out, 0)[0], preempted_at(out, 1)[0]}
    assert len(steps) == 1
    step = steps.pop()
    with memd.client() as client:
        newest = client.latest(job)
    assert newest.step == step and newest.world == 2

    def relaunch(host_store: bool) -> subprocess.Popen:
        return launch(node(host_store, "--cloud", "none"), OMP_NUM_THREADS="1")

    again = [relaunch(True), relaunch(False)]
    assert [finish(p, 300)[0] for p in again] == [0, 0]
    assert starts(out, 0)[-1] == starts(out, 1)[-1] == step + 1
    assert_identical(reference, out)


def test_ranks_that_never_save_again_are_stopped_before_the_deadline(memd, fake_factory, tmp_path):
    fake = fake_factory("aws")
    out, job = tmp_path / "out", "stalled"
    proc = launch(dashrun_cmd(memd, *watched(fake, "aws"), str(TRAIN), "--steps", "30", "--interval", "3",
                              "--stall-after", "7", "--out", str(out), job=job))
    wait_for(lambda: last_step(out) >= 7 or proc.poll() is not None, 180, "the ranks to stall")
    fake.notice(lead=12.0)
    pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    code, stderr = finish(proc)
    assert code == PREEMPTED, stderr[-3000:]
    assert "stopped before the notice's deadline" in stderr  # by the launcher's own deadline, ahead of the notice's
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    with memd.client() as client:
        assert client.latest(job).step == 5  # the newest periodic checkpoint stands


def test_sigterm_to_the_launcher_or_to_its_whole_group_is_a_notice_that_loses_zero_steps(memd, tmp_path, reference):
    """SIGTERM as Kubernetes sends it (to a container's first process: the launcher alone) and as Slurm does (to
    every process of the job step: the launcher's process group, each rank, which torch starts in a session of its
    own, and dash-agent, which the launcher starts again) takes the emergency checkpoint as a cloud's notice does:
    exit 75 with the same line, the step committed, and the same command resumes at the very next step."""
    out, job = tmp_path / "out", "sigterm"
    cmd = dashrun_cmd(memd, "--cloud", "none", str(TRAIN), *NO_PERIODIC, "--out", str(out), "--delay", "0.1",
                      job=job)
    stopped: list[int] = []
    for whole_group in (False, True):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        begun = stopped[-1] + 1 if stopped else 0
        try:
            wait_for(lambda: last_step(out) >= begun + 5 or proc.poll() is not None, 180, "5 steps trained")
            if whole_group:
                step_processes = psutil.Process(proc.pid).children(recursive=True)  # the ranks and dash-agent
                assert len([p for p in step_processes if str(TRAIN) in p.cmdline()]) == 2
                os.killpg(proc.pid, signal.SIGTERM)
                for process in step_processes:
                    process.send_signal(signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
        except BaseException:
            kill_tree(proc)
            raise
        # Within the grace (torchrun's --shutdown-timeout): a rank that outlived it would be SIGKILLed, and its
        # step would not be said safe below.
        code, stderr = finish(proc)
        assert code == PREEMPTED, stderr[-3000:]
        step = preempted_at(out, 0)[-1]
        assert preempted_at(out, 1)[-1] == step and last_step(out) == step  # every rank, the same step, none after
        assert f"preempted by SIGTERM: step {step} is safe in dash-memd; run the same command" in stderr
        assert "dashrun: error" not in stderr
        with memd.client() as client:
            assert client.latest(job).step == step
        stopped.append(step)

    resume(memd, out, job)
    assert starts(out) == [0, stopped[0] + 1, stopped[1] + 1]  # zero steps lost
    assert_identical(reference, out)


def test_an_early_warning_shortens_the_interval(memd_factory, fake_factory, tmp_path):
    memd = memd_factory("--keep-ram", "50", "--keep-disk", "50")
    fake = fake_factory("aws")
    out, job = tmp_path / "out", "rebalance"
    proc = launch(dashrun_cmd(memd, *watched(fake, "aws"), str(TRAIN), *NO_PERIODIC, "--early-interval", "3",
                              "--out", str(out), "--delay", "0.1", job=job))
    wait_for(lambda: last_step(out) >= 5 or proc.poll() is not None, 180, "step 5")
    fake.early()  # a rebalance recommendation: keep going, but checkpoint more often
    code, stderr = finish(proc)
    assert code == 0, stderr[-3000:]
    with memd.client() as client:
        listing = next(j for j in client.list()["jobs"] if j["job"] == job)
    steps = [c["step"] for c in listing["checkpoints"]]
    assert len(steps) >= 3 and all(b - a == 3 for a, b in zip(steps, steps[1:]))
    assert listing["notice"]["early"] is True
    assert preempted_at(out) == []
    status = subprocess.run([sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file",
                             str(memd.token_file), "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(status.stdout)["jobs"][0]["notice"]["kind"] == "rebalance"
