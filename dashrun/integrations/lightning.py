"""``DashrunCheckpoint``: a Lightning ``Callback`` that checkpoints a ``Trainer.fit()`` through dashrun.

``Trainer(callbacks=[DashrunCheckpoint(every_n_steps=50)])``, launched by ``dashrun``: every rank snapshots the
``LightningModule``, its optimizers and LR schedulers, the fit loop's progress (with the state of a resumable
train DataLoader, such as torchdata's ``StatefulDataLoader``), the stateful callbacks' states (``ModelCheckpoint``'s
best paths and scores) and its RNG states, every ``every_n_steps`` optimizer steps and at once on an
interruption notice or SIGTERM. A relaunch with the same command restores all of it before the first batch, so
``trainer.fit()`` goes on from the newest committed step. Lightning's own ``ckpt_path`` and ``ModelCheckpoint``
keep working beside it; pass no ``ckpt_path`` to a run dashrun resumes.

Order of operations:

1. ``on_fit_start`` (optimizers exist, the fit loop has not run): make the :class:`~dashrun.Checkpointer`,
   ``restore()``; the fit loop's state goes through Lightning's own ``load_state_dict``, so its restart
   logic (a checkpoint taken in ``on_train_batch_end``) applies, as for a ``ckpt_path``.
2. ``on_train_start``: SIGTERM back to the Checkpointer: the Trainer installed a handler of its own after
   step 1, which would stop the run at the next batch without a checkpoint.
3. ``on_train_batch_start`` of the first batch after a restore: the restored RNG states again, since creating
   the DataLoader iterator drew from them in between (the uninterrupted run drew at the epoch's start).
4. ``on_train_batch_end``: ``save(global_step - 1)``; after an emergency checkpoint, ``trainer.should_stop``.
5. ``on_train_end``: ``wait()``; ``teardown``: ``close()``.

Step numbers are optimizer steps (``trainer.global_step``), the numbers ``every_n_steps`` counts.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from dashrun.rank.checkpointer import Checkpointer
from dashrun.rank.restore import restore_rng
from dashrun.rank.snapshot import capture_rng

__all__ = ["DashrunCheckpoint"]

log = logging.getLogger(__name__)


class _State:
    """Any ``state_dict()``/``load_state_dict()`` pair as an object the Checkpointer takes."""

    def __init__(self, save, load):
        self.state_dict, self.load_state_dict = save, load


def _callbacks_state(trainer: pl.Trainer, own: pl.Callback) -> _State:
    """The stateful callbacks' states, by Lightning's ``state_key`` (as in a Lightning checkpoint)."""

    def others():
        return [cb for cb in trainer.callbacks if cb is not own]

    def save() -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in others() if cb.state_dict()}

    def load(state: dict[str, Any]) -> None:
        for cb in others():
            if cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])

    return _State(save, load)


class DashrunCheckpoint(pl.Callback):
    """Checkpoint ``Trainer.fit()`` to dash-memd every ``every_n_steps`` optimizer steps; resume on relaunch.

    ``job_id``: the job's id when not launched with ``--job-id`` (as :class:`dashrun.Checkpointer`). Off (a
    warning, nothing saved) when the script was not launched by ``dashrun``.
    """

    def __init__(self, every_n_steps: int = 100, job_id: str | None = None):
        self.every_n_steps = every_n_steps
        self.job_id = job_id
        self.checkpointer: Checkpointer | None = None
        #: The step ``restore()`` returned (0 on a fresh job).
        self.restored_step = 0
        #: A notice (or SIGTERM) stopped the run after its emergency checkpoint was committed.
        self.preempted = False
        self._rng_to_reapply: dict[str, Any] | None = None
        self._saved_step: int | None = None

    @property
    def state_key(self) -> str:
        return "DashrunCheckpoint"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        objects: dict[str, Any] = {"model": pl_module}
        for i, optimizer in enumerate(trainer.optimizers):
            objects[f"optimizer{i or ''}"] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            objects[f"scheduler{i or ''}"] = config.scheduler
        loop = trainer.fit_loop
        objects["loop"] = _State(loop.state_dict, loop.load_state_dict)
        objects["callbacks"] = _callbacks_state(trainer, self)
        # The loop's state holds this rank's DataLoader position: each rank keeps its own.
        self.checkpointer = Checkpointer(interval=self.every_n_steps, per_rank=("loop",), job_id=self.job_id,
                                         **objects)
        self.restored_step = self.checkpointer.restore()
        if self.restored_step:
            self._rng_to_reapply = capture_rng()
            self._saved_step = self.restored_step - 1
            log.warning("dashrun: rank %d: Trainer.fit() resumes after step %d (epoch %d)", trainer.global_rank,
                        self.restored_step - 1, trainer.current_epoch)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None:
            self.checkpointer.take_sigterm()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._rng_to_reapply is not None:
            restore_rng(self._rng_to_reapply)
            self._rng_to_reapply = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ckpt = self.checkpointer
        step = trainer.global_step - 1
        if ckpt is None or step < 0 or step == self._saved_step:  # accumulating gradients: no optimizer step yet
            return
        self._saved_step = step
        ckpt.save(step)
        if ckpt.preempted:
            self.preempted = trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
