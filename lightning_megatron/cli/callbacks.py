"""Callbacks of the pretraining command line: Megatron's end-of-run checkpoint, its log line, ``--profile``,
``--manual-gc`` / ``--empty-unused-memory-level``."""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_megatron.callbacks.optimizer_step import OptimizerStepCallback

__all__ = ["IterationPrinter", "LastCheckpoint", "MemoryHousekeeping", "StepProfiler"]


class LastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also writes ``last.ckpt`` at the end of training when the last step was not
    saved yet (Megatron saves at the end of a run)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step
        else:
            super().on_train_end(trainer, pl_module)


class IterationPrinter(OptimizerStepCallback):
    """Megatron-style log line on global rank 0 every ``every`` optimizer steps::

        iteration     10/400 | consumed samples 80 | train_loss 6.1234 | lr 1.500e-03 | step_time 0.1 | ...

    with the loss, the learning rate and the metrics of ``monitor``'s last logging step (an
    :class:`~lightning_megatron.MFUMonitor`; put it before this callback in ``callbacks``).
    """

    def __init__(self, every: int, global_batch_size: int, monitor: Optional[Any] = None) -> None:
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.every, self.global_batch_size, self.monitor = every, global_batch_size, monitor

    def on_optimizer_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
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


class StepProfiler(Callback):
    """``torch.profiler`` over the optimizer steps ``[start_step, end_step)`` on the global ranks ``ranks``
    (Megatron's ``--profile``): one Chrome trace per rank, ``<output_dir>/trace_rank<r>_steps<a>-<b>.json``.
    On CUDA the range is also marked with ``torch.cuda.profiler.start/stop``, for
    ``nsys profile --capture-range=cudaProfilerApi``. Communicates nothing.
    """

    def __init__(self, start_step: int = 10, end_step: int = 12, ranks: Sequence[int] = (0,),
                 output_dir: str = "profile") -> None:
        if start_step < 0 or end_step <= start_step:
            raise ValueError(f"StepProfiler: need 0 <= start_step < end_step, got start_step={start_step}, "
                             f"end_step={end_step} (--profile-step-start / --profile-step-end)")
        self.start_step, self.end_step, self.ranks, self.output_dir = start_step, end_step, tuple(ranks), output_dir
        self._prof: Optional[torch.profiler.profile] = None
        self._done = False
        self.trace_path: Optional[Path] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._done or self._prof is not None or trainer.global_rank not in self.ranks:
            return
        if trainer.global_step >= self.start_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.profiler.start()
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()
            self._first = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._prof is not None and trainer.global_step >= self.end_step:
            self._stop(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prof is not None:   # the run ended inside the range
            self._stop(trainer)

    def _stop(self, trainer: pl.Trainer) -> None:
        prof, self._prof, self._done = self._prof, None, True
        prof.stop()
        if torch.cuda.is_available():
            torch.cuda.profiler.stop()
        out = Path(self.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.trace_path = out / f"trace_rank{trainer.global_rank}_steps{self._first}-{trainer.global_step}.json"
        prof.export_chrome_trace(str(self.trace_path))
        print(f"profile: steps [{self._first}, {trainer.global_step}) of rank {trainer.global_rank} -> "
              f"{self.trace_path}", flush=True)


class MemoryHousekeeping(Callback):
    """Megatron's ``--manual-gc`` and ``--empty-unused-memory-level`` on this process (communicates nothing).

    * ``manual_gc``: Python's automatic garbage collection is off while training (no collection pauses at
      random steps, which stall the other ranks); a collection runs every ``gc_interval`` optimizer steps
      (0: never in the loop) and after each validation. Automatic collection is back on after training.
    * ``empty_unused_memory_level``: 1 returns the CUDA caching allocator's unused blocks after each optimizer
      step, 2 also after each validation (no effect off CUDA).
    """

    def __init__(self, manual_gc: bool = False, gc_interval: int = 0, empty_unused_memory_level: int = 0) -> None:
        if gc_interval < 0 or empty_unused_memory_level not in (0, 1, 2):
            raise ValueError(f"MemoryHousekeeping: gc_interval={gc_interval} must be >= 0 and "
                             f"empty_unused_memory_level={empty_unused_memory_level} one of 0, 1, 2")
        if gc_interval and not manual_gc:
            raise ValueError(f"MemoryHousekeeping: gc_interval={gc_interval} needs manual_gc=True (--manual-gc)")
        self.manual_gc, self.gc_interval, self.level = manual_gc, gc_interval, empty_unused_memory_level
        self._last_step = 0
        self._was_enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        if self.manual_gc:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:   # accumulating: no optimizer step yet
            return
        self._last_step = step
        if self.level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.manual_gc and self.gc_interval and step % self.gc_interval == 0:
            gc.collect()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.manual_gc:
            gc.collect()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.manual_gc and self._was_enabled:
            gc.enable()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)
