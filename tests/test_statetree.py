"""State dicts to JSON skeleton + tensors and back, with no pickle."""

import json
import math
import random

import numpy as np
import pytest
import torch

from dashrun.errors import UsageError
from dashrun.rank import statetree


def round_trip(tree, copy=True):
    skeleton, leaves = statetree.flatten(tree)
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))  # it must be plain JSON
    offsets, total = statetree.plan(leaves)
    region = torch.zeros(total, dtype=torch.uint8)
    for leaf, offset in zip(leaves, offsets):
        region[offset:offset + statetree.nbytes_of(leaf)].copy_(statetree.byte_view(leaf))
    entries = json.loads(json.dumps(statetree.describe(leaves, offsets)))
    return statetree.unflatten(skeleton, statetree.materialize(entries, region, copy=copy))


def test_optimizer_and_scheduler_state_round_trip():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    tree = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    back = round_trip(tree)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)       # tuple stays a tuple
    assert set(back["optimizer"]["state"]) == {0, 1}                          # int keys stay ints
    for key in (0, 1):
        for name, value in tree["optimizer"]["state"][key].items():
            assert torch.equal(back["optimizer"]["state"][key][name], value)
    assert back["scheduler"] == tree["scheduler"]


def test_rng_states_and_special_values_round_trip():
    np.random.seed(3)
    tree = {
        "python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state(),
        "floats": [math.inf, -math.inf, 1.5], "bytes": b"\x00\xff", "dtype": torch.bfloat16,
        "device": torch.device("cpu"), "np_scalar": np.float32(2.5), "none": None, "$odd": {1: "a", (2, 3): "b"},
    }
    back = round_trip(tree)
    assert back["python"] == tree["python"]
    assert torch.equal(back["torch"], tree["torch"])
    assert back["numpy"][0] == "MT19937" and np.array_equal(back["numpy"][1], tree["numpy"][1])
    assert back["numpy"][1].dtype == np.uint32
    assert back["floats"][:2] == [math.inf, -math.inf]
    assert back["bytes"] == b"\x00\xff" and back["dtype"] is torch.bfloat16
    assert back["np_scalar"] == np.float32(2.5) and type(back["np_scalar"]) is np.float32
    assert back["$odd"] == {1: "a", (2, 3): "b"}


def test_tied_tensors_are_stored_once_and_come_back_tied():
    weight = torch.randn(4, 4)
    tree = {"embed.weight": weight, "head.weight": weight, "other": weight.clone()}
    skeleton, leaves = statetree.flatten(tree)
    assert len(leaves) == 2
    back = round_trip(tree)
    assert back["embed.weight"] is back["head.weight"]
    assert torch.equal(back["head.weight"], weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64, torch.uint8, torch.float64])
def test_every_common_dtype_round_trips(dtype):
    source = (torch.randn(5, 3) * 10).to(dtype)
    back = round_trip({"t": source, "scalar": torch.tensor(7, dtype=torch.int64), "empty": torch.empty(0, 2)})
    assert back["t"].dtype == dtype and torch.equal(back["t"], source)
    assert back["scalar"].shape == () and back["scalar"].item() == 7
    assert back["empty"].shape == (0, 2)


def test_views_into_the_region_are_offered_for_modules():
    source = torch.arange(10.0)
    back = round_trip({"t": source}, copy=False)
    assert torch.equal(back["t"], source)


def test_non_contiguous_tensors_are_stored_by_value():
    source = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(round_trip({"t": source})["t"], source)


def test_offsets_are_aligned():
    _, leaves = statetree.flatten({"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(5)})
    offsets, total = statetree.plan(leaves)
    assert all(o % 64 == 0 for o in offsets) and total % 64 == 0


def test_unknown_values_are_refused_with_their_path():
    class Opaque:
        pass

    with pytest.raises(UsageError, match=r"state\.opt\.thing:"):
        statetree.flatten({"opt": {"thing": Opaque()}})
    with pytest.raises(UsageError, match=r"state\.opt\.state\[3\]\[1\]\.m:"):
        statetree.flatten({"opt": {"state": {3: ("x", {"m": Opaque()})}}})
    with pytest.raises(UsageError, match=r"state\.groups\[0\]\.params\[2\]:"):
        statetree.flatten({"groups": [{"params": [0, 1, Opaque()]}]})
    with pytest.raises(UsageError, match=r"state\.sparse:.*layout"):
        statetree.flatten({"sparse": torch.eye(3).to_sparse()})
