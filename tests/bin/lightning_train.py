"""A tiny Lightning job on CPU ranks (DDP over gloo) with dashrun's callback, for the integration tests.

Every rank appends ``start <step>`` once and ``<step> <loss>`` after each optimizer step to ``OUT/rank<R>.log``.
The model has dropout (RNG), AdamW, a StepLR schedule; the data comes from torchdata's ``StatefulDataLoader``
under a DistributedSampler (in order), and a ``ModelCheckpoint`` works beside dashrun's callback.
"""

import argparse
import os
import time

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader

from dashrun.integrations.lightning import DashrunCheckpoint


class Tiny(pl.LightningModule):
    def __init__(self, log_path: str, delay: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.log_path, self.delay = log_path, delay

    def on_fit_start(self):  # after the callbacks' on_fit_start: DashrunCheckpoint has restored
        dash = next(cb for cb in self.trainer.callbacks if isinstance(cb, DashrunCheckpoint))
        from torch.distributed.tensor import DTensor

        with open(self.log_path, "a") as log:
            log.write(f"start {dash.restored_step}\n")
            log.write(f"sharded {all(isinstance(p, DTensor) for p in self.parameters())}\n")

    def configure_model(self):  # with --strategy fsdp2 (ModelParallelStrategy): FSDP2 over the data-parallel mesh
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self._loss = loss.item()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with open(self.log_path, "a") as log:
            log.write(f"{self.trainer.global_step - 1} {self._loss:.10f}\n")
        if self.delay:
            time.sleep(self.delay)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, f"rank{rank}.log")

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    # Not shuffled: Lightning 2.6 makes a resumed epoch's iterator before it sets the sampler's epoch, so a
    # shuffled order would be epoch 0's for the rest of that epoch, with dashrun as with its own ckpt_path
    # (docs/lightning.md). Lightning keeps a DistributedSampler it is given.
    world, rank_ = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank_, shuffle=False)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
    model = Tiny(log_path, args.delay)
    dash = DashrunCheckpoint(every_n_steps=args.every)
    keep = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "lightning"), every_n_train_steps=7,
                                        save_last=True)
    strategy = "ddp"
    if args.strategy == "fsdp2":  # Lightning's FSDPStrategy (FSDP1) needs CUDA; ModelParallelStrategy runs on CPU
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy=strategy,
                         max_epochs=args.epochs, callbacks=[dash, keep], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    trainer.fit(model, loader)
    with open(log_path, "a") as log:
        if dash.preempted:
            log.write(f"preempted {trainer.global_step - 1}\n")
        log.write(f"ckpt {keep.last_model_path}\n")


if __name__ == "__main__":
    main()
