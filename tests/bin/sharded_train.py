"""A tiny, deterministic sharded training program for dashrun's end-to-end tests (FSDP2, tensor parallel, HSDP).

Run under ``dashrun`` (or plain torchrun, where the Checkpointer is off), gloo on CPU. Like tests/bin/train.py,
every rank appends ``start <step>`` and ``<step> <loss>`` to ``OUT/rank<R>.log`` and at the end writes its state
(its local shards, buffers, optimizer state, scheduler, data cursor, RNG states) to ``OUT/final-rank<R>.pt``, so
that tests/runs.py compares runs bit for bit. ``--dump PATH`` also writes, from rank 0, every parameter's and
optimizer state's ``full_tensor()``, and every rank's buffers, as the run ends: after ``restore()`` when no step is
left to run, so a test compares what a resharded restore gave back with what was saved, whatever the world size or
mesh.

The model is a stack of residual MLP blocks (``width -> dim -> width``); ``--dim`` not divisible by the world size
gives uneven shards. ``--mode``:

* ``fsdp``: ``fully_shard`` on every block and on the root, over all ranks;
* ``hsdp``: the same over a 2-D mesh (``replicate``, ``shard``) of (world / 2, 2);
* ``tp``: a 1-D mesh, ``ColwiseParallel`` on each block's ``up``, ``RowwiseParallel`` on its ``down``;
* ``tp2d``: a (world / 2, 2) mesh named (``dp``, ``tp``): tensor parallel on ``tp``, ``fully_shard`` on ``dp``.

The buffer ``seen`` sums the batches this rank's replica saw, so it differs between data-parallel replicas, as
BatchNorm's statistics do without DDP's broadcast.

The parameter names are the same in every mode, so a checkpoint of one can be restored by another.
"""

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dashrun

MODES = ("fsdp", "hsdp", "tp", "tp2d")


class Block(nn.Module):
    def __init__(self, width, dim):
        super().__init__()
        self.up = nn.Linear(width, dim)
        self.drop = nn.Dropout(0.1)  # the per-rank RNG state matters for a bit-identical resume
        self.down = nn.Linear(dim, width)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(x))))


class Net(nn.Module):
    def __init__(self, width, dim, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, dim) for _ in range(depth))
        # A plain (non-DTensor) buffer, as BatchNorm's statistics: sharding leaves it whole on every rank.
        self.register_buffer("seen", torch.zeros(width))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Cursor:
    """Where this data-parallel replica is in its (synthetic) data stream: fixed data per (replica, step)."""

    def __init__(self, replica, width, batch=8):
        self.replica, self.width, self.batch, self.position = replica, width, batch, 0

    def next(self):
        g = torch.Generator().manual_seed(1000 * self.replica + self.position)
        self.position += 1
        x = torch.randn(self.batch, self.width, generator=g)
        return x, torch.sin(x).flip(-1)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def two_d(world):
    if world % 2:
        raise SystemExit(f"a 2-D mesh of (world / 2, 2) needs an even world size, not {world}")
    return (world // 2, 2)


def shard(model, mode, world):
    """Shard ``model`` as ``mode`` says; returns the index of this rank's data-parallel replica (its data)."""
    tp_plan = {}
    for i in range(len(model.blocks)):
        tp_plan[f"blocks.{i}.up"] = ColwiseParallel()
        tp_plan[f"blocks.{i}.down"] = RowwiseParallel()
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return dist.get_rank()
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", two_d(world), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return dist.get_rank()
    if mode == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan)
        return 0  # every rank of a tensor-parallel group sees the same batch
    mesh = init_device_mesh("cpu", two_d(world), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh.get_local_rank("dp")


def local(obj):
    """A state with every DTensor replaced by its local shard (torch.save of a DTensor would pickle its mesh)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local(v) for v in obj)
    return obj


def full(value):
    """The global tensor of a DTensor (a collective: every rank calls it, in the same order)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def dump(model, opt, sched, rank, path):
    """Every parameter's and optimizer state's full tensor, by parameter name, and every rank's buffers
    (``buffer/<name>/rank<R>``), written by rank 0."""
    out = {}
    for name, b in model.named_buffers():
        gathered = [torch.empty_like(b) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, b.detach().clone())
        out.update({f"buffer/{name}/rank{r}": t for r, t in enumerate(gathered)})
    for name, p in model.named_parameters():
        out[f"param/{name}"] = full(p)
        for key, value in sorted(opt.state.get(p, {}).items()):
            out[f"optim/{name}/{key}"] = full(value)
    out["optim/param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out["scheduler"] = sched.state_dict()
    if rank == 0:
        torch.save(out, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, default="fsdp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dim", type=int, default=12, help="hidden size: not a multiple of the world size gives "
                        "uneven shards")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--dump", help="rank 0 writes every parameter's and optimizer state's full_tensor() here as "
                        "the run ends")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    random.seed(0)
    model = Net(args.width, args.dim)
    replica = shard(model, args.mode, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    cursor = Cursor(replica, args.width)
    torch.manual_seed(1 + rank)  # per-rank RNG stream for dropout

    ckpt = dashrun.Checkpointer(model=model, optimizer=opt, scheduler=sched, data=cursor, interval=args.interval)
    start = ckpt.restore()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"restore-rank{rank}.json"), "w") as f:
        json.dump(ckpt.restore_stats, f)  # bytes of sharded state this rank needed, and had read
    with open(os.path.join(args.out, f"rank{rank}.log"), "a") as log:
        log.write(f"start {start}\n")
        log.flush()
        for step in range(start, args.steps):
            x, target = cursor.next()
            loss = nn.functional.mse_loss(model(x), target) + 1e-3 * random.random()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            model.seen.add_(x.mean(0))
            ckpt.save(step)
            log.write(f"{step} {loss.item():.10f}\n")
            log.flush()
            if ckpt.preempted:
                log.write(f"preempted {step}\n")
                break
            if args.delay:
                time.sleep(args.delay)
    ckpt.wait()
    if ckpt.preempted:  # the state is safe in dash-memd; the relaunch goes on from here
        ckpt.close()
        dist.destroy_process_group()
        return
    if args.dump:
        dump(model, opt, sched, rank, args.dump)
    torch.save({"model": local(model.state_dict()), "optimizer": local(opt.state_dict()),
                "scheduler": sched.state_dict(), "cursor": cursor.state_dict(), "rng": torch.get_rng_state(),
                "py_rng": random.getstate(), "stats": vars(ckpt.stats)},
               os.path.join(args.out, f"final-rank{rank}.pt"))
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
