"""A small DDP job for dashrun's elastic tests: it trains on whatever world dashrun gives it.

The loop is an ordinary one (``for batch in loader``, ``ckpt.save(step)``);
dashrun restarts the ranks at another world size when a node leaves or
joins. Every rank appends one line per step to ``OUT/<node>-<local rank>.log``:
``<step> <epoch> <world> <generation> <sample,sample,...>``, and ``start``,
``preempted`` lines, so a test can rebuild the committed history: which step
ran at which world size, and which samples each global batch held.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import dashrun


class Ballast:
    """State that only takes room: random bytes, the same on every rank (seeded), changed a little each step."""

    def __init__(self, mib: float):
        self.tensor = torch.rand(int(mib * (1 << 20)) // 4, generator=torch.Generator().manual_seed(7))

    def state_dict(self):
        return {"tensor": self.tensor}

    def load_state_dict(self, state):
        self.tensor = state["tensor"].clone()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--samples", type=int, default=96, help="samples in the data set (a multiple of the batch)")
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-once-at", type=int, default=None,
                        help="the rank fails (exit 3) on reaching this step, the first time only: a bug of its own")
    parser.add_argument("--ballast-mib", type=float, default=0.0,
                        help="MiB of replicated state besides the model's (alike on every rank): what a link must carry")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.arange(args.samples))
    sampler = dashrun.ElasticSampler(data, shuffle=True, seed=0, global_batch_size=args.global_batch)
    ballast = {"ballast": Ballast(args.ballast_mib)} if args.ballast_mib else {}
    ckpt = dashrun.Checkpointer(model=model, optimizer=opt, sampler=sampler, interval=args.interval, **ballast)
    step = ckpt.restore()
    loader = DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)
    membership = ckpt.membership or {}
    node = membership.get("node", "local")
    generation = membership.get("generation", 0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{node}-{os.environ.get('LOCAL_RANK', '0')}.log")
    with open(path, "a") as log:
        log.write(f"start {step} {world} {generation}\n")
        log.flush()
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for (batch,) in loader:
                x = batch.float().unsqueeze(1) / args.samples
                loss = nn.functional.mse_loss(model(x), x * 2)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if ballast:
                    ballast["ballast"].tensor[0] = step  # each step's bytes its own
                if step == args.fail_once_at and not os.path.exists(os.path.join(args.out, "failed-once")):
                    open(os.path.join(args.out, "failed-once"), "w").close()
                    os._exit(3)
                # Logged before save(): on a world change a staying rank ends inside save(), its step committed.
                log.write(f"{step} {epoch} {world} {generation} {','.join(map(str, batch.tolist()))}\n")
                log.flush()
                ckpt.save(step)
                if ckpt.preempted:
                    log.write(f"preempted {step}\n")
                    log.flush()
                    break
                step += 1
                if step >= args.steps:
                    break
                if args.delay:
                    time.sleep(args.delay)
            if ckpt.preempted or step >= args.steps:
                break
        if not ckpt.preempted:
            ckpt.wait()
            log.write(f"done {step}\n")
            if dist.get_rank() == 0:
                with open(os.path.join(args.out, "membership.json"), "w") as f:
                    json.dump(membership, f)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
