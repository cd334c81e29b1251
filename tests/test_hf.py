"""DashrunCallback with the real transformers Trainer: a tiny GPT-2 built from a config (nothing downloaded), two
CPU ranks (DDP over gloo) under dashrun, dash-memd.

One job, three runs: a cloud notice mid-epoch (the fake metadata service) stops the first at a step committed on
every rank, and its relaunch goes on at the very next step; that run is SIGKILLed whole (launcher, ranks,
dash-agent) and the same command again resumes from the newest committed step. Every run logs the uninterrupted
run's loss at each of its steps, bit for bit (the DataLoader is placed at the restored epoch and batch).
"""

from __future__ import annotations

import pytest
from conftest import REPO, load_fake_metadata
from integrations import assert_resumed_as_uninterrupted, notice_kill_and_resume, reference_run, runs

pytest.importorskip("transformers", reason="the Hugging Face integration's extra is not installed: pip install 'dashrun[hf]'")
pytest.importorskip("accelerate", reason="the Hugging Face integration's extra is not installed: pip install 'dashrun[hf]'")

pytestmark = pytest.mark.slow

PROGRAM = REPO / "tests" / "bin" / "hf_train.py"
STEPS_PER_EPOCH = 8  # 64 sequences, 4 a batch, 2 ranks


def test_a_notice_mid_epoch_and_a_kill_both_resume_as_an_uninterrupted_train(memd, tmp_path):
    reference = reference_run(PROGRAM, tmp_path / "reference")
    assert max(runs(reference)[0]) == 3 * STEPS_PER_EPOCH - 1
    fake = load_fake_metadata().FakeMetadata("aws").start()
    try:
        notice_kill_and_resume(memd, PROGRAM, tmp_path / "out", "hf", fake, STEPS_PER_EPOCH)
    finally:
        fake.stop()
    assert_resumed_as_uninterrupted(reference, tmp_path / "out")
