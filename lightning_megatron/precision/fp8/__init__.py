"""FP8 GEMMs for the linear layers: the torch-native backend (``torch._scaled_mm``) and the Transformer Engine one.

:func:`apply_fp8` (the FP8 step of :func:`lightning_megatron.parallelize`, through :func:`convert_to_fp8`) gives every
converted layer an FP8 local GEMM (``layer.fp8_gemm``): the local GEMMs of :class:`ColumnParallelLinear` /
:class:`RowParallelLinear` and plain ``nn.Linear`` layers (swapped for :class:`Float8Linear`, same parameters).
The tensor-parallel communication around the GEMM is unchanged; parameters stay in their dtype (fp32 master
weights) and are quantised on the fly.

Torch-native GEMM (:class:`Float8Gemm`), per layer, three GEMMs::

    forward   y  = x  @ W^T      x: e4m3, W: e4m3
    backward  dx = dy @ W        dy: e5m2 ("hybrid") or e4m3 ("e4m3")
              dW = dy^T @ x

each ``torch._scaled_mm`` with fp32 accumulation and the step's compute dtype as output (bf16 under ``bf16-mixed``),
except ``dW`` under one scale per tensor, which leaves the GEMM in the weight's dtype (fp32 master weights: fp32, with
no rounding to bf16 and no cast kernel after it). Scales are powers of two (multiplying by them is exact) chosen so
that the tensor's amax lands at most at the format's largest value, minus ``margin`` powers of two. Recipes:

* ``"tensorwise"``: one scale per tensor from its current amax (no communication; Megatron's "current scaling").
* ``"rowwise"``: one scale per row of each GEMM operand along its reduction dimension, from the current values.
* ``"delayed"``: one scale per tensor from an amax history (``amax_history_len`` steps, ``"most_recent"`` or
  ``"max"``). Each step records the amaxes it saw; at the end of the optimizer step
  (:meth:`Float8Layers.end_step`, an end-of-step hook that
  :class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer` runs)
  they are reduced (max) over the amax group, tensor x data x context parallel (Megatron's), and rolled into the
  histories, so every rank of that group uses the same scales, the ones a single process would use. The first
  step, with no history yet, scales each tensor from its current amax reduced over the same group.

Routed experts (:class:`~lightning_megatron.moe.experts.GroupedMLPExperts`, torch backend): each local expert's
two GEMMs get a :class:`Float8Gemm` of their own (``experts.fp8_gemms``; the experts then loop instead of one
grouped GEMM), with scales per expert; the delayed recipe reduces their amaxes over expert tensor x expert data
parallel (the ranks that hold the same experts).

Layers kept out of FP8: the embedding and output layer, MoE routers, routed experts under the Transformer Engine
backend, the first / last transformer layers with ``first_last_layers_bf16``, and layers whose local GEMM sizes are
not multiples of 16 (cuBLAS FP8 needs them). Which modules were converted is in :attr:`Float8Layers.converted`.

Who owns what: :class:`~lightning_megatron.MegatronPrecision` builds the :class:`Float8Config` and hands
``parallelize`` one :class:`Float8Step`; :func:`apply_fp8` converts and returns the handle, :class:`Float8Layers`,
which then owns the rest (its records, its ``end_step`` as the finaliser's end-of-step hook, its compile stance, its
checkpoint state). docs/precision.md, "How FP8 flows".
"""
from lightning_megatron.precision.fp8.config import (AMAX_COMPUTE_ALGOS, E4M3, E5M2, FP8_BACKENDS, FP8_FORMATS, FP8_MAX,
                                                     FP8_RECIPES, GEMM_ALIGNMENT, Float8Config)
from lightning_megatron.precision.fp8.gemm import Float8Gemm, compute_dtype, quantize, scale_from_amax
from lightning_megatron.precision.fp8.layers import Float8Layers, Float8Linear, convert_to_fp8, fp8_forward_context
from lightning_megatron.precision.fp8.apply import Float8Step, apply_fp8
from lightning_megatron.precision.fp8.te import (TransformerEngineGemm, import_transformer_engine,
                                                 transformer_engine_available, transformer_engine_recipe)

__all__ = ["Float8Config", "Float8Gemm", "Float8Layers", "Float8Linear", "Float8Step", "TransformerEngineGemm",
           "apply_fp8", "convert_to_fp8",
           "fp8_forward_context", "scale_from_amax", "quantize", "compute_dtype", "import_transformer_engine",
           "transformer_engine_available", "transformer_engine_recipe", "FP8_MAX", "E4M3", "E5M2", "FP8_FORMATS",
           "FP8_RECIPES", "FP8_BACKENDS", "AMAX_COMPUTE_ALGOS", "GEMM_ALIGNMENT"]
