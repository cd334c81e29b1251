#!/usr/bin/env python3
"""The job ``scripts/bench_elastic.py`` runs on every node: an MLP (DDP, or FSDP2 with ``--fsdp``) that checkpoints
one of two ways.

``--mode dashrun``: ``dashrun.Checkpointer`` (under ``dashrun``); ``--mode dcp``:
``torch.distributed.checkpoint.save`` every ``--interval`` steps into
``--ckpt-dir/step-N`` (marked complete by rank 0 once saved) and ``load`` of the
newest complete one at start (under ``torchrun``), as a torchrun user would.
Each rank appends ``<epoch seconds> <step> <world size>`` per step to
``--out/<address>-<local rank>.log``, so the benchmark can see when the first
step at a new world size ran.
"""

import time

STARTED = time.time()  # before torch's import: the benchmark's timeline of a restart

import argparse  # noqa: E402
import os  # noqa: E402

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def newest_complete(ckpt_dir: str) -> int | None:
    steps = [int(name.split("-")[1]) for name in os.listdir(ckpt_dir) if name.startswith("step-")
             and os.path.exists(os.path.join(ckpt_dir, name, ".complete"))] if os.path.isdir(ckpt_dir) else []
    return max(steps, default=None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("dashrun", "dcp"), required=True)
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--ckpt-dir", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP: sharded state")
    args = parser.parse_args()

    phases = {"started": STARTED, "imported": time.time()}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    phases["process-group"] = time.time()
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 1))
    if args.fsdp:  # every world size shards the state its own way: a restore at a new one reshards
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.mode == "dashrun":
        import dashrun

        ckpt = dashrun.Checkpointer(model=model, optimizer=opt, interval=args.interval)
        step = ckpt.restore()
    else:
        ckpt = None
        step = 0
        newest = newest_complete(args.ckpt_dir)
        if newest is not None:
            model_state, opt_state = get_state_dict(model, opt)
            state = {"model": model_state, "optimizer": opt_state}
            dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step-{newest}"))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            step = newest + 1
    phases["restored"] = time.time()
    address = os.environ.get("BENCH_NODE", "node")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{address}-{os.environ.get('LOCAL_RANK', '0')}.log"), "a") as log:
        log.writelines(f"phase {name} {at:.3f}\n" for name, at in phases.items())
        while step < args.steps:
            x = torch.randn(32, args.width)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.write(f"{time.time():.3f} {step} {world}\n")
            log.flush()
            if ckpt is not None:
                ckpt.save(step)
                if ckpt.preempted:
                    break
            elif (step + 1) % args.interval == 0:
                model_state, opt_state = get_state_dict(model, opt)
                where = os.path.join(args.ckpt_dir, f"step-{step}")
                dcp.save({"model": model_state, "optimizer": opt_state}, checkpoint_id=where)
                if dist.get_rank() == 0:
                    open(os.path.join(where, ".complete"), "w").close()
            step += 1
            time.sleep(args.delay)
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
