"""A relaunch under a job id says what it resumes, that a finished job is complete, and stops in one line at a
checkpoint the script's state does not fit (a derived id is the script's path and arguments, not its contents)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import torch
from conftest import TRAIN, dashrun_cmd
from runs import starts

from dashrun.errors import RestoreMismatchError
from dashrun.launch.launcher import _ago
from dashrun.rank.mismatch import must_fit

#: A line a rank writes to the launcher's stderr: its log ("08:05:57 rank 1 dashrun: ...") or torch's prefix.
RANK_LINE = re.compile(r"^(\d\d:\d\d:\d\d rank \d+ |\[rank\d+\]: )")


def launch(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_relaunch_says_where_it_resumes_that_a_finished_job_is_complete_and_where_another_model_differs(
        memd, tmp_path):
    job, out = "relaunched", tmp_path / "out"
    cmd = dashrun_cmd(memd, str(TRAIN), "--steps", "10", "--interval", "5", "--out", str(out), job=job)
    first = launch(cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"dashrun: starting {job} from step 0 (no checkpoint of it yet)" in first.stderr.splitlines()

    # The same command again: every step was trained and step 9, the last, is the newest checkpoint.
    again = launch(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stderr.splitlines()
    resuming = [i for i, line in enumerate(lines) if re.fullmatch(
        rf"dashrun: resuming {job} from step 9 \(saved \d+ (s|min) ago\)", line)]
    ranks = [i for i, line in enumerate(lines) if RANK_LINE.match(line)]
    assert resuming and ranks and resuming[0] < ranks[0], again.stderr[-3000:]
    assert starts(out) == [0, 10]
    assert any(f"dashrun: job {job} is complete: its newest checkpoint, step 9, was restored and no step was left "
               "to train; pass --fresh" in line for line in lines), again.stderr[-3000:]

    # The script's model made wider, launched the same way: it resumes the same job, whose tensors do not fit.
    wider = launch([*cmd, "--width", "48"])
    assert wider.returncode == 2, wider.stderr[-3000:]
    last = wider.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dashrun: error: job {job}'s checkpoint of step 9 does not fit this run's model=: "
                           "module.embed.weight is [64, 32] in the checkpoint, [64, 48] here, and 7 more "
                           "differences"), last
    assert "--fresh" in last and "a new --job-id" in last, last
    # Each rank says it in one line: no traceback, no line per parameter (torch's message has 8, on every rank).
    assert "Traceback" not in wider.stderr and "copying a param" not in wider.stderr, wider.stderr[-3000:]
    assert [line.split(": ")[0] for line in wider.stderr.splitlines() if "RestoreMismatchError" in line] in (
        ["[rank0]", "[rank1]"], ["[rank1]", "[rank0]"]), wider.stderr[-3000:]


def fits(model_or_optimizer, state, name="model"):
    with must_fit("j", 9, name, model_or_optimizer):
        model_or_optimizer.load_state_dict(state)


def test_other_shapes_or_keys_at_restore_are_one_line_naming_the_job_and_the_way_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(RestoreMismatchError) as wider:
        fits(model, {"0.weight": torch.zeros(3, 5), "0.bias": torch.zeros(2)})
    assert wider.value.message == ("job j's checkpoint of step 9 does not fit this run's model=: 0.weight is [3, 5] "
                                   "in the checkpoint, [3, 4] here, and 1 more difference")
    assert "--fresh" in wider.value.hint and "--job-id" in wider.value.hint and "j's" in wider.value.hint
    with pytest.raises(RestoreMismatchError, match=r'model=: Missing key\(s\) in state_dict: "0.bias", and 1 more '
                                                   r'difference \(hint'):
        fits(model, {"0.weight": torch.zeros(3, 4), "1.weight": torch.zeros(1)})  # 1.weight: an unexpected key

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).state_dict()
    with pytest.raises(RestoreMismatchError, match="optimizer=: loaded state dict contains a parameter group"):
        fits(optimizer, other, "optimizer")

    class Cursor:
        def load_state_dict(self, state):
            self.epoch = state["epoch"]

    with pytest.raises(RestoreMismatchError, match="data=: the saved state has no key 'epoch'"):
        fits(Cursor(), {"position": 3}, "data")

    class Broken:
        def load_state_dict(self, state):
            raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):  # not about the checkpoint: passed on as it is
        fits(Broken(), {})


def test_ages_are_said_as_a_person_says_them():
    now = time.time()
    assert [_ago(now - seconds) for seconds in (-30, 5, 59, 60, 17 * 60 + 40, 3 * 3600 + 59, 86400, 9 * 86400)] == [
        "0 s ago", "5 s ago", "59 s ago", "1 min ago", "17 min ago", "3 h ago", "1 day ago", "9 days ago"]
