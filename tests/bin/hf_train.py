"""A tiny GPT-2 (built from a config: nothing is downloaded) trained by transformers' Trainer on CPU ranks with
dashrun's callback, for the integration tests.

Every rank appends ``start <step>`` once and ``<step> <loss>`` after each optimizer step to ``OUT/rank<R>.log``.
"""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from dashrun.integrations.hf import DashrunCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=64):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossLog(TrainerCallback):
    def __init__(self, path, dash, delay):
        self.path, self.dash, self.delay, self.losses = path, dash, delay, []

    def on_train_begin(self, args, state, control, **kwargs):  # after DashrunCallback's: it has restored
        with open(self.path, "a") as log:
            log.write(f"start {self.dash.restored_step}\n")

    def on_step_end(self, args, state, control, **kwargs):
        with open(self.path, "a") as log:
            log.write(f"{state.global_step - 1} {self.losses[-1]:.10f}\n")
            if self.dash.preempted:
                log.write(f"preempted {state.global_step - 1}\n")
        if self.delay:
            time.sleep(self.delay)


class LoggingTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        self.loss_log.losses.append((loss[0] if return_outputs else loss).item())
        return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    dash = DashrunCallback(every_n_steps=args.every)
    loss_log = LossLog(os.path.join(args.out, f"rank{rank}.log"), dash, args.delay)
    training = TrainingArguments(output_dir=os.path.join(args.out, "hf"), per_device_train_batch_size=4,
                                 num_train_epochs=3, learning_rate=1e-3, lr_scheduler_type="linear", seed=0,
                                 save_strategy="no", report_to=[], logging_strategy="no", use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo")
    trainer = LoggingTrainer(model=model, args=training, train_dataset=Tokens(), callbacks=[dash, loss_log])
    trainer.loss_log = loss_log
    trainer.train()


if __name__ == "__main__":
    main()
