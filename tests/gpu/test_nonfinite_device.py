"""The non-finite checks decided on the device, on one GPU (``ParallelGPTModule``'s AdamW is fused on CUDA):

- a NaN gradient at step 1: ``NonFiniteError`` names step 1 and the parameter, the weights after step 1 equal those
  after step 0 (the fused optimizer skipped the update on the device);
- ``check_for_nan_in_loss_and_grad="skip"``: the step is dropped, counted and logged, training goes on;
- a training step of a finite run makes no synchronising CUDA call from the strategy's step path
  (``torch.cuda.set_sync_debug_mode("warn")`` over steps 2-4: every warning is recorded with its source line).
"""
from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.parallel.nonfinite import NonFiniteError
from tests.parity import SEED, ListDataset, PoisonGradientOnce, WeightsAfterStep, make_samples, new_module, tiny_config


class _SyncWatch(pl.Callback):
    """Records the synchronising CUDA calls made between the start and the end of batches ``first..last``."""

    def __init__(self, first: int = 2, last: int = 4) -> None:
        self.first, self.last, self.seen = first, last, []
        self._catch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first <= batch_idx <= self.last:
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(None, None, None)
            self.seen += [f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in self._records
                          if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
            self._catch = None


class _SyncWatchAcross(_SyncWatch):
    """As :class:`_SyncWatch`, from the start of batch ``first`` to the start of batch ``last + 1``: Lightning's own
    work at each batch's end (the progress-bar values) included."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.last + 1:
            super().on_train_batch_end(trainer, pl_module, None, batch, batch_idx)
        if self.first <= batch_idx <= self.last and self._catch is None:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pass


def _fit(check, callbacks, steps=4, adamw=None, progress_bar=False):
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    strategy = MegatronStrategy(check_for_nan_in_loss_and_grad=check)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=progress_bar, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=callbacks)
    data = DataLoader(ListDataset(make_samples(cfg, 4 * steps)), batch_size=4, pin_memory=True)
    return strategy, trainer, data, new_module(cfg, steps, adamw=adamw)


def test_nan_step_is_skipped_on_the_device_and_raised_naming_it():
    weights = WeightsAfterStep()
    strategy, trainer, data, module = _fit(True, [PoisonGradientOnce(0, 1), weights])
    with pytest.raises(NonFiniteError, match=r"at step 1 \(trainer.global_step\): a gradient is nan.*gradient of "
                                             r"model\.decoder\.layers\.1\.mlp\.linear_fc2\.weight \(nan\)"):
        trainer.fit(module, data)
    assert strategy.run.guard.on_device
    assert torch.equal(weights.after_step[0], weights.after_step[1]) and torch.isfinite(weights.after_step[1]).all()


def test_skip_mode_drops_the_step_and_goes_on():
    weights = WeightsAfterStep()
    strategy, trainer, data, module = _fit("skip", [PoisonGradientOnce(0, 1), weights])
    trainer.fit(module, data)
    assert strategy.run.guard.on_device and strategy.skipped_steps == 1
    assert float(trainer.callback_metrics["skipped_steps"]) == 1.0
    w = weights.after_step
    assert [not torch.equal(w[i], w[i + 1]) for i in range(3)] == [False, True, True]
    assert torch.isfinite(w[-1]).all()


def test_finite_steps_make_no_synchronising_call(measured):
    """Steps 2-4 of a finite run: no synchronising call with the fused AdamW; with a plain one the synchronous checks
    make some (the detector works)."""
    watch = _SyncWatch()
    strategy, trainer, data, module = _fit(True, [watch], steps=6)
    trainer.fit(module, data)
    assert strategy.run.guard.on_device
    plain = _SyncWatch()
    strategy_plain, trainer_plain, data, module = _fit(True, [plain], steps=6, adamw="foreach")
    trainer_plain.fit(module, data)
    assert not strategy_plain.run.guard.on_device
    measured(sync_calls_fused=float(len(watch.seen)), sync_calls_plain_adamw=float(len(plain.seen)))
    assert watch.seen == [], "\n".join(watch.seen)
    assert len(plain.seen) >= 3, plain.seen   # at least the loss check's read, each step
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))


def test_progress_bar_shows_the_loss_without_waiting_for_the_gpu(measured):
    """With Lightning's progress bar on, batches 2-4 (each batch's end, where Lightning reads the progress-bar values,
    included) make no synchronising call; the bar's ``loss`` is an earlier step's ``train_loss``."""
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(trainer.callback_metrics["train_loss"].detach().clone())

    watch = _SyncWatchAcross()
    strategy, trainer, data, module = _fit(True, [watch, Losses()], steps=6, progress_bar=True)
    trainer.fit(module, data)
    measured(sync_calls_with_progress_bar=float(len(watch.seen)))
    assert watch.seen == [], "\n".join(watch.seen)
    shown = trainer.progress_bar_metrics["loss"]
    assert isinstance(shown, float) and shown in [float(x) for x in losses], (shown, losses)
