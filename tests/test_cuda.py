"""The CUDA path: pinned staging, the copy on a side stream, restore onto GPU and CPU, NCCL end to end.

These run where a CUDA GPU is present (skipped elsewhere, as in CI): the rank's
state lives on the GPU, and the copy into the shared-memory buffer must run
beside the next forward/backward without letting the next optimizer step
reach the bytes being copied.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import TRAIN, dashrun_cmd, kill_tree, wait_for
from runs import assert_identical, final_states, last_step, starts
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_state(obj) -> dict:
    """A deep copy of ``obj.state_dict()`` whose tensors stay where they are."""
    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x
    return copy(obj.state_dict())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def big_model(width: int, device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width))
    model = model.to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model, opt, width: int) -> None:
    model(torch.randn(64, width, device=next(model.parameters()).device)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_the_copy_runs_on_a_side_stream_into_pinned_memory_after_the_optimizer_step(memd_factory, agent_factory,
                                                                                    rank_env):
    memd = memd_factory("--memory-limit", "8GiB")
    agent = agent_factory(memd)
    width = 8192  # 2 x 64 Mi parameters: with AdamW's moments 1.5 GiB, far slower to copy than one AdamW step
    model, opt = big_model(width, "cuda")
    train_step(model, opt, width)
    ckpt = rank_env(agent, "cuda-side-stream", 0, 1, model=model, optimizer=opt)
    torch.cuda.synchronize()
    expected_model, expected_opt = gpu_state(model), gpu_state(opt)
    expected_cuda_rng = torch.cuda.get_rng_state()

    # GPU work queued before save(): the state the checkpoint must hold is only final once it has run.
    torch.cuda._sleep(8 * 10**9)  # seconds of the compute stream (at most 2 GHz: 4 s or more)
    assert ckpt.save(1, force=True)
    snapshot = ckpt._current
    wait_for(snapshot.copied.is_set, 30, "the copy to be enqueued")
    assert not snapshot.gpu_done.query(), "save() waited for the GPU: the copy is not asynchronous"
    assert snapshot.buffer._pinned and snapshot.buffer.tensor.is_pinned()
    side_stream = ckpt._stager.side_stream
    assert side_stream is not None and side_stream != torch.cuda.current_stream()

    # The next step is enqueued at once; its optimizer step must wait (on the GPU) for the copy to finish.
    torch.randn(4, device="cuda")  # the CUDA RNG moves on after the save
    train_step(model, opt, width)
    assert ckpt.wait(timeout=300)
    torch.cuda.synchronize()
    assert not same(gpu_state(model), expected_model)  # the step after the save did change the state
    ckpt.close()

    model2, opt2 = big_model(width, "cuda")
    ckpt = rank_env(agent, "cuda-side-stream", 0, 1, model=model2, optimizer=opt2)
    assert ckpt.restore() == 2
    assert same(gpu_state(model2), expected_model) and same(gpu_state(opt2), expected_opt)
    assert next(model2.parameters()).is_cuda and opt2.state_dict()["state"][0]["exp_avg"].is_cuda
    assert torch.equal(torch.cuda.get_rng_state(), expected_cuda_rng)
    ckpt.close()


def test_a_checkpoint_saved_on_the_gpu_restores_onto_the_cpu(stack, rank_env):
    _, agent = stack
    width = 256
    model, opt = big_model(width, "cuda")
    for _ in range(2):
        train_step(model, opt, width)
    ckpt = rank_env(agent, "cuda-to-cpu", 0, 1, model=model, optimizer=opt)
    assert ckpt.save(4, force=True) and ckpt.wait(timeout=60)
    ckpt.close()
    model2, opt2 = big_model(width, "cpu")
    ckpt = rank_env(agent, "cuda-to-cpu", 0, 1, model=model2, optimizer=opt2)
    assert ckpt.restore() == 5
    assert same(gpu_state(model2), gpu_state(model)) and same(gpu_state(opt2), gpu_state(opt))
    assert not next(model2.parameters()).is_cuda
    train_step(model2, opt2, width)  # and it trains on from there
    ckpt.close()


STEPS, INTERVAL = 24, 4


def test_killed_nccl_job_on_the_gpu_resumes_bit_identical(memd, tmp_path):
    train_args = [str(TRAIN), "--steps", str(STEPS), "--interval", str(INTERVAL), "--device", "cuda"]
    reference = tmp_path / "reference"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", *train_args,
                             "--out", str(reference)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    out = tmp_path / "out"
    cmd = dashrun_cmd(memd, *train_args, "--out", str(out), "--delay", "0.1", job="cuda-kill", nproc=1)
    kill_at = random.Random().randint(INTERVAL + 1, STEPS - 3)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: last_step(out) >= kill_at or launcher.poll() is not None, 240, f"step {kill_at}")
    finally:
        kill_tree(launcher)
    assert launcher.returncode == -9, "the run finished before it could be killed"
    with memd.client() as client:
        committed = client.latest("cuda-kill")
    assert committed is not None

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert starts(out) == [0, committed.step + 1], f"killed at {kill_at}"
    assert_identical(final_states(reference, (0,)), out)
