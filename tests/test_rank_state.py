"""What each rank's state becomes through a real save and restore (dash-agent and dash-memd, ranks simulated in
one process): module buffers, which are not alike on every rank, and the order of every state dict's keys."""

from __future__ import annotations

import pytest
import torch
from runs import Cursor

from dashrun.rank import statetree
from dashrun.rank.snapshot import BUFFERS, capture
from dashrun.wire.layout import split

pytestmark = pytest.mark.slow  # a real dash-memd and dash-agent; DistributedDataParallel's first start


@pytest.fixture
def gloo_group(tmp_path):
    """A process group of one, so that a test can wrap its models in DistributedDataParallel."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batchnorm_model(params_seed: int, buffers_seed: int, wrap: str) -> torch.nn.Module:
    """Parameters alike on every rank, BatchNorm statistics each rank's own, wide enough to span every rank's slice."""
    torch.manual_seed(params_seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4096))
    shared = torch.zeros(8)
    model[0].register_buffer("shared", shared)       # one buffer under two names
    model[1].register_buffer("shared", shared)
    model.register_buffer("scratch", torch.zeros(4), persistent=False)  # not in the state dict: not saved
    generator = torch.Generator().manual_seed(buffers_seed)
    with torch.no_grad():
        model[1].running_mean.normal_(generator=generator)
        model[1].running_var.uniform_(0.5, 2.0, generator=generator)
        model[1].num_batches_tracked.fill_(buffers_seed)
        shared.normal_(generator=generator)
        model.scratch.fill_(buffers_seed)
    if wrap == "plain":
        return model
    own = {"broadcast_buffers": False} if wrap == "ddp-own-buffers" else {}
    return torch.nn.parallel.DistributedDataParallel(model, **own)


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")
@pytest.mark.parametrize("wrap", ["plain", "ddp", "ddp-own-buffers"])
def test_save_takes_module_buffers_out_of_the_replicated_state(gloo_group, wrap):
    model = batchnorm_model(0, 1, wrap)
    prefix = "" if wrap == "plain" else "module."
    for rank in (0, 1):
        snapshot = capture(0, 0, {"model": model, "data": Cursor(rank)}, {"data"}, rank=rank)
        replicated = statetree.unflatten(snapshot.rep_tree, snapshot.rep_leaves)["model"]
        private = statetree.unflatten(snapshot.priv_tree, snapshot.priv_leaves)
        assert list(replicated) == list(model.state_dict())          # the state dict's order, buffers as None
        buffers = [k for k in replicated if k.endswith(("running_mean", "running_var", "num_batches_tracked",
                                                         "shared"))]
        assert len(buffers) == 5 and all(replicated[k] is None for k in buffers)
        assert torch.equal(replicated[f"{prefix}1.weight"], model.state_dict()[f"{prefix}1.weight"])
        if rank == 0 or wrap == "ddp-own-buffers":
            assert list(private[BUFFERS]["model"]) == buffers
            assert torch.equal(private[BUFFERS]["model"][f"{prefix}1.running_mean"],
                               model.state_dict()[f"{prefix}1.running_mean"])
        else:
            assert BUFFERS not in private                            # rank 0 saves them for every rank
        assert private["data"] == {"position": rank}


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")
@pytest.mark.parametrize("wrap", ["plain", "ddp", "ddp-own-buffers"])
def test_module_buffers_are_rank_0s_unless_ddp_keeps_them_per_rank(stack, rank_env, gloo_group, wrap):
    """DDP broadcasts buffers from rank 0 (and a module without DDP is taken to be like it): every rank gets rank
    0's; with broadcast_buffers=False each saved rank gets its own back, and a rank new since the save rank 0's."""
    _, agent = stack
    job = f"buffers-{wrap}"
    saved = [batchnorm_model(0, 100 + rank, wrap) for rank in range(3)]
    ranks = [rank_env(agent, job, rank, 3, model=saved[rank]) for rank in range(3)]
    for ckpt in ranks:
        assert ckpt.save(4, force=True)
    assert all(ckpt.wait(timeout=60) for ckpt in ranks)
    for ckpt in ranks:
        ckpt.close()
    # Laid out with the parameters, the statistics would span the slices of ranks 1 and 2.
    tree, leaves = statetree.flatten(batchnorm_model(0, 0, "plain").state_dict())
    offsets, total = statetree.plan(leaves)
    first, last = offsets[tree["1.running_mean"]["$T"]], offsets[tree["1.running_var"]["$T"]] + 4096 * 4
    assert [r for r in range(3) if split(total, r, 3)[0] < last and first < split(total, r, 3)[1]] == [1, 2]
    assert "scratch" not in tree

    for rank in range(4):  # rank 3 did not exist when the checkpoint was saved
        model = batchnorm_model(7, 200 + rank, wrap)
        ckpt = rank_env(agent, job, rank, 4, model=model)
        assert ckpt.restore() == 5
        expected = saved[rank if wrap == "ddp-own-buffers" and rank < 3 else 0].state_dict()
        restored = model.state_dict()
        assert list(restored) == list(expected)
        for key, value in expected.items():
            assert torch.equal(restored[key], value), f"rank {rank}: {key}"
        inner = model.module if wrap != "plain" else model
        assert inner[0].shared is inner[1].shared and inner.scratch[0] == 200 + rank
        ckpt.close()


class Unsorted:
    """State whose dicts are in no sorted order, at several levels, string-keyed or not."""

    def __init__(self, seed: int):
        self.state = {"zeta": torch.full((3,), float(seed)),
                      "alpha": {"mid": seed, "beta": [{"z": 1, "a": (2, {"y": 0, "b": 1})}], "$tag": 3},
                      "numbers": {10: "x", 2: {"q": 1, "c": 2}, (3, 1): "z"}, "b": None}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def key_orders(tree, path: str = "") -> list:
    """Every dict's path and keys in their order."""
    if isinstance(tree, dict):
        return [(path, list(tree))] + [o for k, v in tree.items() for o in key_orders(v, f"{path}.{k!r}")]
    if isinstance(tree, (list, tuple)):
        return [o for i, v in enumerate(tree) for o in key_orders(v, f"{path}[{i}]")]
    return []


def test_restored_state_dicts_keep_their_key_order(stack, rank_env):
    _, agent = stack
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt = rank_env(agent, "ordered", 0, 1, model=model, optimizer=opt, extra=Unsorted(1), data=Unsorted(2))
    assert ckpt.save(3, force=True) and ckpt.wait(60)
    ckpt.close()
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters())
    extra, data = Unsorted(0), Unsorted(0)
    ckpt = rank_env(agent, "ordered", 0, 1, model=model2, optimizer=opt2, extra=extra, data=data)
    assert ckpt.restore() == 4
    assert list(opt.state_dict()["param_groups"][0])[:3] == ["lr", "betas", "eps"]  # not sorted to begin with
    assert key_orders(opt2.state_dict()) == key_orders(opt.state_dict())
    assert key_orders(model2.state_dict()) == key_orders(model.state_dict())
    assert key_orders(extra.state) == key_orders(Unsorted(1).state) and extra.state["alpha"]["mid"] == 1
    assert key_orders(data.state) == key_orders(Unsorted(2).state) and data.state["alpha"]["mid"] == 2
    ckpt.close()
