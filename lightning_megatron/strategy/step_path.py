"""The strategy's side of the one step path: Lightning's per-batch hooks translated into
:func:`~lightning_megatron.parallel.forward_backward.forward_backward` (training), :func:`eval_totals` and
:func:`predict` calls on a :class:`~lightning_megatron.contract.ParallelLightningModule`."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_megatron.parallel import forward_backward as step
from lightning_megatron.parallel.cuda_graph import mark_step
from lightning_megatron.parallel.pipeline import PipelineRunner

class StepHost(Protocol):
    """What the step path reads of its strategy (:class:`~lightning_megatron.strategy.MegatronStrategy`), declared
    here so that this module does not import the strategy that owns it."""

    lightning_module: Any
    precision_plugin: Any
    parallel_config: Any
    parallelized: Any
    model: Any
    mesh: Any
    fsdp: Any
    optimizers: List[Any]
    root_device: torch.device
    _grads: Any

    def _forward_redirection(self, wrapper: Any, original: Any, method_name: str, *args: Any) -> Any: ...


class StepPath:
    """Runs a :class:`~lightning_megatron.contract.ParallelLightningModule` under a :class:`MegatronStrategy`.

    Training: every Lightning batch is one micro-batch; the ``accumulate_grad_batches`` micro-batches of an optimizer
    step are collected and run by :func:`forward_backward` at the last one (Lightning's own backward is off, see
    ``MegatronStrategy.on_train_start``), which logs the step's loss once through ``log_train_step``.
    ``pipeline``: this rank's :class:`PipelineRunner` (pp > 1) or None (the plain loop).
    """

    def __init__(self, strategy: StepHost, pipeline: Optional[PipelineRunner]) -> None:
        self.strategy, self.pipeline = strategy, pipeline
        self.microbatches: List[Any] = []
        #: micro-batches of the last optimizer step (the FP8 delayed recipe counts its last uses)
        self.step_microbatches: Optional[int] = None

    def functions(self, context: Callable[[], Any]) -> step.StepFunctions:
        """The module's step pieces; without a pipeline its forward and loss run inside ``context`` (the precision
        plugin's autocast; pipeline stages enter it themselves) and backward outside it."""
        strategy, lm, pipeline = self.strategy, self.strategy.lightning_module, self.pipeline
        precision = strategy.precision_plugin

        cuda_graphs = strategy.parallel_config.enable_cuda_graph

        def forward(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
            if cuda_graphs:   # one graph generation per micro-batch (lightning_megatron.parallel.cuda_graph)
                mark_step()
            with context():
                if isinstance(strategy.model, DistributedDataParallel) and lm.trainer.training:
                    # through DDP's forward, so its reducer expects this backward
                    return strategy._forward_redirection(strategy.model, lm, "forward_step", batch)
                return lm.forward_step(batch)

        def loss_sum(output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
            with contextlib.nullcontext() if pipeline is not None else context():
                return lm.loss_sum(output, batch)

        def backward(loss: torch.Tensor) -> None:
            precision.backward(loss, lm, None)
            precision.post_backward(loss, lm)

        return step.StepFunctions(forward, loss_sum, lm.token_count, lambda loss: precision.pre_backward(loss, lm),
                                  backward)

    def train(self, batch: Any) -> torch.Tensor:
        """Add ``batch`` to the step; at the step's last micro-batch run them all. Returns the step's loss (the same
        on every rank), zero before the last micro-batch."""
        strategy = self.strategy
        lm, mesh = strategy.lightning_module, strategy.mesh
        self.microbatches.append(batch)
        if lm.trainer.fit_loop.epoch_loop._should_accumulate():
            return torch.zeros((), device=strategy.root_device)
        microbatches, self.microbatches = self.microbatches, []
        m, dp = len(microbatches), mesh.size("dp_cp")
        self.step_microbatches = m
        main_params = strategy.parallelized.main_params
        if main_params is not None:   # bf16 parameters (a skipped optimizer step left the fp32 main view on)
            main_params.to_compute()
            main_params.start_step(direct=strategy.keeps_grads_as_computed(m))
        for optimizer in strategy.optimizers:   # Lightning's zero_grad is off with its backward
            optimizer.zero_grad(set_to_none=True)
        scaler = getattr(strategy.precision_plugin, "scaler", None)   # fp16: the aux losses get the loss scale too
        loss_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        lm.set_moe_aux_loss_scale((float(dp) if self.pipeline is not None else dp / m) * loss_scale)
        ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
        no_sync = ddp.no_sync if ddp else strategy.fsdp.no_sync if strategy.fsdp else contextlib.nullcontext
        strategy._grads.start_step(m)
        loss = step.forward_backward(microbatches, self.functions(strategy.precision_plugin.train_step_context),
                                     device=strategy.root_device, dp_group=mesh.group("dp_cp"), dp=dp,
                                     pipeline=self.pipeline, no_sync=no_sync)
        guard = strategy._grads.guard
        guard.step = lm.trainer.global_step
        guard.check_loss(loss)   # NaN/inf: every rank raises here, before the optimizer step
        lm.log_train_step(loss, m)
        return loss

    def evaluate(self, batch: Any, context: Callable[[], Any]) -> None:
        """Add one evaluation batch's ``[loss_sum, token_count]`` to the module's totals."""
        totals = step.eval_totals(batch, self.functions(context), device=self.strategy.root_device,
                                  pipeline=self.pipeline)
        self.strategy.lightning_module.accumulate_eval_totals(totals)

    def predict(self, batch: Any) -> torch.Tensor:
        """Per-token loss ``[b, s]`` (with labels) or logits ``[b, s, V_pad/tp]``, on every rank."""
        lm = self.strategy.lightning_module
        fns = self.functions(self.strategy.precision_plugin.predict_step_context)
        return step.predict(batch, fns, lm.per_token_loss, pipeline=self.pipeline)
