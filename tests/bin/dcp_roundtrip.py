"""DCP's own save/load of an FSDP2 model through dashrun.dcp.Writer/Reader, for tests/test_dcp.py (gloo on CPU).

Run under ``dashrun`` (the Writer then goes through dash-agent) or ``python -m torch.distributed.run``
(``--memd``/``--token-file``: straight to dash-memd). In order: ``--load STEP`` (repeatable) loads that step into
a freshly built model at this world size, resharded by DCP's planner, and compares every parameter's and
optimizer state's ``full_tensor()`` with ``OUT/ref-STEP.pt``; ``--train N`` trains N steps; ``--save STEP`` saves
with ``dcp.save`` (``--async-process``: ``dcp.async_save`` in DCP's checkpointing process) and writes
``OUT/ref-STEP.pt`` (rank 0). Each rank writes ``OUT/TAG-rank<R>.json``: per load,
the keys that differ, the item bytes the Reader fetched and the bytes of this rank's local shards.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dashrun import dcp as ddcp
from dashrun.wire.tls import TlsSettings


def build(dim: int, world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, dim), nn.ReLU(), nn.Linear(dim, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model, opt, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x.flip(-1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def full(state) -> dict:
    """Every tensor of a (nested) state dict, as full tensors keyed by path (a collective: every rank calls it)."""
    out = {}

    def walk(node, path):
        if isinstance(node, DTensor):
            out[path] = node.full_tensor()
        elif isinstance(node, torch.Tensor):
            out[path] = node.clone()
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}")
    walk(state, "")
    return out


def local_bytes(state) -> int:
    if isinstance(state, DTensor):
        return state.to_local().nbytes
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--job")
    parser.add_argument("--memd")
    parser.add_argument("--token-file")
    parser.add_argument("--no-tls", action="store_true")
    parser.add_argument("--dim", type=int, default=15)  # divisible by neither 2 nor 3 nor 4: uneven shards
    parser.add_argument("--load", type=int, action="append", default=[])
    parser.add_argument("--train", type=int, default=0)
    parser.add_argument("--save", type=int)
    parser.add_argument("--async-process", action="store_true", help="save with dcp.async_save in DCP's own "
                        "checkpointing process (which gets the Writer pickled)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tls = TlsSettings(plaintext=args.no_tls)
    model, opt = build(args.dim, world)
    report = {"world": world, "loads": []}

    for step in args.load:
        model, opt = build(args.dim, world)  # fresh: nothing left from a load before
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "extra": {"step": -1}}
        reader = ddcp.Reader(args.job, memd=args.memd, token_file=args.token_file, tls=tls)
        dcp.load(state, checkpoint_id=f"step-{step}", storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model_sd, optim_sd = get_state_dict(model, opt)
        now = full({"model": model_sd, "optim": optim_sd})
        ref = torch.load(args.out / f"ref-{step}.pt", weights_only=True)
        differ = sorted(set(ref) ^ set(now)) + [k for k in ref if k in now and not torch.equal(ref[k], now[k])]
        # What this rank needs: its local shards, and every opaque item (DCP's pickled non-tensor values) whole.
        md = reader.metadata
        opaque = sum(where.length for index, where in md.storage_data.items()
                     if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata))
        report["loads"].append({"step": step, "differ": differ, "extra": state["extra"]["step"],
                                "bytes_read": reader.bytes_read, "needed": local_bytes(state) + opaque,
                                "transport": sorted(via for via, n in reader.bytes_via.items() if n)})
        reader.close()

    if args.train:
        train(model, opt, args.train, start=100 * (args.save or 0))
    if args.save is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "extra": {"step": args.save}}
        writer = ddcp.Writer(args.job, args.memd, args.token_file, tls=tls)
        if args.async_process:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            response = dcp.async_save(state, checkpoint_id=f"step-{args.save}", storage_writer=writer,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            getattr(response, "upload_completion", response).result()
        else:
            dcp.save(state, checkpoint_id=f"step-{args.save}", storage_writer=writer)
        report["transport"] = writer.sent_via  # None where DCP's checkpointing process sent the shard
        ref = full({"model": model_sd, "optim": optim_sd})
        if rank == 0:
            torch.save(ref, args.out / f"ref-{args.save}.pt")
        writer.close()

    (args.out / f"{args.tag}-rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
