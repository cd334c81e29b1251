"""DashrunCallback with the real transformers Trainer: a tiny GPT-2 built from a config, two CPU ranks (DDP over gloo).

A run SIGKILLed whole (launcher, ranks, dash-agent) and relaunched with the same command resumes from the
newest committed step; a cloud notice mid-epoch stops it at a step whose checkpoint is committed, and the
relaunch goes on at the very next one. Either way every loss from the resume point on is the uninterrupted
run's, bit for bit (the DataLoader is placed at the restored epoch and batch).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, dashrun_cmd, kill_tree, load_fake_metadata, wait_for
from integrations import assert_resumed_as_uninterrupted, last_step, preempted_at, runs, starts

pytest.importorskip("transformers", reason="the Hugging Face integration's extra is not installed: pip install 'dashrun[hf]'")

pytestmark = pytest.mark.slow

PROGRAM = REPO / "tests" / "bin" / "hf_train.py"
STEPS_PER_EPOCH = 8  # 64 samples, 4 a batch, 2 ranks
PREEMPTED = 75
# One thread a rank, as torchrun sets for more than one rank: the reference and dashrun's runs compute alike.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run under plain torchrun (the callback is off: no dashrun in the launch)."""
    out = tmp_path_factory.mktemp("hf-reference")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(PROGRAM),
                             "--out", str(out)], capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(runs(out)[0]) == 3 * STEPS_PER_EPOCH - 1
    return out


def launch(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    return proc.returncode, stderr


def test_a_trainer_killed_whole_resumes_from_the_newest_committed_step(memd, tmp_path, reference):
    out = tmp_path / "out"
    cmd = dashrun_cmd(memd, "--cloud", "none", str(PROGRAM), "--out", str(out), "--every", "5", "--delay", "0.1",
                      job="hf-kill")
    proc = launch(cmd)
    try:
        wait_for(lambda: last_step(out) >= 12 or proc.poll() is not None, 240, "the Trainer to train 12 steps")
    finally:
        kill_tree(proc)  # SIGKILL: the launcher, its ranks and dash-agent, with no time to save anything
    with memd.client() as client:
        newest = client.latest("hf-kill").step
    assert newest >= 9 and (newest + 1) % 5 == 0

    code, stderr = finish(launch(cmd))
    assert code == 0, stderr[-3000:]
    assert starts(out) == [0, newest + 1] == starts(out, 1)
    assert_resumed_as_uninterrupted(reference, out)


def test_a_notice_mid_epoch_loses_no_trainer_step(memd, tmp_path, reference):
    fake = load_fake_metadata().FakeMetadata("aws").start()
    out, job = tmp_path / "out", "hf-notice"
    try:
        proc = launch(dashrun_cmd(memd, "--cloud", "aws", "--metadata-endpoint", fake.url, "--poll-interval", "0.2",
                                  str(PROGRAM), "--out", str(out), "--every", "1000", "--delay", "0.1", job=job))
        wait_for(lambda: last_step(out) >= STEPS_PER_EPOCH + 2 or proc.poll() is not None, 240,
                 "the Trainer to train into its second epoch")
        fake.notice()
        code, stderr = finish(proc)
    finally:
        fake.stop()
    assert code == PREEMPTED, stderr[-3000:]
    step = preempted_at(out)[0]
    assert preempted_at(out, 1) == [step] and step % STEPS_PER_EPOCH not in (0, STEPS_PER_EPOCH - 1)  # mid-epoch
    with memd.client() as client:
        assert client.latest(job).step == step

    code, stderr = finish(launch(dashrun_cmd(memd, "--cloud", "none", str(PROGRAM), "--out", str(out), "--every",
                                             "1000", job=job)))
    assert code == 0, stderr[-3000:]
    assert starts(out) == [0, step + 1] == starts(out, 1)  # zero steps lost
    assert_resumed_as_uninterrupted(reference, out)
