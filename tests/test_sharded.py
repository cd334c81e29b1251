"""Sharded models end to end (FSDP2, tensor parallel, 2-D meshes, HSDP), with real processes: dashrun,
dash-agent, dash-memd and gloo ranks running tests/bin/sharded_train.py.

A resume at the same world size is compared bit for bit with an uninterrupted run (under plain torchrun, where
the Checkpointer is off); a restore at another world size or mesh is compared by every parameter's and optimizer
state's ``full_tensor()``, dumped by the saving run as it ends (its last step is a checkpoint) and by the
restoring run right after ``restore()`` (it has no step left to run).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, dashrun_cmd, kill_tree, wait_for
from runs import assert_identical, final_states, last_step, reference_run, starts

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "bin" / "sharded_train.py"
#: Checkpoints after steps 3, 7 and 11: the last step of a run is always one.
STEPS, INTERVAL = 12, 4
#: A saving run for a restore elsewhere: its last step (7) is checkpointed, so its final state is the checkpoint's.
SAVED_STEPS = 8


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd[-12:])}: {result.stderr[-3000:]}"
    return result


def train(memd, out: Path, job: str, nproc: int, *args: str, dump: Path | None = None) -> None:
    """One run of the script under dashrun; ``dump``: where rank 0 writes the full tensors as it ends."""
    extra = ["--dump", str(dump)] if dump else []
    run(dashrun_cmd(memd, str(SCRIPT), *args, "--out", str(out), *extra, job=job, nproc=nproc))


def assert_same_full_state(saved: dict, restored: dict, where: str) -> None:
    """Every parameter's and optimizer state's full tensor, the param groups and the scheduler, exactly equal."""
    # Not vacuous: the saving run had optimizer state for every parameter (Adam's step, exp_avg, exp_avg_sq).
    saved, restored = without_buffers(saved), without_buffers(restored)
    params = [k for k in saved if k.startswith("param/")]
    assert params and all(f"optim/{k[len('param/'):]}/exp_avg_sq" in saved for k in params), sorted(saved)
    assert saved.keys() == restored.keys(), f"{where}: keys differ: {sorted(saved.keys() ^ restored.keys())}"
    for key, value in saved.items():
        got = restored[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == value.dtype and got.shape == value.shape, (
                f"{where}: {key} is {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}, "
                f"saved {value.dtype} {tuple(value.shape)}")
            assert torch.equal(got, value), f"{where}: {key} differs"
        else:
            assert got == value, f"{where}: {key}: {got!r} != {value!r}"


def without_buffers(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("buffer/")}


def assert_buffers_restored(saved: dict, restored: dict, nproc: int, where: str) -> None:
    """The buffers rule: a plain buffer of a sharded model is each rank's own; a rank new to the world gets
    rank 0's."""
    names = {k.rsplit("/", 1)[0] for k in saved if k.startswith("buffer/")}
    assert names == {"buffer/seen"}, sorted(saved)
    saved_ranks = sum(1 for k in saved if k.startswith("buffer/seen/"))
    for name in names:
        assert any(not torch.equal(saved[f"{name}/rank0"], saved[f"{name}/rank{r}"]) for r in range(saved_ranks)), (
            "the ranks' buffers were all the same")
        for rank in range(nproc):
            own = saved[f"{name}/rank{rank if rank < saved_ranks else 0}"]
            assert torch.equal(restored[f"{name}/rank{rank}"], own), f"{where}: {name} of rank {rank}"


def restore_elsewhere(memd, tmp_path: Path, job: str, saved: dict, nproc: int, *args: str) -> None:
    """Restore ``job`` with ``nproc`` ranks and ``args`` (the mode, the shapes): exactly the saved state."""
    where = f"{nproc} ranks, {' '.join(args)}"
    out = tmp_path / f"restore-{nproc}-{'-'.join(a.lstrip('-') for a in args)}"
    dump = out.with_suffix(".pt")
    train(memd, out, job, nproc, "--steps", str(SAVED_STEPS), "--interval", str(INTERVAL), *args, dump=dump)
    assert starts(out) == [SAVED_STEPS], f"{where}: restore() did not return the step after the saved one"
    for rank in range(nproc):  # each rank read its pieces by byte range: not every saved rank's whole
        stats = json.loads((out / f"restore-rank{rank}.json").read_text())
        assert 0 < stats["sharded_read"] <= 1.2 * stats["sharded_needed"], f"{where}, rank {rank}: {stats}"
    restored = torch.load(dump, weights_only=False)
    assert_same_full_state(saved, restored, where)
    assert_buffers_restored(saved, restored, nproc, where)


def save_for_restore(memd, tmp_path: Path, job: str, nproc: int, *args: str) -> dict:
    """Train ``job`` for SAVED_STEPS steps; returns the full state it ended with (= its last checkpoint)."""
    out, dump = tmp_path / "saved", tmp_path / "saved.pt"
    train(memd, out, job, nproc, "--steps", str(SAVED_STEPS), "--interval", str(INTERVAL), *args, dump=dump)
    with memd.client() as client:
        assert client.latest(job).step == SAVED_STEPS - 1
    return torch.load(dump, weights_only=False)


FSDP_ARGS = ["--mode", "fsdp", "--steps", str(STEPS), "--interval", str(INTERVAL)]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted FSDP2 run on 2 ranks under plain torchrun (the Checkpointer is off there)."""
    out = tmp_path_factory.mktemp("fsdp-reference")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *FSDP_ARGS, "--out", str(out)]
    result = reference_run(cmd, timeout=240)  # tried again if torch's own teardown aborts a rank
    assert result.returncode == 0, f"{' '.join(cmd[-12:])}: {result.stderr[-3000:]}"
    return final_states(out)


def test_fsdp_killed_at_a_random_step_resumes_bit_identical(memd, tmp_path, fsdp_reference):
    out = tmp_path / "out"
    cmd = dashrun_cmd(memd, str(SCRIPT), *FSDP_ARGS, "--out", str(out), "--delay", "0.1", job="fsdp-kill")
    seed = int(os.environ.get("DASH_TEST_SEED") or random.randrange(1 << 32))
    print(f"kill point seed {seed} (DASH_TEST_SEED={seed} repeats it)")  # shown with a failure's output
    kill_at = random.Random(seed).randint(INTERVAL + 1, STEPS - 3)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with memd.client() as client:
            def committed() -> int:
                info = client.latest("fsdp-kill")
                return -1 if info is None else info.step

            # Past the first checkpoint, committed, and at the random step: then killed outright.
            wait_for(lambda: launcher.poll() is not None or (last_step(out) >= kill_at and committed() >= 0), 180,
                     f"step {kill_at} with a checkpoint committed")
    finally:
        kill_tree(launcher)  # launcher, agent and ranks together, with SIGKILL
    assert launcher.returncode == -9, "the run finished before it could be killed"
    with memd.client() as client:
        newest = client.latest("fsdp-kill")
    assert newest is not None and newest.step <= last_step(out)

    run(cmd)
    assert starts(out) == [0, newest.step + 1], f"killed at {kill_at}"
    assert starts(out, rank=1) == [0, newest.step + 1]
    assert_identical(fsdp_reference, out)


def test_fsdp_saved_on_2_ranks_restored_on_1_3_and_4_and_exported_whole(memd, tmp_path):
    saved = save_for_restore(memd, tmp_path, "fsdp-reshard", 2, "--mode", "fsdp")
    for nproc in (1, 3, 4):
        restore_elsewhere(memd, tmp_path, "fsdp-reshard", saved, nproc, "--mode", "fsdp")

    # Exported, every sharded tensor is whole: torch.load reads it, and DCP loads it in one process.
    export = [sys.executable, "-m", "dashrun", "export", "--memd", memd.address, "--token-file",
              str(memd.token_file), *memd.tls_args, "fsdp-reshard"]
    run([*export, str(tmp_path / "whole.pt"), "--format", "torch"])
    run([*export, str(tmp_path / "whole.dcp"), "--format", "dcp"])
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    params = {k[len("param/"):]: v for k, v in saved.items() if k.startswith("param/")}
    assert params and all(torch.equal(whole[name], value) for name, value in params.items())
    import torch.distributed.checkpoint as dcp

    loaded = {"model": {name: torch.zeros_like(value) for name, value in params.items()}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "whole.dcp"), no_dist=True)
    assert all(torch.equal(loaded["model"][name], value) for name, value in params.items())


def test_tp_on_a_2d_mesh_of_4_restored_on_1d_tp_meshes_of_2_and_4(memd, tmp_path):
    saved = save_for_restore(memd, tmp_path, "tp2d", 4, "--mode", "tp2d")
    restore_elsewhere(memd, tmp_path, "tp2d", saved, 2, "--mode", "tp")
    # At tensor-parallel degree 4, a row-wise weight's piece here is a column band of each saved one: a byte
    # range per row, still no more bytes read than needed.
    restore_elsewhere(memd, tmp_path, "tp2d", saved, 4, "--mode", "tp")


def test_uneven_shards_restored_on_fsdp_and_hsdp(memd, tmp_path):
    # 13 x 7 and 7 x 13 weights, 13- and 7-element biases: no dimension divides evenly by 2 or 3 ranks.
    shapes = ("--dim", "13", "--width", "7")
    saved = save_for_restore(memd, tmp_path, "uneven", 3, "--mode", "fsdp", *shapes)
    # FSDP on 3 ranks to FSDP on 2, and to HSDP on 4: sharded over 2, replicated over the other 2.
    for nproc, mode in ((2, "fsdp"), (4, "hsdp")):
        restore_elsewhere(memd, tmp_path, "uneven", saved, nproc, "--mode", mode, *shapes)
    # A model of other global shapes cannot take it: one clear error naming the key and both shapes.
    result = subprocess.run(dashrun_cmd(memd, str(SCRIPT), "--steps", str(SAVED_STEPS), "--mode", "fsdp", "--dim",
                                        "14", "--width", "7", "--out", str(tmp_path / "other"), job="uneven", nproc=1),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]  # dashrun's own last line names it, not only the rank's output
    assert "blocks.0.up.weight" in last and "(13, 7)" in last and "(14, 7)" in last, result.stderr[-3000:]



def test_fsdp_in_an_elastic_job_a_notice_shrinks_it_and_the_survivor_reshards(memd, tmp_path):
    """Two nodes of one rank each, FSDP2 over both (--nnodes 1:2): a notice on the second. The first takes the
    emergency checkpoint with it and goes on alone, its restore resharding the world-2 pieces; no step lost."""
    from test_elastic import FakeMetadata

    out, job, steps = tmp_path / "out", "fsdp-elastic", 40
    fake = FakeMetadata("aws").start()
    nodes = []
    try:
        for index, watch in ((1, ["--cloud", "none"]),
                             (2, ["--cloud", "aws", "--metadata-endpoint", fake.url, "--poll-interval", "0.2"])):
            cmd = dashrun_cmd(memd, "--nnodes", "1:2", "--local-addr", f"127.0.0.{index}", "--monitor-interval",
                              "0.1", *watch, str(SCRIPT), "--mode", "fsdp", "--steps", str(steps), "--interval",
                              str(INTERVAL), "--delay", "0.2", "--out", str(out), job=job, nproc=1)
            nodes.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        wait_for(lambda: last_step(out) >= 5 or any(n.poll() is not None for n in nodes), 180, "two nodes to train")
        assert all(n.poll() is None for n in nodes), nodes[0].communicate(timeout=30)[1][-3000:]
        fake.notice()
        _, noticed_err = nodes[1].communicate(timeout=120)
        assert nodes[1].returncode == 75, noticed_err[-3000:]
        _, err = nodes[0].communicate(timeout=180)
        assert nodes[0].returncode == 0, err[-3000:]
    finally:
        for node in nodes:
            kill_tree(node)
        fake.stop()
    noticed_at = int(re.search(r"^preempted (\d+)$", (out / "rank1.log").read_text(), re.M).group(1))
    assert starts(out) == [0, noticed_at + 1]  # the survivor went on from the emergency checkpoint
    # (The survivor's rank ends inside save() of the noticed step, before logging it; the noticed node logs it.)
    first, second = ([int(line.split()[0]) for line in (out / f"rank{r}.log").read_text().splitlines()
                      if line[:1].isdigit()] for r in (0, 1))
    assert len(first) == len(set(first)) and max(second) == noticed_at, "a step done twice"
    assert set(first) | set(second) == set(range(steps)), "a step lost"
    stats = json.loads((out / "restore-rank0.json").read_text())  # its restore at world 1: both saved ranks' pieces
    assert 0 < stats["sharded_read"] <= 1.2 * stats["sharded_needed"], stats
    assert "world 2 -> 1: 127.0.0.2 noticed" in err


NAMES_CHECK = """
import sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from dashrun.rank import sharded

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
fully_shard(model[0]), fully_shard(model)
optimizer = torch.optim.AdamW(model[0].parameters(), lr=0.1)
schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)

def same(ours, torchs, where):
    if isinstance(torchs, dict):
        assert list(ours) == list(torchs), (where, list(ours), list(torchs))
        for key in torchs:
            same(ours[key], torchs[key], f"{where}.{key}")
    elif isinstance(torchs, list):
        assert len(ours) == len(torchs), where
        for i, (a, b) in enumerate(zip(ours, torchs)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(torchs, torch.Tensor):
        assert ours is torchs, where  # the optimizer's own tensors, no copy
    else:
        assert type(ours) is type(torchs) and ours == torchs, (where, ours, torchs)

# Before any step torch gives the optimizer its state; the names are kept from then on.
same(sharded.state_dict_of(optimizer, model), get_optimizer_state_dict(model, optimizer), "first")
assert optimizer in sharded._optimizer_names
for step in range(6):
    if step == 3:  # a new group: its parameters' names are asked of torch again
        optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step(), optimizer.zero_grad(), schedule.step()
    same(sharded.state_dict_of(optimizer, model), get_optimizer_state_dict(model, optimizer), f"step {step}")
assert len(sharded._optimizer_names[optimizer][2]) == 4
print("same", optimizer.param_groups[0]["lr"])
dist.destroy_process_group()
"""


def test_an_optimizer_of_dtensors_is_named_as_torch_names_it_at_every_save(tmp_path):
    """save() names an FSDP2 optimizer's state as get_optimizer_state_dict does, from torch's answer kept
    from the first save: the same keys, groups and learning rates as a schedule changes them, the optimizer's
    own tensors, and a group added later named too."""
    script = tmp_path / "names.py"
    script.write_text(NAMES_CHECK)
    result = run([sys.executable, str(script), str(tmp_path / "store")], timeout=120)
    assert result.stdout.split() == ["same", str(0.1 * 0.5 ** 6)]
