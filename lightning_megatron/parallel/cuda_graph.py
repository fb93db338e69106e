"""Per-layer CUDA graphs (``enable_cuda_graph``; Megatron's ``--enable-cuda-graph``): each compiled transformer layer
is compiled with Inductor's ``mode="reduce-overhead"``, whose CUDA graph trees record the layer's forward and backward
once and replay them, so a layer costs the host one launch per direction instead of one per kernel.

What keeps the replays correct (the layout rules are in :meth:`ParallelConfig._check_cuda_graph`, the run's in
:func:`check_cuda_graph_run`):

* one graph generation per micro-batch: the step path calls :func:`mark_step` before every forward (training
  micro-batch, evaluation and prediction batch), so a replay may reuse the memory of the previous micro-batch's
  activations, which its backward has consumed;
* nothing the step keeps lives in a graph's memory past the next replay: the head and the loss are compiled
  without graphs (the logged loss is theirs), and the parameters' gradients leave the graphs' memory before the
  next micro-batch. With one micro-batch per step the optimizer consumes them before the next forward; with
  several, only bf16 parameters qualify (their gradient hook copies each gradient into its fp32 main gradient at
  once: ``params_dtype=torch.bfloat16``);
* tensors a layer writes in place or reads that change between steps (the FP8 delayed recipe's amax records and
  scales) are static graph inputs, unguarded (:meth:`lightning_megatron.precision.fp8.Float8Gemm.allocate` with
  ``static=True`` marks them).
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def check_cuda_graph_run(module: Any, device: torch.device, params_dtype: Optional[torch.dtype]) -> None:
    """Refuse an ``enable_cuda_graph`` run whose device, module or gradient accumulation the graphs cannot serve.

    Raises:
        ValueError: ``device`` is not CUDA; ``module`` is not a
            :class:`~lightning_megatron.contract.ParallelLightningModule` (the step path marks each micro-batch);
            the trainer accumulates gradients over several batches with parameters other than bf16.
    """
    from lightning_megatron.contract import ParallelLightningModule

    if device.type != "cuda":
        raise ValueError(f"enable_cuda_graph=True records CUDA graphs: it needs a CUDA device (accelerator='gpu'), "
                         f"this run is on {device}; drop enable_cuda_graph")
    if not isinstance(module, ParallelLightningModule):
        raise ValueError(f"enable_cuda_graph=True: {type(module).__name__} does not implement lightning_megatron."
                         "contract.ParallelLightningModule; the strategy's step path, which starts a graph generation "
                         "per micro-batch, runs only such modules (see ParallelGPTModule)")
    trainer = getattr(module, "_trainer", None)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
    if accumulate > 1 and params_dtype != torch.bfloat16:
        raise ValueError(
            f"enable_cuda_graph=True with accumulate_grad_batches={accumulate}: a layer's backward graph returns the "
            "parameters' gradients in its own memory, which the next micro-batch's replay overwrites while they are "
            "still accumulating; use MegatronPrecision(params_dtype=torch.bfloat16) (each gradient is copied into "
            "its fp32 main gradient at once), accumulate_grad_batches=1, or enable_cuda_graph=False")


def mark_step() -> None:
    """Start a new CUDA graph generation (before each micro-batch's forward): the previous micro-batch's graph
    memory may be reused."""
    torch.compiler.cudagraph_mark_step_begin()
