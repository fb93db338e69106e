"""The gradient hooks of :class:`~lightning_megatron.strategy.MegatronStrategy` (a mixin it inherits): after an
optimizer step's backward, finish the gradients (the run's :meth:`~lightning_megatron.run.ParallelRun.finalize`:
the reductions DDP does not do; the non-finite check), clip them by their global norm over every model-parallel
group, count the steps ``check_for_nan_in_loss_and_grad="skip"`` dropped, and replay a non-finite step once under
``"rerun"``."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Union

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_megatron.checkpoint.distributed import rng_state, set_rng_state
from lightning_megatron.parallel.nonfinite import NonFiniteStepSkipped

log = logging.getLogger("lightning_megatron.strategy")
__all__ = ["GradientHooks"]


class GradientHooks:
    """Lightning's ``optimizer_step`` and gradient clipping for :class:`~lightning_megatron.strategy.MegatronStrategy`
    (which provides ``run``, ``_steps``, ``precision_plugin``, ``lightning_module``, ``wait_for_parameters`` and
    the Lightning strategy base these methods' ``super()`` calls reach, and ``skipped_steps``)."""

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (forward + backward), finish the gradients, then let the precision plugin clip and
        step. Lightning calls this once per optimizer step, after the last micro-batch. With a fused optimizer the
        non-finite checks are decided on the device (:meth:`NonFiniteGuard.start_step`): the previous step's verdict
        is settled once this step's forward and backward are queued, before its gradients are finished (by then the
        GPU is past the previous step's checks, so the host does not wait for it)."""
        guard = self.run.guard if self.run is not None else None

        def closure_then_finalize() -> Any:
            result = closure()
            if self._steps is not None:   # pp: gradients kept out of the reach of Lightning's zero_grad
                self._steps.restore_grads()
            if guard is not None:
                self.settle_non_finite()
            self.finalize_gradients()
            return result

        rerun = self.parallel_config.check_for_nan_in_loss_and_grad == "rerun"
        if guard is not None:
            if self._skips_unlogged:
                self._log_skipped()
            # rerun: the checks stay on the host, so that a non-finite step is known before the next one starts
            guard.start_step(None if self._loss_scaled() or rerun else optimizer)
        rng = rng_state(self.root_device, self.tp_rng) if rerun else None
        try:
            result = self._step_once(optimizer, closure_then_finalize, model, **kwargs)
        except NonFiniteStepSkipped as skipped:   # "skip" / "rerun": every rank is here
            if not rerun:
                self._count_skipped(skipped)
                return None
            result = self._replay(optimizer, closure_then_finalize, model, skipped, rng, **kwargs)
        if guard is not None:
            self.run.end_step()
        return result

    def _step_once(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._finalized = False
            if self._steps is not None:
                self._steps.end_step()

    def _replay(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any, fault: NonFiniteStepSkipped,
                rng: Any, **kwargs: Any) -> Any:
        """``check_for_nan_in_loss_and_grad="rerun"``: run the step's forward and backward (Lightning's closure: the
        same batch; the RNG states as the first time) and the optimizer step again. A non-finite value again raises
        :class:`~lightning_megatron.parallel.nonfinite.NonFiniteError` (naming step, ranks and parameter); a finite
        replay steps, and the fault is counted (``rerun_steps``) and logged on rank 0."""
        guard = self.run.guard
        if self.is_global_zero:
            log.warning("%s; replaying the step from the same inputs", str(fault).split(". The step was skipped")[0])
        set_rng_state(rng, self.root_device, self.tp_rng)
        guard.skip = False
        try:
            result = self._step_once(optimizer, closure, model, **kwargs)
        finally:
            guard.skip = True
        self.rerun_steps += 1
        if self.is_global_zero:
            log.warning("the replayed step %s was finite: the fault did not repeat, training goes on (%d replayed so "
                        "far)", guard.step, self.rerun_steps)
        return result

    def settle_non_finite(self, log_skip: bool = True) -> None:
        """Read the verdict of the last step whose non-finite checks were decided on the device: raises
        :class:`~lightning_megatron.parallel.nonfinite.NonFiniteError` for a non-finite step (its update was skipped
        on the device), or counts it in ``skip`` mode (logged as ``skipped_steps`` when ``log_skip``). Called at the
        next optimizer step, at the end of training and before a checkpoint is written; collective on every rank."""
        guard = self.run.guard if self.run is not None else None
        if guard is None:
            return
        try:
            guard.settle()
        except NonFiniteStepSkipped as skipped:
            self._count_skipped(skipped, log_skip)

    def _count_skipped(self, skipped: NonFiniteStepSkipped, log_skip: bool = True) -> None:
        self.skipped_steps += 1
        if self.is_global_zero:
            log.warning("%s (%d skipped so far)", skipped, self.skipped_steps)
        if log_skip:
            self._log_skipped()
        else:   # counted outside a step (a checkpoint, the end): logged at the next step
            self._skips_unlogged = True

    def _log_skipped(self) -> None:
        self._skips_unlogged = False
        self.lightning_module.log("skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False,
                                  prog_bar=False, logger=True, rank_zero_only=True)

    def on_train_end(self) -> None:
        """The last step's device-decided non-finite verdict, read before ``fit`` returns."""
        self.settle_non_finite(log_skip=False)
        super().on_train_end()

    #: the step's gradients are finished (by clipping before the optimizer step, under manual optimization)
    _finalized = False

    def finalize_gradients(self) -> None:
        """Gradient reductions DDP does not do, once per optimizer step (:meth:`ParallelRun.finalize`, after waiting
        for parameter gathers in flight): before the optimizer step, or before clipping when the user clips first
        (manual optimization calls ``self.clip_gradients`` before ``optimizer.step()``); the second call of a step
        does nothing."""
        run = self.run
        assert run is not None and run.guard is not None
        if self._finalized:
            return
        self._finalized = True
        run.finalize(self._steps.step_microbatches if self._steps is not None else None)
        run.guard.step = self.lightning_module.trainer.global_step
        if not self._clips_by_norm():   # clipping checks the global norm it computes anyway
            run.guard.check_grads()

    def keeps_grads_as_computed(self, num_microbatches: int) -> bool:
        """Whether a step of ``num_microbatches`` leaves the gradients as the backward computed them: one micro-batch,
        no clipping, no loss scaling and no reduction in this layout (:meth:`ParallelRun.reduces_grads`). bf16
        parameters then keep their bf16 gradients instead of fp32 main gradients (:meth:`MainParams.start_step`),
        with the same update."""
        trainer = self.lightning_module.trainer
        return (num_microbatches == 1 and not trainer.gradient_clip_val and not self._loss_scaled()
                and self.run is not None and self.run.finalizer is not None and not self.run.reduces_grads())

    def _clips_by_norm(self) -> bool:
        trainer = self.lightning_module.trainer
        return bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")

    def _loss_scaled(self) -> bool:
        """fp16 with a loss scaler: inf/NaN gradients are the scaler's business (it skips the step)."""
        return getattr(self.precision_plugin, "scaler", None) is not None

    def _install_global_norm_clipping(self) -> None:
        """Route Lightning's ``gradient_clip_val`` (norm) through the global-norm clip (the one override)."""
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign]
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # bf16-mixed has no loss scaler, so a fused optimizer (ours on CUDA) has nothing to unscale and
            # clipping before its step is correct; Lightning's check refuses it anyway. fp16 keeps the check.
            plugin.clip_gradients = functools.partial(Precision.clip_gradients, plugin)  # type: ignore[method-assign]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to global L2 norm ``clip_val``; returns the norm before clipping. The
        step's gradients are finished first (reduced over every group), if they are not yet."""
        assert self.run is not None
        self.finalize_gradients()
        return self.run.clip([p for group in optimizer.param_groups for p in group["params"]], float(clip_val))
