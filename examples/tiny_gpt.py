"""A small GPT-style language model that checkpoints with dashrun; runs on CPU.

    dashrun --memd HOST:PORT --token-file TOKEN --nproc-per-node 2 examples/tiny_gpt.py --steps 200

Tied input/output embeddings, AdamW, a warm-up + cosine learning-rate
schedule, and a data cursor whose position is checkpointed, so a resumed run
continues on exactly the batches an uninterrupted run would have seen. The
corpus is synthetic (a fixed random "grammar" of token transitions), so
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dashrun


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied embeddings
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tokens(idx) + self.positions(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


class TokenStream:
    """Batches from a synthetic corpus; its position is the checkpointed data cursor."""

    def __init__(self, vocab: int, context: int, batch: int, rank: int, world: int):
        self.vocab, self.context, self.batch, self.rank, self.world = vocab, context, batch, rank, world
        g = torch.Generator().manual_seed(1234)
        self.transitions = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=-1)
        self.position = 0  # batches consumed by this rank

    def next_batch(self):
        g = torch.Generator().manual_seed(self.position * self.world + self.rank)
        self.position += 1
        seq = torch.empty(self.batch, self.context + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (self.batch,), generator=g)
        for i in range(1, self.context + 1):
            seq[:, i] = torch.multinomial(self.transitions[seq[:, i - 1]], 1, generator=g).squeeze(1)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--delay", type=float, default=0.0, help="extra seconds per step (for demos)")
    parser.add_argument("--loss-log", default=None, help="rank 0 appends '<step> <loss>' lines here")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    vocab, context = 96, 32
    model = TinyGPT(vocab, context, args.width, args.depth, heads=4)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    data = TokenStream(vocab, context, batch=16, rank=rank, world=world)
    torch.manual_seed(100 + rank)  # each rank's dropout stream

    ckpt = dashrun.Checkpointer(model=model, optimizer=opt, scheduler=sched, data=data, interval=args.interval)
    start = ckpt.restore()
    if rank == 0 and start:
        print(f"resumed at step {start}", flush=True)
    for step in range(start, args.steps):
        inputs, targets = data.next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ckpt.save(step)
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(f"{step} {loss.item():.8f}\n")
        if args.delay:
            time.sleep(args.delay)
        if ckpt.preempted:
            break
    ckpt.wait()
    ckpt.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
