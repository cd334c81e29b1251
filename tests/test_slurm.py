"""dashrun under a real single-node Slurm (slurmctld, slurmd, munged of the test's own, as root).

The job is docs/slurm.md's script, examples/slurm/train.sbatch, as it is: submitted with sbatch, signalled as
Slurm does before a time limit or a preemption (``scancel --signal=TERM --full``: the batch shell and every
process of the job), it takes the emergency checkpoint, exits 75, requeues itself, runs again under the same
Slurm job id and resumes at the very next step, ending bit for bit where an uninterrupted run ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REFERENCE_STEPS, REPO, TRAIN, wait_for
from runs import assert_identical, last_step, preempted_at, starts

from dashrun.testing import slurm

pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"


@pytest.fixture
def cluster(short_tmp):
    reason = slurm.unavailable()
    if reason:
        pytest.skip(reason)
    started = slurm.Slurm(short_tmp / "slurm")
    try:
        yield started.start()
    finally:
        started.stop()


@pytest.mark.timeout(660)
def test_a_scancel_term_checkpoints_requeues_and_resumes_with_no_step_lost(cluster, memd, tmp_path, reference):
    out = tmp_path / "out"
    env = cluster.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", DASH_MEMD=memd.address,
                      DASH_TOKEN_FILE=str(memd.token_file), DASH_OPERATOR_KEY=str(memd.operator_key),
                      DASH_CLOUD="none", DASH_NPROC="2")
    log = tmp_path / "slurm-%j.out"  # --open-mode=append: both runs of the job in one file
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--output", str(log), "--chdir", str(tmp_path), str(SCRIPT), str(TRAIN),
         "--steps", str(REFERENCE_STEPS), "--interval", "1000", "--delay", "0.1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    output = tmp_path / f"slurm-{job}.out"
    wait_for(lambda: last_step(out) >= 8, 240, "the Slurm job to train 8 steps")
    cluster.run("scancel", "--signal=TERM", "--full", job)

    wait_for(lambda: preempted_at(out) and preempted_at(out, 1), 120, "the emergency checkpoint on both ranks")
    step = preempted_at(out)[0]
    assert preempted_at(out, 1) == [step]
    # Slurm holds a requeued job back until its job credential expires (cred_expire, 120 s by default; released
    # sooner, its second run fails with "Job credential revoked"): the test's slurm.conf sets cred_expire=10.
    wait_for(lambda: cluster.job(job).get("Restarts") == "1", 120, "the job to be requeued")
    try:
        wait_for(lambda: cluster.job(job).get("JobState") in ("COMPLETED", "FAILED"), 420,
                 f"the requeued job to finish (see {output})")
    except AssertionError as e:
        raise AssertionError(f"{e}: job {cluster.job(job)}, node {cluster.node_state()}") from None
    assert cluster.job(job).get("JobState") == "COMPLETED", output.read_text()[-3000:]
    text = output.read_text()
    assert "dashrun exited 75 (restart 0)" in text and "dashrun exited 0 (restart 1)" in text, text[-3000:]
    assert cluster.job(job).get("Restarts") == "1"
    assert starts(out) == [0, step + 1] == starts(out, 1)  # zero steps lost
    with memd.client() as client:
        assert client.latest(f"slurm-{job}").step == step  # the same job to dash-memd, before and after the requeue
    assert_identical(reference, out)
