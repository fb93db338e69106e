"""``OptimizerStepCallback``: a callback base whose hook runs once per optimizer step, not per batch."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = ["OptimizerStepCallback"]


class OptimizerStepCallback(Callback):
    """Calls :meth:`on_optimizer_step_end` after each training batch that completed an optimizer step (one where
    ``trainer.global_step`` advanced); the batches that only accumulate gradients
    (``Trainer(accumulate_grad_batches)``) and a skipped step do not call it. Communicates nothing."""

    _last_step: int = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:   # accumulating: no optimizer step in this batch
            return
        self._last_step = step
        self.on_optimizer_step_end(trainer, pl_module, step)

    def on_optimizer_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """After the batch that made optimizer step ``step`` (``trainer.global_step``); override it."""
