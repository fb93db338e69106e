"""Memory of one rank: exact parameter / gradient / optimizer-state bytes, and the activation peak.

Parameters, gradients and optimizer states are counted tensor by tensor from the model's shapes as the library
shards them (:func:`rank_parameters`): column-parallel ``linear_qkv`` / ``linear_fc1`` split their output rows
over tp, row-parallel ``linear_proj`` / ``linear_fc2`` their input columns, the vocabulary is padded to
``make_vocab_size_divisible_by * tp`` and split over tp, norms are whole, routed experts are split ``E/ep`` per
rank and each expert's ffn over etp, a pipeline rank keeps only its stages' layers (the embedding on the first
stage, the final norm and output layer on the last, a word-embedding copy there too when tied). Precision is
the library's bf16-mixed: fp32 parameters and gradients (or, with bf16 parameters, ``MegatronPrecision(
params_dtype=torch.bfloat16)``, a bf16 compute copy and an fp32 main parameter per element and fp32 main
gradients: :mod:`lightning_megatron.parallel.param_buffer.buffer`), Adam's two fp32 moments (or bf16 ones: the
precision-aware optimizer) and a 4-byte step per parameter tensor. With the distributed optimizer
(``sharding="optim"``) the states are split as torch's ``ZeroRedundancyOptimizer`` splits them (largest tensor
first onto the least-loaded rank, per parameter group: weights with weight decay, then norms and biases); under
FSDP (``optim_grads`` / ``optim_grads_params``) every tensor is split along its first dimension as ``fully_shard``
splits it (:func:`fsdp_numel`), so the count equals what the rank allocates. No torch.cuda.

Activations are counted per token per layer from what the layer's autograd graph keeps (bf16 under autocast,
the residual stream in fp32) and checked against the measured peaks in ``benchmarks/RESULTS.md``
(``tests/test_planner.py``); the formulas are in :func:`layer_activation_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightning_megatron.parallel.config import FSDP_STRATEGIES, SHARDING_STRATEGIES
from lightning_megatron.parallel.layout_rules import V_SHAPE_SCHEDULES, layers_per_stage, pad_vocab_size, stage_placement

__all__ = ["ParamTensor", "rank_parameters", "StateBytes", "state_bytes", "static_bytes_per_param", "bucket_runs", "zero_partition",
           "fsdp_numel",
           "layer_activation_bytes", "logits_bytes_per_token", "stage_layers", "SHARDING_LEVELS", "PARAMS_DTYPE_BYTES",
           "RESIDUAL_BYTES", "REMAINDER_BYTES", "check_params_dtype", "check_param_remainders", "check_dtype_name"]

#: sharding levels (Megatron's ``--data-parallel-sharding-strategy`` names, the library's own list): what is split
#: over dp x cp
SHARDING_LEVELS = SHARDING_STRATEGIES
PARAM_BYTES = 4        # fp32 parameters (bf16-mixed keeps fp32 weights, autocast casts them per forward)
GRAD_BYTES = 4         # fp32 gradients (grad_reduce_in_bf16 only changes the wire format)
ADAM_BYTES = 8         # exp_avg + exp_avg_sq in fp32
#: bytes per element of an Adam moment by its dtype (``ParallelGPTModule(exp_avg_dtype=..., exp_avg_sq_dtype=...)``)
MOMENT_BYTES = {"fp32": 4, "bf16": 2}
#: bytes per element of a parameter by the parameters' dtype (``MegatronPrecision(params_dtype=...)``): fp32
#: parameters; bf16 ones keep a bf16 compute copy and an fp32 main parameter (2 + 4). The gradients are fp32 either
#: way (``GRAD_BYTES``): with bf16 parameters the fp32 main gradients, which exist from a step's first backward until
#: the optimizer step drops them
PARAMS_DTYPE_BYTES = {"fp32": PARAM_BYTES, "bf16": 6}
#: bytes per element of the int16 remainder that holds a bf16 parameter's fp32 main parameter with its bf16 copy
#: (``MegatronPrecision(store_param_remainders=True)``), in place of the 4-byte fp32 main parameter
REMAINDER_BYTES = 2
#: bytes per element of the residual stream by the parameters' dtype (bf16 parameters: the embedding's output and
#: every layer's are bf16; else fp32)
RESIDUAL_BYTES = {"fp32": 4.0, "bf16": 2.0}
STEP_BYTES = 4         # Adam's float32 ``step`` scalar per parameter tensor
BF16_BYTES = 2         # a bf16 parameter's compute copy


def static_bytes_per_param(params_dtype: str = "bf16", distributed_optimizer: bool = True, dp: int = 1,
                           store_param_remainders: bool = False, moment_bytes: int = ADAM_BYTES,
                           grad_reduce_in_bf16: bool = False) -> float:
    """Megatron's static bytes per parameter of one rank (parameters, gradients during a step, optimizer states) at
    data-parallel size ``dp`` (dp x cp): fp32 parameters ``4 + 4 + moment_bytes [/ dp]`` (fp32 gradient buffers also with
    ``grad_reduce_in_bf16``, which then communicates bf16 copies); bf16 parameters
    ``2 + 4 + (4 + moment_bytes) [/ dp]`` (``2 + 4 + 12 / dp`` with the distributed optimizer and fp32 moments),
    the main parameter's 4 bytes 2 with remainders, and with ``grad_reduce_in_bf16`` under the distributed optimizer
    the gradients' 4 bytes 2 (``2 + 2 + 12 / dp``: Megatron's bf16 gradient buffers). What :func:`state_bytes`
    counts, less the buckets' padding and the per-tensor ``step`` scalars."""
    check_dtype_name("params_dtype", params_dtype, PARAMS_DTYPE_BYTES)
    check_param_remainders(params_dtype, store_param_remainders)
    if dp < 1:
        raise ValueError(f"dp={dp!r} must be >= 1")
    shard = dp if distributed_optimizer else 1
    if params_dtype == "fp32":   # the parameters are their own main parameters, p.grad their gradients' dtype
        return PARAM_BYTES + GRAD_BYTES + moment_bytes / shard
    main_bytes = REMAINDER_BYTES if store_param_remainders else PARAM_BYTES
    grad_bytes = BF16_BYTES if grad_reduce_in_bf16 and distributed_optimizer and dp > 1 else GRAD_BYTES
    return BF16_BYTES + grad_bytes + (main_bytes + moment_bytes) / shard


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor a rank holds: its name, element count, whether it is a weight matrix (weight-decay
    group, ``dim >= 2``), whether it is a routed expert's (sharded over edp, not dp x cp) and its first dimension
    ``rows`` (what FSDP splits; 0: the tensor is one-dimensional, ``rows = numel``)."""

    name: str
    numel: int
    matrix: bool
    expert: bool = False
    rows: int = 0

    @property
    def dim0(self) -> int:
        """Size of the first dimension."""
        return self.rows or self.numel


def stage_layers(num_layers: int, layout: Any) -> List[List[int]]:
    """Global layer indices of each pipeline rank's chunks (list per rank, chunks concatenated in order), from
    the library's :func:`~lightning_megatron.parallel.layout_rules.layers_per_stage` and ``stage_placement``."""
    vp = layout.vp or 1
    counts = layers_per_stage(num_layers, layout.pp * vp)
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    v_shape = (layout.schedule in V_SHAPE_SCHEDULES) if layout.pp > 1 else False
    placement = stage_placement(layout.pp, vp, v_shape) if layout.pp > 1 else [[0]]
    return [[layer for g in stages for layer in range(bounds[g], bounds[g + 1])] for stages in placement]


def _holds(layout: Any, pp_rank: int) -> Tuple[bool, bool]:
    """(holds the first stage, holds the last stage) for pipeline rank ``pp_rank``."""
    if layout.pp == 1:
        return True, True
    vp = layout.vp or 1
    v_shape = layout.schedule in V_SHAPE_SCHEDULES
    stages = stage_placement(layout.pp, vp, v_shape)[pp_rank]
    return 0 in stages, layout.pp * vp - 1 in stages


def rank_parameters(model: Any, layout: Any, pp_rank: int = 0) -> List[ParamTensor]:
    """The parameter tensors of one rank of pipeline rank ``pp_rank`` (every tp / dp / cp rank of it holds the
    same sizes; ep ranks the same number of experts). ``model``: a :class:`~lightning_megatron.GPTConfig`;
    ``layout``: anything with ``tp, pp, vp, ep, etp, schedule`` (a :class:`~lightning_megatron.planner.Layout`)."""
    c, tp = model, layout.tp
    etp = getattr(layout, "etp", None) or tp
    h, n, g, d = c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels
    f, bias = c.ffn_hidden_size, c.add_bias_linear
    glu = 2 if c.swiglu else 1
    norm = [("weight", h)] + ([("bias", h)] if c.normalization == "LayerNorm" else [])
    vocab = pad_vocab_size(c.vocab_size, tp, c.make_vocab_size_divisible_by)
    out: List[ParamTensor] = []
    first, last = _holds(layout, pp_rank)
    tied = not c.untie_embeddings_and_output_weights
    if first or (last and tied):
        out.append(ParamTensor("embedding.word_embeddings.weight", vocab // tp * h, True, rows=vocab // tp))
    if first and c.position_embedding_type == "learned_absolute":
        out.append(ParamTensor("embedding.position_embeddings.weight", c.max_position_embeddings * h, True,
                               rows=c.max_position_embeddings))
    qkv_out = g * (n // g + 2) * d
    for i in stage_layers(c.num_layers, layout)[pp_rank]:
        p = f"decoder.layers.{i}."
        for norm_name in ("input_layernorm", "pre_mlp_layernorm"):
            out += [ParamTensor(p + f"{norm_name}.{k}", v, False) for k, v in norm]
        out.append(ParamTensor(p + "self_attention.linear_qkv.weight", qkv_out // tp * h, True, rows=qkv_out // tp))
        out.append(ParamTensor(p + "self_attention.linear_proj.weight", h * (n * d) // tp, True, rows=h))
        if bias:
            out.append(ParamTensor(p + "self_attention.linear_qkv.bias", qkv_out // tp, False))
            out.append(ParamTensor(p + "self_attention.linear_proj.bias", h, False))
        if c.is_moe and c.is_moe_layer(i):
            e, fm = c.num_moe_experts // layout.ep, c.moe_ffn_hidden_size // etp
            out.append(ParamTensor(p + "mlp.router.weight", c.num_moe_experts * h, True, rows=c.num_moe_experts))
            out.append(ParamTensor(p + "mlp.experts.weight1", e * h * glu * fm, True, True, rows=e))
            out.append(ParamTensor(p + "mlp.experts.weight2", e * fm * h, True, True, rows=e))
            shared = c.moe_shared_expert_intermediate_size or 0
            if shared:
                out.append(ParamTensor(p + "mlp.shared_experts.linear_fc1.weight", glu * shared // tp * h, True,
                                      rows=glu * shared // tp))
                out.append(ParamTensor(p + "mlp.shared_experts.linear_fc2.weight", h * shared // tp, True, rows=h))
        else:
            out.append(ParamTensor(p + "mlp.linear_fc1.weight", glu * f // tp * h, True, rows=glu * f // tp))
            out.append(ParamTensor(p + "mlp.linear_fc2.weight", h * f // tp, True, rows=h))
            if bias:
                out.append(ParamTensor(p + "mlp.linear_fc1.bias", glu * f // tp, False))
                out.append(ParamTensor(p + "mlp.linear_fc2.bias", h, False))
    if last:
        out += [ParamTensor(f"decoder.final_layernorm.{k}", v, False) for k, v in norm]
        if not tied:
            out.append(ParamTensor("output_layer.weight", vocab // tp * h, True, rows=vocab // tp))
    return out


def bucket_runs(tensors: Sequence[ParamTensor], ranks: int, rank: Optional[int] = 0,
                bucket_size: int = 40_000_000) -> Tuple[int, int, int, int]:
    """The distributed optimizer's cut of bf16 parameters' buffers (:meth:`~lightning_megatron.parallel.param_buffer.buffer.
    MainParams.shard`) for one rank of ``ranks``: the buckets as :func:`~lightning_megatron.parallel.param_buffer.buffer.
    bucket_layout` lays ``tensors`` out (matrices in order, a new bucket past ``bucket_size`` elements, the vectors in
    one bucket after them), each padded to a multiple of ``ranks`` and cut into equal runs. Returns ``(padded
    elements of all buckets, this rank's run lengths, the elements of tensors in its runs, the tensors' pieces in
    its runs)``; ``rank=None``: the rank with the most elements."""
    if not tensors:
        return 0, 0, 0, 0
    if rank is None:
        return max((bucket_runs(tensors, ranks, r, bucket_size) for r in range(ranks)), key=lambda x: x[2])
    buckets: List[List[int]] = []
    open_: List[int] = []
    for t in tensors:
        if not t.matrix:
            continue
        if open_ and sum(open_) + t.numel > bucket_size:
            buckets.append(open_)
            open_ = []
        open_.append(t.numel)
    vectors = [t.numel for t in tensors if not t.matrix]
    buckets += [b for b in (open_, vectors) if b]
    padded = length = local = pieces = 0
    for sizes in buckets:
        run = -(-sum(sizes) // ranks)
        start, offset = rank * run, 0
        padded, length = padded + run * ranks, length + run
        for numel in sizes:
            lo, hi = max(offset, start), min(offset + numel, start + run)
            if lo < hi:
                local, pieces = local + hi - lo, pieces + 1
            offset += numel
    return padded, length, local, pieces


def zero_partition(tensors: Sequence[ParamTensor], ranks: int) -> List[List[ParamTensor]]:
    """The tensors each of ``ranks`` ranks owns under torch's ``ZeroRedundancyOptimizer``: per parameter group
    (weight matrices, then vectors, the order of ``ParallelGPTModule.configure_optimizers``), largest first onto
    the rank with the fewest elements so far (the first such rank on ties)."""
    owned: List[List[ParamTensor]] = [[] for _ in range(ranks)]
    sizes = [0] * ranks
    for group in ([t for t in tensors if t.matrix], [t for t in tensors if not t.matrix]):
        for t in sorted(group, key=lambda t: t.numel, reverse=True):
            r = sizes.index(min(sizes))
            owned[r].append(t)
            sizes[r] += t.numel
    return owned


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank's ``params``, ``grads`` and ``optimizer`` (Adam moments and steps); ``main_grads``: the
    gradients are bf16 parameters' fp32 main gradients, dropped at the optimizer step."""

    params: int
    grads: int
    optimizer: int
    main_grads: bool = False

    @property
    def total(self) -> int:
        """All three together (the end of a step's backward)."""
        return self.params + self.grads + self.optimizer

    @property
    def between_steps(self) -> int:
        """What the rank holds between optimizer steps: all three, less main gradients (fp32 gradients stay until
        the step path frees them before the next forward)."""
        return self.params + self.optimizer + (0 if self.main_grads else self.grads)


def check_dtype_name(name: str, value: str, table: Dict[str, Any]) -> None:
    """Raise ValueError unless ``value`` (the option ``name``) is a key of ``table`` (:data:`MOMENT_BYTES`,
    :data:`PARAMS_DTYPE_BYTES`)."""
    if value not in table:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(map(repr, table))}")


def check_params_dtype(sharding: str, params_dtype: str) -> None:
    """Raise ValueError when ``params_dtype`` (``"fp32"`` / ``"bf16"``) is unknown. Every sharding level takes bf16
    parameters (under FSDP's levels FSDP2 holds them: fp32 shards, see :func:`state_bytes`); ``sharding`` is kept
    for the callers."""
    check_dtype_name("params_dtype", params_dtype, PARAMS_DTYPE_BYTES)


def check_param_remainders(params_dtype: str, store_param_remainders: bool) -> None:
    """Raise ValueError when ``store_param_remainders`` is asked for without bf16 parameters (the library's rule:
    :class:`~lightning_megatron.MegatronPrecision` refuses it too)."""
    if store_param_remainders and params_dtype != "bf16":
        raise ValueError(f"store_param_remainders=True with params_dtype={params_dtype!r}: the remainders complete "
                         "bf16 parameters to their fp32 main parameters; use params_dtype='bf16' "
                         "(--accumulate-allreduce-grads-in-fp32) or drop store_param_remainders")


def _adam_bytes(tensors: Sequence[ParamTensor], moment_bytes: int = ADAM_BYTES) -> int:
    return sum(moment_bytes * t.numel + STEP_BYTES for t in tensors)


def state_bytes(model: Any, layout: Any, pp_rank: int = 0, dp_rank: Optional[int] = 0,
                edp_rank: Optional[int] = 0, moment_bytes: int = ADAM_BYTES, params_dtype: str = "fp32",
                store_param_remainders: bool = False, grad_reduce_in_bf16: bool = False) -> StateBytes:
    """Parameter, gradient and optimizer-state bytes of one rank (pipeline rank ``pp_rank``; ``dp_rank`` its
    index in the dp x cp group and ``edp_rank`` in expert data parallel, which only matter when sharded; None:
    the rank holding the most). ``moment_bytes``: bytes per parameter of Adam's two moments (8 in fp32; 4 with both
    in bf16, the precision-aware optimizer's). ``params_dtype``: ``"fp32"`` (4 bytes per parameter) or ``"bf16"``
    (``MegatronPrecision(params_dtype=torch.bfloat16)``: 6, the bf16 copy and the fp32 main parameter; the gradients
    are the fp32 main gradients; ValueError, the library's, with an FSDP level). ``store_param_remainders``: with
    ``"bf16"``, the fp32 main parameters held as int16 remainders next to the bf16 copies (4 bytes per parameter
    instead of 6; ValueError with fp32 parameters).

    Sharding levels (``layout.sharding``): ``no_shard`` keeps everything whole; ``optim`` (the distributed
    optimizer) splits the optimizer states over the buffer's even runs, dense buckets over dp x cp and the routed
    experts' over edp (:func:`bucket_runs`); the FSDP levels ``optim_grads`` and
    ``optim_grads_params`` hold every tensor's parameters, gradients and Adam states as FSDP2's shards
    (:func:`fsdp_numel`: dense tensors over dp x cp, routed experts over edp, whole when edp = 1 as the library
    leaves them out of FSDP). Both FSDP levels hold the same bytes between steps; the whole bf16 weights they
    gather during forward and backward are counted by the planner's peak (:mod:`lightning_megatron.planner.model`).
    With bf16 parameters the distributed optimizer shards the fp32 main parameters (or remainders) with the Adam
    states, each bucket cut into equal runs (:class:`~lightning_megatron.parallel.param_buffer.optimizer.
    DistributedOptimizer`, Megatron's): per parameter 2 bytes (bf16 copy) + 4 (fp32 main gradient) + (4 main or 2
    remainder + ``moment_bytes``) / dp (:func:`static_bytes_per_param`), the gradients 2 bytes with
    ``grad_reduce_in_bf16`` (bf16 buffers); fp32 parameters are their own main parameters (4 + 4 +
    ``moment_bytes`` / dp). Optimizers that are not elementwise fall back to per-tensor sharding
    (:func:`zero_partition`), which this does not count.
    """
    tensors = rank_parameters(model, layout, pp_rank)
    dense = [t for t in tensors if not t.expert]
    expert = [t for t in tensors if t.expert]
    n = sum(t.numel for t in tensors)
    level = layout.sharding
    if level not in SHARDING_LEVELS:
        raise ValueError(f"sharding={level!r} is not one of {SHARDING_LEVELS}")
    check_params_dtype(level, params_dtype)
    check_param_remainders(params_dtype, store_param_remainders)
    param_bytes, main = PARAMS_DTYPE_BYTES[params_dtype], params_dtype != "fp32"
    if store_param_remainders:
        param_bytes += REMAINDER_BYTES - PARAM_BYTES
    dp_cp = layout.dp * layout.cp
    edp = layout.edp
    if level == "no_shard":
        return StateBytes(param_bytes * n, GRAD_BYTES * n, _adam_bytes(tensors, moment_bytes), main)
    if level in FSDP_STRATEGIES:
        local = [fsdp_numel(t, dp_cp, dp_rank) for t in dense] + [fsdp_numel(t, edp, edp_rank) for t in expert]
        return StateBytes(PARAM_BYTES * sum(local), GRAD_BYTES * sum(local),
                          sum(moment_bytes * k + STEP_BYTES for k in local))

    # the buffer's buckets cut into even runs: each holds the states (bf16 parameters: and the main parameters)
    runs = [bucket_runs(dense, dp_cp, dp_rank), bucket_runs(expert, edp, edp_rank)]
    padded, length, local, pieces = (sum(r[i] for r in runs) for i in range(4))
    grad_bytes = BF16_BYTES if grad_reduce_in_bf16 and dp_cp > 1 and main else GRAD_BYTES   # bf16 gradient buffers
    if main:
        main_bytes = REMAINDER_BYTES if store_param_remainders else PARAM_BYTES
        params = BF16_BYTES * padded + main_bytes * length
    else:   # fp32 parameters are their own main parameters: the (padded) buffer only
        params = PARAM_BYTES * padded
    return StateBytes(params, grad_bytes * n, moment_bytes * local + STEP_BYTES * pieces, main)


def fsdp_numel(tensor: ParamTensor, ranks: int, rank: Optional[int] = 0) -> int:
    """Elements of ``tensor`` that rank ``rank`` of ``ranks`` holds under FSDP2 (``fully_shard``): the first
    dimension cut into chunks of ``ceil(dim0 / ranks)`` rows as ``torch.chunk`` cuts it, so the last ranks may hold
    fewer rows or none (FSDP pads its storage, the shard it hands out is unpadded). None: the largest shard."""
    rows = tensor.dim0
    chunk = -(-rows // ranks)
    mine = max(0, min(chunk, rows - (rank or 0) * chunk))
    return mine * (tensor.numel // rows)


def layer_activation_bytes(model: Any, layout: Any, moe_layer: bool = False,
                           params_dtype: str = "fp32") -> Dict[str, float]:
    """Bytes one transformer layer keeps for backward, per token of the rank's micro-batch (tokens = micro-batch
    x seq / cp), split by the part a recompute option drops. bf16 tensors (2 bytes) under autocast, the residual
    stream in fp32 (in bf16 with ``params_dtype="bf16"``: the embedding's output and every layer's are bf16):

    - ``norm_inputs``: the two norms' fp32 inputs, ``8h`` (bf16 residual stream: ``4h``; ``/tp`` with sequence
      parallelism);
    - ``norm_outputs``: the bf16 casts of the norm outputs that ``linear_qkv`` and ``linear_fc1`` keep, ``4h``
      (whole on every tp rank: sequence parallelism keeps the gathered input);
    - ``attention``: ``linear_qkv``'s output, the rotated q and k, the attention output and ``linear_proj``'s
      input, ``(8q + 6kv)/tp``, plus one received K/V block ``4kv/tp`` under context parallelism (fused
      attention keeps no score matrix, so ``core_attn`` recompute drops nothing);
    - ``mlp``: ``linear_fc1``'s output, the SwiGLU product and ``linear_fc2``'s input, ``8f/tp`` (GELU: ``6f/tp``);
      a MoE layer keeps the router input ``2h`` and, for each of the ``k`` routed copies, the permuted input, the
      expert's fc1 output / activation / fc2 input and its output: ``k (4h + 8f_moe/etp)``.
    """
    c, tp = model, layout.tp
    h, q, kv = c.hidden_size, c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    sp = layout.sequence_parallel and tp > 1
    etp = getattr(layout, "etp", None) or tp
    residual = RESIDUAL_BYTES[params_dtype]
    parts = {
        "norm_inputs": 2 * residual * h / (tp if sp else 1),
        "norm_outputs": 4.0 * h,
        "attention": (8.0 * q + 6.0 * kv + (4.0 * kv if layout.cp > 1 else 0.0)) / tp,
    }
    if moe_layer:
        k = c.moe_router_topk
        parts["norm_outputs"] = 2.0 * h + 2.0 * h  # qkv input, router input
        parts["mlp"] = k * (4.0 * h + 8.0 * c.moe_ffn_hidden_size / etp)
    else:
        parts["mlp"] = (8.0 if c.swiglu else 6.0) * c.ffn_hidden_size / tp
    return parts


def logits_bytes_per_token(model: Any, tp: int) -> float:
    """Peak bytes of the logits and the cross-entropy per token on the last stage: the fp32 softmax kept for
    backward and two fp32 gradients of the ``V_pad/tp`` logits at the start of backward (``12 V/tp``)."""
    return 12.0 * pad_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by) / tp
