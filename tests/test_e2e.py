"""End to end, with real processes: dashrun, dash-agent, dash-memd and 2 gloo ranks.

Every interrupted run is compared bit for bit with an uninterrupted run of
the same program (under plain torchrun, where the Checkpointer is off).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import REFERENCE_STEPS, TRAIN, dashrun_cmd, kill_tree, wait_for
from runs import assert_identical, final_states, last_step, reference_run, starts

from dashrun.memd.store.tiers.base import MANIFEST

pytestmark = pytest.mark.slow

STEPS, INTERVAL = REFERENCE_STEPS, 5
TRAIN_ARGS = ["--steps", str(STEPS), "--interval", str(INTERVAL)]


def run(cmd: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_killed_at_a_random_step_resumes_bit_identical(memd, tmp_path, reference):
    out = tmp_path / "out"
    cmd = dashrun_cmd(memd, str(TRAIN), *TRAIN_ARGS, "--out", str(out), "--delay", "0.05", job="random-kill")
    seed = int(os.environ.get("DASH_TEST_SEED") or random.randrange(1 << 32))
    print(f"kill point seed {seed} (DASH_TEST_SEED={seed} repeats it)")  # shown with a failure's output
    kill_at = random.Random(seed).randint(INTERVAL + 1, STEPS - 3)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: last_step(out) >= kill_at or launcher.poll() is not None, 180, f"step {kill_at}")
    finally:
        kill_tree(launcher)  # launcher, agent and ranks together, with SIGKILL
    assert launcher.returncode == -9, "the run finished before it could be killed"
    with memd.client() as client:
        committed = client.latest("random-kill")
    assert committed is not None and committed.step <= last_step(out)

    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert starts(out) == [0, committed.step + 1], f"killed at {kill_at}"
    assert_identical(reference, out)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_launcher_killed_outright_takes_its_node_with_it_and_the_same_command_resumes(tmp_path, reference):
    """``kill -9`` of a laptop run's process group reaches the launcher alone (its ranks, dash-agent and the
    private dash-memd each run in a session of their own): the ranks die with it, dash-agent and dash-memd finish
    what they hold and exit, and the same command resumes from the newest committed step."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    memd_dir, out = tmp_path / "cache" / "dashrun" / "memd", tmp_path / "out"
    cmd = [sys.executable, "-m", "dashrun", "--nproc-per-node", "2", str(TRAIN), *TRAIN_ARGS, "--out", str(out),
           "--delay", "0.1"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env},
                                start_new_session=True)
    node: list[psutil.Process] = []
    try:
        wait_for(lambda: last_step(out) >= 2 * INTERVAL + 2 or launcher.poll() is not None, 180,
                 "two checkpoints taken")
        node = psutil.Process(launcher.pid).children(recursive=True)
        os.killpg(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=30) == -signal.SIGKILL, "the run finished before it could be killed"
        wait_for(lambda: not alive(node), 60, "the ranks, dash-agent and the private dash-memd to exit")
    finally:
        kill_tree(launcher)
        for leftover in alive(node):
            leftover.kill()
    assert len(node) >= 4  # 2 ranks, dash-agent, dash-memd
    assert "is gone: shutting down" in (memd_dir / "memd.log").read_text()
    (job,) = [path.name for path in (memd_dir / "jobs").iterdir()]
    on_disk = sorted(int(path.parent.name) for path in (memd_dir / "jobs" / job).glob(f"*/{MANIFEST}"))
    assert on_disk and on_disk[-1] >= INTERVAL - 1  # what dash-memd held, written before it exited

    result = run(cmd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming {job} from step {on_disk[-1]}" in result.stderr
    assert starts(out) == [0, on_disk[-1] + 1]
    assert_identical(reference, out)


def crashed_run(memd, out: Path, job: str, crash_at: str, expect_code: int = 1,
                *extra: str) -> subprocess.CompletedProcess:
    cmd = dashrun_cmd(memd, str(TRAIN), *TRAIN_ARGS, "--out", str(out), *extra, job=job)
    result = run(cmd, env={"DASH_CRASH_AT": crash_at})
    assert result.returncode == expect_code, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("point", ["rank.staging", "rank.handoff"])
def test_rank_killed_while_checkpointing(memd, tmp_path, reference, point):
    out = tmp_path / "out"
    result = crashed_run(memd, out, point, f"{point}@rank=1,step=9")
    assert "rank 1 failed first" in result.stderr
    with memd.client() as client:
        committed = client.latest(point)
    # Staging never finished: step 9 cannot commit. After the handoff it may, if rank 0's shard made it too.
    assert committed.step == 4 if point == "rank.staging" else committed.step in (4, 9)

    result = run(dashrun_cmd(memd, str(TRAIN), *TRAIN_ARGS, "--out", str(out), job=point))
    assert result.returncode == 0, result.stderr[-3000:]
    assert starts(out) == [0, committed.step + 1]
    assert_identical(reference, out)


def test_agent_killed_mid_stream(memd_factory, tmp_path, reference):
    memd = memd_factory("--keep-ram", "20", "--keep-disk", "20")
    out = tmp_path / "out"
    # The 3rd shard the agent streams is the first of step 9: it dies half-way through it (once: the
    # agent the launcher restarts passes on).
    result = crashed_run(memd, out, "agent-crash", f"channel.mid_data@nth=3,once={tmp_path / 'crashed'}", 0,
                         "--delay", "0.2")
    assert "restarting it" in result.stderr
    with memd.client() as client:
        steps = [c["step"] for c in client.list()["jobs"][0]["checkpoints"]]
        assert client.latest("agent-crash").step == STEPS - 1
    assert 4 in steps and 9 not in steps          # the truncated shard never made step 9 visible
    assert 14 in steps                            # the restarted agent delivered the next one
    assert_identical(reference, out)               # training itself never noticed


@pytest.mark.parametrize("point", ["disk.mid_write", "disk.before_rename"])
def test_memd_killed_during_a_disk_write(memd_factory, tmp_path, reference, point):
    memd = memd_factory()
    port, data_dir = memd.port, memd.data_dir
    memd.stop()
    crashing = memd_factory(data_dir=data_dir)
    crashing.stop()
    crashing.extra = ()
    os.environ["DASH_CRASH_AT"] = f"{point}@step=9"
    try:
        crashing.start(port=port)
    finally:
        del os.environ["DASH_CRASH_AT"]
    out = tmp_path / "out"
    cmd = dashrun_cmd(crashing, str(TRAIN), *TRAIN_ARGS, "--out", str(out), "--delay", "0.2", job="memd-crash")
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: crashing.proc.poll() is not None, 120, "dash-memd to crash in its disk write")
        restarted = memd_factory(data_dir=data_dir)
        restarted.stop()
        restarted.start(port=port)
        assert "interrupted write" in restarted.log()
        with restarted.client() as client:
            # the agent may already have delivered step 14 to the restarted dash-memd: ask what it holds, not the newest
            steps = [c["step"] for c in client.list()["jobs"][0]["checkpoints"]]
        assert 4 in steps and 9 not in steps, steps   # step 9 was only in the lost RAM
        _, stderr = launcher.communicate(timeout=240)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, stderr[-3000:]
    with restarted.client() as client:
        assert client.latest("memd-crash").step == STEPS - 1
    assert_identical(reference, out)


BN_ARGS = ["--model", "bn", "--steps", "20", "--interval", str(INTERVAL)]


@pytest.fixture(scope="module")
def bn_reference(tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted run of the BatchNorm model under plain torchrun."""
    out = tmp_path_factory.mktemp("bn-reference")
    result = reference_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(TRAIN),
                            *BN_ARGS, "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return final_states(out)


def test_ddp_batchnorm_statistics_resume_bit_identical(memd, tmp_path, bn_reference):
    """The statistics differ between the DDP ranks after each forward and span both ranks' slices of the
    replicated state: a checkpoint holds rank 0's, which DDP broadcasts at the next forward, not a mix of both."""
    out = tmp_path / "out"
    cmd = dashrun_cmd(memd, str(TRAIN), *BN_ARGS, "--out", str(out), "--delay", "0.2", job="bn")
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with memd.client() as client:
            def committed() -> int:
                info = client.latest("bn")
                return -1 if info is None else info.step

            wait_for(lambda: launcher.poll() is not None or committed() >= 9, 180, "step 9 to be committed")
    finally:
        kill_tree(launcher)
    assert launcher.returncode == -9, "the run finished before it could be killed"
    with memd.client() as client:
        newest = client.latest("bn")

    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert starts(out) == [0, newest.step + 1]
    assert_identical(bn_reference, out)
