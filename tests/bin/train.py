"""A tiny, deterministic DDP training program for dashrun's end-to-end tests.

Run under ``dashrun`` (or torchrun). Every rank appends ``<step> <loss>`` to
``OUT/rank<R>.log`` after each step, and at the end writes its full state
to ``OUT/final-rank<R>.pt`` so a test can compare runs bit for bit. The
model has what makes checkpointing hard: tied weights, a BatchNorm buffer
that changes in forward, dropout (RNG), AdamW state, an LR schedule and a
per-rank data cursor. ``--model bn`` trains a model whose replicated state
is mostly BatchNorm statistics, which differ between ranks after each
forward.
"""

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import dashrun


class TiedNet(nn.Module):
    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


class BatchNormNet(nn.Module):
    """Mostly BatchNorm statistics: a few thousand features, so its buffers span every rank's slice."""

    def __init__(self, vocab=64, width=16, features=4096):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        # A fixed projection, not in the state dict (persistent=False): seeded alike on every rank.
        self.register_buffer("spread", torch.randn(width, features, generator=torch.Generator().manual_seed(5)),
                             persistent=False)
        self.norms = nn.Sequential(nn.BatchNorm1d(features, affine=False), nn.ReLU(),
                                   nn.BatchNorm1d(features, affine=False))

    def forward(self, tokens):
        features = self.norms(self.embed(tokens) @ self.spread)
        return features.view(len(tokens), self.vocab, -1).mean(-1)


class Cursor:
    """Where this rank is in its (synthetic) data stream."""

    def __init__(self, rank, vocab=64, batch=16):
        self.rank, self.vocab, self.batch, self.position = rank, vocab, batch, 0

    def next(self):
        g = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        tokens = torch.randint(0, self.vocab, (self.batch,), generator=g)
        return tokens, (tokens * 7 + 3) % self.vocab

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: each rank on its local GPU, NCCL, "
                        "deterministic kernels (so that runs compare bit for bit)")
    parser.add_argument("--early-interval", type=int, default=None, help="interval after an early warning")
    parser.add_argument("--stall-after", type=int, default=None,
                        help="after this step, stop calling save() and sleep (a long evaluation, a hang)")
    parser.add_argument("--hold-file", default=None,
                        help="before the last step, wait while this file exists (a test keeps the run going)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end the run after this step, unfinished (its checkpoints committed)")
    parser.add_argument("--log-stats", action="store_true",
                        help="after each step, log the Checkpointer's counters too (a 'stats {json}' line)")
    parser.add_argument("--model", choices=("tied", "bn"), default="tied",
                        help="tied: tied weights, BatchNorm, dropout; bn: mostly BatchNorm statistics")
    parser.add_argument("--no-broadcast-buffers", action="store_true",
                        help="DDP's broadcast_buffers=False: every rank keeps its own module buffers")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = args.device == "cuda"
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic GEMMs
        torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    distributed = world > 1 or cuda  # on CUDA always NCCL, even for one rank
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    random.seed(0)
    model = (BatchNormNet() if args.model == "bn" else TiedNet(width=args.width)).to(device)
    if distributed:
        own_buffers = {"broadcast_buffers": False} if args.no_broadcast_buffers else {}  # True is the default
        model = nn.parallel.DistributedDataParallel(model, **own_buffers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    cursor = Cursor(rank)
    torch.manual_seed(1 + rank)  # per-rank RNG stream for dropout

    ckpt = dashrun.Checkpointer(model=model, optimizer=opt, scheduler=sched, data=cursor, interval=args.interval,
                                early_interval=args.early_interval)
    start = ckpt.restore()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.log"), "a") as log:
        log.write(f"start {start}\n")
        log.flush()
        for step in range(start, args.steps):
            if args.hold_file and step == args.steps - 1:
                while os.path.exists(args.hold_file):
                    time.sleep(0.05)
            tokens, target = (t.to(device) for t in cursor.next())
            loss = nn.functional.cross_entropy(model(tokens), target) + 1e-3 * random.random()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ckpt.save(step)
            log.write(f"{step} {loss.item():.10f}\n")
            if args.log_stats:
                log.write(f"stats {json.dumps(vars(ckpt.stats))}\n")
            log.flush()
            if ckpt.preempted:
                log.write(f"preempted {step}\n")
                break
            if args.delay:
                time.sleep(args.delay)
            if args.stall_after is not None and step >= args.stall_after:
                time.sleep(3600)
            if args.stop_after is not None and step >= args.stop_after:
                break
    unfinished = args.stop_after is not None and start <= args.stop_after < args.steps - 1
    if unfinished:
        ckpt.wait()
    if ckpt.preempted or unfinished:  # the state is safe in dash-memd; the relaunch goes on from here
        ckpt.close()
        if distributed:
            dist.destroy_process_group()
        return
    ckpt.wait()
    module = model.module if distributed else model
    torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "cursor": cursor.state_dict(), "rng": torch.get_rng_state(), "py_rng": random.getstate(),
                "stats": vars(ckpt.stats)},
               os.path.join(args.out, f"final-rank{rank}.pt"))
    ckpt.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
