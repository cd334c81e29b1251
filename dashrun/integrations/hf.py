"""``DashrunCallback``: a transformers ``TrainerCallback`` that checkpoints ``Trainer.train()`` through dashrun.

``Trainer(..., callbacks=[DashrunCallback(every_n_steps=50)])``, the script launched by ``dashrun`` (the
Trainer's ``Accelerator`` reads the ranks' environment that dashrun sets as torchrun does): every rank snapshots
the model, the optimizer and LR scheduler (those the Trainer made, unwrapped from accelerate's), the
``TrainerState`` (global step, epoch, log history, best metric) and its RNG states, every ``every_n_steps``
optimizer steps and at once on an interruption notice or SIGTERM. A relaunch with the same command restores
them in ``on_train_begin``, and puts the loop at the batch after the restored step.

The Trainer computes where its loop starts (epochs and batches to skip) from a ``resume_from_checkpoint``
folder only, before any callback runs; so the callback moves the data instead of the loop: the Trainer's loop
counts its epochs from 0 again, and the train DataLoader (accelerate's ``DataLoaderShard``) is told the real
epoch (its ``set_epoch``, whose order is the seed's and the epoch's) and skips the restored epoch's trained
batches (``skip_batches``) on its first pass. The Trainer stops at ``max_steps`` as it counts the restored
global step. ``state.epoch`` is corrected after each step. Gradient accumulation is supported only with
``gradient_accumulation_steps=1``; pass no ``resume_from_checkpoint`` to a run dashrun resumes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dashrun.errors import UsageError
from dashrun.rank.checkpointer import Checkpointer
from dashrun.rank.restore import restore_rng
from dashrun.rank.snapshot import capture_rng

__all__ = ["DashrunCallback"]

log = logging.getLogger(__name__)

#: The TrainerState fields a checkpoint keeps (plain numbers, strings and the log history).
STATE_FIELDS = ("epoch", "global_step", "max_steps", "num_train_epochs", "total_flos", "log_history", "best_metric",
                "best_global_step", "best_model_checkpoint", "num_input_tokens_seen")


class _TrainerStateDict:
    """The TrainerState as an object with ``state_dict()``/``load_state_dict()``."""

    def __init__(self, state: TrainerState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self.state, name) for name in STATE_FIELDS if hasattr(self.state, name)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(self.state)}
        for name, value in saved.items():
            if name in known:
                setattr(self.state, name, value)


def _unwrapped(obj: Any, attribute: str) -> Any:
    """accelerate's AcceleratedOptimizer/AcceleratedScheduler hold torch's own under ``optimizer``/``scheduler``."""
    return getattr(obj, attribute, obj)


class DashrunCallback(TrainerCallback):
    """Checkpoint ``Trainer.train()`` to dash-memd every ``every_n_steps`` optimizer steps; resume on relaunch."""

    def __init__(self, every_n_steps: int = 100, job_id: str | None = None):
        self.every_n_steps = every_n_steps
        self.job_id = job_id
        self.checkpointer: Checkpointer | None = None
        #: The step ``restore()`` returned (0 on a fresh job).
        self.restored_step = 0
        #: A notice (or SIGTERM) stopped the run after its emergency checkpoint was committed.
        self.preempted = False
        self._epoch_offset = 0
        self._epochs_begun = 0
        self._rng_to_reapply: dict[str, Any] | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *, model=None,
                       optimizer=None, lr_scheduler=None, train_dataloader=None, **kwargs) -> None:
        if args.gradient_accumulation_steps != 1:
            raise UsageError("DashrunCallback: gradient_accumulation_steps must be 1",
                             hint="accumulate in the batch size, or checkpoint with dashrun.Checkpointer in a loop")
        objects: dict[str, Any] = {"model": model, "optimizer": _unwrapped(optimizer, "optimizer"),
                                   "trainer_state": _TrainerStateDict(state)}
        if lr_scheduler is not None:
            objects["scheduler"] = _unwrapped(lr_scheduler, "scheduler")
        self.checkpointer = Checkpointer(interval=self.every_n_steps, job_id=self.job_id, **objects)
        self.restored_step = self.checkpointer.restore()
        if not self.restored_step:
            return
        self._rng_to_reapply = capture_rng()
        per_epoch = len(train_dataloader)
        self._epoch_offset, skip = divmod(self.restored_step, per_epoch)
        self._place(train_dataloader, skip)
        log.warning("dashrun: rank %d: Trainer.train() resumes after step %d (epoch %d, batch %d)",
                    self.checkpointer.rank, self.restored_step - 1, self._epoch_offset, skip)

    def _place(self, loader: Any, skip: int) -> None:
        """The Trainer's loop counts epochs from 0 again: the DataLoader is given the real epoch each time it is
        set (by the Trainer, and again by the loader itself as an iteration starts), and skips the resumed
        epoch's trained batches on its first pass."""
        if not hasattr(loader, "skip_batches") or not hasattr(loader, "set_epoch"):
            raise UsageError(f"DashrunCallback: cannot place a {type(loader).__name__} at a step",
                             hint="let the Trainer make its train DataLoader (accelerate's DataLoaderShard)")
        set_epoch = loader.set_epoch
        loader.set_epoch = lambda epoch: set_epoch(self._epoch_offset + max(0, self._epochs_begun - 1))
        loader.skip_batches = skip
        self._loader = loader

    def on_epoch_begin(self, args, state, control, **kwargs) -> None:
        self._epochs_begun += 1

    def on_epoch_end(self, args, state, control, **kwargs) -> None:
        if getattr(self, "_loader", None) is not None:
            self._loader.skip_batches = 0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self._rng_to_reapply is not None:  # the DataLoader's iteration drew from it since restore()
            restore_rng(self._rng_to_reapply)
            self._rng_to_reapply = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self._epoch_offset:
            state.epoch = (state.epoch or 0.0) + self._epoch_offset
        ckpt = self.checkpointer
        if ckpt is None:
            return
        ckpt.save(state.global_step - 1)
        if ckpt.preempted:
            self.preempted = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.checkpointer.close()
            self.checkpointer = None
