"""One step path for every layout: the micro-batches of an optimizer step, forward and backward.

:func:`forward_backward` runs the ``M`` micro-batches of one optimizer step. With a pipeline it hands them to the
``torch.distributed.pipelining`` schedule (:class:`~lightning_megatron.parallel.pipeline.PipelineRunner`); without
one ("no pipeline" is the degenerate schedule, as in Megatron's ``get_forward_backward_func``) it runs them one
after the other, each forward followed by its backward, with data-parallel gradient synchronisation skipped for
all but the last. Both paths scale the loss the same way and return the same number:

* the gradient is that of the step's loss ``(1/M) * sum_i loss_sum_i / tokens_i`` where ``tokens_i`` is micro-batch
  ``i``'s global token count (over the dp x cp group): each rank backpropagates ``loss_sum_i * dp / tokens_i / M``
  and the data-parallel reduction averages over dp (under a pipeline too: the schedule's own division of ``p.grad``
  by ``M`` is off, since fp32 main gradients and the zero-bubble schedules' weight gradients never pass through it);
* the returned value is that step loss, identical on every rank (reduced over dp x cp, broadcast over pp).

:func:`eval_totals` and :func:`predict` run one batch forward only (through every pipeline stage in order) and
return the result on every rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel.pipeline import PipelineRunner

Batch = Dict[str, Tensor]


@dataclass
class StepFunctions:
    """The model-specific pieces of a step (see :class:`lightning_megatron.contract.ParallelLightningModule`).

    Attributes:
        forward: micro-batch -> the whole model's output (pp == 1; under DDP it goes through the wrapper).
        loss_sum: (output, micro-batch) -> masked loss sum (scalar).
        token_count: micro-batch -> counted tokens (scalar).
        scale_loss: the precision plugin's loss scaling before backward (identity without a loss scaler).
        backward: runs backward of a (scaled) loss (pp == 1; the schedules run their own).
    """

    forward: Callable[[Batch], Tensor]
    loss_sum: Callable[[Tensor, Batch], Tensor]
    token_count: Callable[[Batch], Tensor]
    scale_loss: Callable[[Tensor], Tensor]
    backward: Callable[[Tensor], None]


def global_token_counts(microbatches: List[Batch], token_count: Callable[[Batch], Tensor], device: torch.device,
                        dp_group: Optional[dist.ProcessGroup], dp: int) -> Tensor:
    """``[M]`` counted tokens of each micro-batch summed over the dp x cp group (at least 1): one all-reduce."""
    counts = torch.stack([token_count(mb).float().to(device) for mb in microbatches])
    if dp > 1:
        dist.all_reduce(counts, group=dp_group)
    return counts.clamp(min=1.0)


def forward_backward(microbatches: List[Batch], fns: StepFunctions, *, device: torch.device,
                     dp_group: Optional[dist.ProcessGroup], dp: int, pipeline: Optional[PipelineRunner] = None,
                     no_sync: Callable[[], ContextManager] = contextlib.nullcontext) -> Tensor:
    """Forward and backward of one optimizer step's micro-batches; returns the step loss (fp32 scalar).

    Communicates over ``dp_group`` (token counts, the loss) and, with ``pipeline``, over its pipeline group.
    ``no_sync``: context that skips the data-parallel gradient reduction (DDP's ``no_sync``); entered for every
    micro-batch but the last (pp == 1).
    """
    m = len(microbatches)
    counts = global_token_counts(microbatches, fns.token_count, device, dp_group, dp)
    parts: Dict[int, Tensor] = {}   # by micro-batch index: a schedule may evaluate the loss more than once
    if pipeline is None:
        for i, mb in enumerate(microbatches):
            with no_sync() if i < m - 1 else contextlib.nullcontext():
                loss_sum = fns.loss_sum(fns.forward(mb), mb)
                parts[i] = loss_sum.detach().float() / counts[i]
                fns.backward(fns.scale_loss(loss_sum * dp / counts[i] / m))
    else:
        def loss_fn(output: Tensor, index: int) -> Tensor:
            loss_sum = fns.loss_sum(output, microbatches[index])
            parts[index] = loss_sum.detach().float() / counts[index]
            return fns.scale_loss(loss_sum * dp / counts[index] / m)

        tokens = torch.cat([mb["tokens"] for mb in microbatches]).to(device)
        pipeline.train_step(tokens, [mb.get("position_ids") for mb in microbatches], loss_fn,
                            [mb.get("document_ids") for mb in microbatches])
    value = torch.stack(list(parts.values())).sum() / m if parts else torch.zeros((), device=device)
    holds_loss = pipeline is None or pipeline.holds_last
    if holds_loss and dp > 1:
        dist.all_reduce(value, group=dp_group)
    return value if pipeline is None else pipeline.broadcast_from_last(value)


def _last_stage_output(batch: Batch, forward: Callable[[Batch], Tensor],
                       pipeline: Optional[PipelineRunner]) -> Optional[Tensor]:
    if pipeline is None:
        return forward(batch)
    return pipeline.forward_only(batch["tokens"], batch.get("position_ids"), batch.get("document_ids"))


def eval_totals(batch: Batch, fns: StepFunctions, *, device: torch.device,
                pipeline: Optional[PipelineRunner] = None) -> Tensor:
    """``[loss_sum, token_count]`` (fp32) of one evaluation batch on this data-parallel rank, on every rank of
    the pipeline (computed on the last stage, broadcast over the pipeline group)."""
    output = _last_stage_output(batch, fns.forward, pipeline)
    totals = torch.zeros(2, device=device)
    if output is not None:
        totals = torch.stack([fns.loss_sum(output, batch).float(), fns.token_count(batch).float().to(device)])
    return totals if pipeline is None else pipeline.broadcast_from_last(totals)


def predict(batch: Batch, fns: StepFunctions, per_token_loss: Callable[[Tensor, Batch], Tensor], *,
            pipeline: Optional[PipelineRunner] = None) -> Tensor:
    """Per-token loss ``[b, s]`` when ``batch`` has labels (in the loss's compute dtype: fp32 for half-precision
    logits, float64 for a float64 model), else logits ``[b, s, V/tp]``; on every rank of the pipeline (broadcast
    from the last stage)."""
    output = _last_stage_output(batch, fns.forward, pipeline)
    if output is not None:
        labelled = batch.get("labels") is not None
        output = per_token_loss(output, batch) if labelled else output.transpose(0, 1)
    return output if pipeline is None else pipeline.broadcast_any_from_last(output)
