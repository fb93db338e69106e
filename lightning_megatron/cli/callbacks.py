"""Callbacks of the pretraining command line: Megatron's end-of-run checkpoint and its log line."""
from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

__all__ = ["IterationPrinter", "LastCheckpoint"]


class LastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also writes ``last.ckpt`` at the end of training when the last step was not
    saved yet (Megatron saves at the end of a run)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step
        else:
            super().on_train_end(trainer, pl_module)


class IterationPrinter(Callback):
    """Megatron-style log line on global rank 0 every ``every`` optimizer steps::

        iteration     10/400 | consumed samples 80 | train_loss 6.1234 | lr 1.500e-03 | step_time 0.1 | ...

    with the loss, the learning rate and the metrics of ``monitor``'s last logging step (an
    :class:`~lightning_megatron.MFUMonitor`; put it before this callback in ``callbacks``).
    """

    def __init__(self, every: int, global_batch_size: int, monitor: Optional[Any] = None) -> None:
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.every, self.global_batch_size, self.monitor = every, global_batch_size, monitor
        self._last_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step in this batch
            return
        self._last_step = step
        if step % self.every or not trainer.is_global_zero:
            return
        parts = [f"iteration {step:>6}/{trainer.max_steps}", f"consumed samples {step * self.global_batch_size}"]
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            parts.append(f"train_loss {float(loss):.4f}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3e}")
        for key, value in (getattr(self.monitor, "last_metrics", None) or {}).items():
            parts.append(f"{key} {value:.6g}")
        print(" | ".join(parts), flush=True)
