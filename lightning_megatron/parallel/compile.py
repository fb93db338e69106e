"""Compilation and CUDA graphs in one place: the ``apply_compile`` step of :func:`lightning_megatron.parallelize`
(``compile``: ``torch.compile`` of every transformer layer, the head and the loss) and what a run with per-layer CUDA
graphs needs (``enable_cuda_graph``; Megatron's ``--enable-cuda-graph``).

With ``enable_cuda_graph`` each compiled layer is also compiled with Inductor's CUDA graph trees (the option
``mode="reduce-overhead"`` sets), which record the layer's forward and backward once and replay them, so a layer
costs the host one launch per direction instead of one per kernel. What keeps the replays correct (the layout rules
are in :meth:`ParallelConfig._check_cuda_graph`, the run's in :func:`check_cuda_graph_run`):

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

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from lightning_megatron.contract import ParallelLightningModule, PipelineModel
from lightning_megatron.parallel.config import ParallelConfig

#: Inductor options of every compiled transformer layer. ``triton.mix_order_reduction_split_size``: how many rows
#: each program of a norm's fused backward adds into one partial row of the weight gradient before one column sum
#: adds the partial rows (Inductor's own choice is 16 for 8,192 rows; 32 was measured faster:
#: benchmarks/RESULTS.md). It changes only the summation order of the norm weights' gradients. Options the installed
#: Inductor does not know are left out (:func:`known_inductor_options`).
LAYER_COMPILE_OPTIONS: Dict[str, Any] = {"triton.mix_order_reduction_split_size": 32}


def known_inductor_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` without the keys the installed Inductor's config lacks (``torch.compile(options=...)`` raises on
    them), e.g. an option of a newer torch than the one installed."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    return {key: value for key, value in options.items() if key.replace("-", "_") in known}


def apply_compile(models: List[nn.Module], config: ParallelConfig) -> int:
    """With ``config.compile``: ``torch.compile`` every transformer layer of the GPT-layout models in place
    (``nn.Module.compile``: parameter names and state dicts unchanged), and their ``head`` (final norm + LM head) and
    ``per_token_loss`` (the cross-entropy, fused with its fp32 upcast), all compiled at their first call, after
    materialisation; the layers with :data:`LAYER_COMPILE_OPTIONS` (those the installed Inductor knows). With
    ``config.enable_cuda_graph`` the layers are also compiled with ``triton.cudagraphs``, the option
    ``mode="reduce-overhead"`` sets (each layer's forward and backward replayed as CUDA graphs; the step path marks each
    micro-batch: :func:`mark_step`); the head and the loss, whose outputs the step keeps beyond the next replay, are
    not. Collectives inside (TP, CP, EP) split a graph where dynamo cannot trace them. No communication. Returns the
    number of layers compiled.

    Raises:
        ValueError: ``config.compile`` and no model of ``models`` has the GPT layout
            (:class:`~lightning_megatron.contract.PipelineModel`).
    """
    if not config.compile:
        return 0
    gpt = [m for m in models if isinstance(m, PipelineModel)]
    layers = [layer for m in gpt for layer in m.decoder.layers.values()]
    if not layers:
        raise ValueError("compile=True compiles the transformer layers of GPT-layout models "
                         "(lightning_megatron.contract.PipelineModel); none was found")
    options = known_inductor_options(LAYER_COMPILE_OPTIONS)
    if config.enable_cuda_graph:   # Inductor's CUDA graph trees; torch.compile takes options or a mode, not both
        options["triton.cudagraphs"] = True
    for layer in layers:
        layer.compile(options=options)
    for model in gpt:
        # instance attributes shadow the methods; the pipeline stages call them through the model too
        model.head = torch.compile(model.head)
        if callable(getattr(type(model), "per_token_loss", None)):
            model.per_token_loss = torch.compile(model.per_token_loss)
    return len(layers)


def check_cuda_graph_run(module: Any, device: torch.device, params_dtype: Optional[torch.dtype]) -> None:
    """Refuse an ``enable_cuda_graph`` run whose device, module or gradient accumulation the graphs cannot serve.

    Raises:
        ValueError: ``device`` is not CUDA; ``module`` is not a
            :class:`~lightning_megatron.contract.ParallelLightningModule` (the step path marks each micro-batch);
            the trainer accumulates gradients over several batches with parameters other than bf16.
    """
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
