"""DashrunCheckpoint with the real Lightning Trainer: two CPU ranks (DDP over gloo) under dashrun, dash-memd.

One job, three runs: a cloud notice mid-epoch (the fake metadata service) stops the first at a step committed on
every rank, and its relaunch goes on at the very next step; that run is SIGKILLed whole (launcher, ranks,
dash-agent) and the same command again resumes from the newest committed step. Every run logs the uninterrupted
run's loss at each of its steps, bit for bit (the data comes from torchdata's StatefulDataLoader, whose position
the fit loop's state holds), and Lightning's ModelCheckpoint keeps saving beside the callback.
"""

from __future__ import annotations

import re

import pytest
from conftest import REPO, load_fake_metadata
from integrations import assert_resumed_as_uninterrupted, notice_kill_and_resume, reference_run, runs

pytest.importorskip("lightning", reason="the Lightning integration's extra is not installed: pip install 'dashrun[lightning]'")
pytest.importorskip("torchdata", reason="torchdata (in the test extra) is not installed")

pytestmark = pytest.mark.slow

PROGRAM = REPO / "tests" / "bin" / "lightning_train.py"
STEPS_PER_EPOCH = 8  # 64 samples, 4 a batch, 2 ranks


def test_a_notice_mid_epoch_and_a_kill_both_resume_as_an_uninterrupted_fit(memd, tmp_path):
    reference = reference_run(PROGRAM, tmp_path / "reference")
    assert max(runs(reference)[0]) == 3 * STEPS_PER_EPOCH - 1
    fake = load_fake_metadata().FakeMetadata("aws").start()
    try:
        notice_kill_and_resume(memd, PROGRAM, tmp_path / "out", "lightning", fake, STEPS_PER_EPOCH)
    finally:
        fake.stop()
    assert_resumed_as_uninterrupted(reference, tmp_path / "out")
    assert (tmp_path / "out" / "lightning" / "last.ckpt").exists()  # Lightning's ModelCheckpoint, beside it


def test_fsdp2_under_the_model_parallel_strategy_resumes_as_an_uninterrupted_fit(memd, tmp_path):
    reference = reference_run(PROGRAM, tmp_path / "reference", "--strategy", "fsdp2")
    fake = load_fake_metadata().FakeMetadata("aws").start()
    try:
        notice_kill_and_resume(memd, PROGRAM, tmp_path / "out", "lightning-fsdp2", fake, STEPS_PER_EPOCH,
                               extra=("--strategy", "fsdp2"))
    finally:
        fake.stop()
    assert_resumed_as_uninterrupted(reference, tmp_path / "out")
    for rank in (0, 1):  # every run trained (and restored) FSDP2's sharded parameters, not replicated ones
        assert set(re.findall(r"^sharded (\w+)$", (tmp_path / "out" / f"rank{rank}.log").read_text(), re.M)) == {"True"}
