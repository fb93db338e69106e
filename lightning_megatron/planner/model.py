"""Predicted peak memory and step time of one layout: the planner's performance model.

Memory (per GPU, the largest over pipeline ranks): parameters, gradients and optimizer states counted exactly
(:func:`~lightning_megatron.planner.memory.state_bytes`), plus the activations of the micro-batches in flight
on that pipeline rank (1F1B: ``pp - rank``; torch's interleaved 1F1B: ``(vp-1) pp + 2 (pp-1-rank) + 1`` chunks),
the bf16 weight copies autocast keeps for each of them, and the logits / cross-entropy on the last stage. The
gradients are absent at the forward peak only where the step path frees them (one micro-batch per step, no
DDP bucket, no pipeline). With bf16 parameters (``params_dtype="bf16"``, Megatron's bf16: a bf16 compute copy and
an fp32 main parameter per element) autocast keeps no copies (the weights are bf16 already) and the fp32 main
gradients, dropped at every optimizer step, are held at the forward peak only while a step has several
micro-batches (also the pipeline's); there is no DDP, the finaliser reduces them after the backward. The residual
stream is then bf16 too (the embedding's weights are), so the norms keep half the bytes of their inputs (FSDP's
levels refuse bf16 parameters, as the library does). Under FSDP (``optim_grads``, ``optim_grads_params``) the
states are FSDP's shards, the gathered bf16 weights replace autocast's copies (all the rank's layers with
``optim_grads``, two layers with ``optim_grads_params``, the root unit's throughout) and gradients accumulate
unsharded in fp32 while a step has several micro-batches. The peak is the larger of the forward peak and the end of
backward.

Time (per optimizer step): per micro-batch and pipeline rank, GEMMs at a measured efficiency of the dense peak
(FLOPs from :func:`lightning_megatron.callbacks.flops.num_floating_point_operations`, the library's formula),
attention at a measured sequence-dependent efficiency, memory-bound work as passes over the kept activation
bytes at HBM bandwidth, recompute's extra forward, tensor-parallel collectives, the context-parallel ring
(hidden behind attention where it fits) and its merge work, expert all-to-alls; then the pipeline
``(m + (pp-1)/vp)`` micro-batch times of the slowest rank plus its point-to-point transfers, the data-parallel
gradient all-reduce (a reduce-scatter under the distributed optimizer; partly hidden behind the backward without a
pipeline), the distributed optimizer's parameter all-gather
or FSDP's per-layer all-gathers and reduce-scatter (hidden behind compute as FSDP2 prefetches, :func:`_fsdp_time`),
the optimizer step and a fixed step overhead. Constants: :mod:`lightning_megatron.planner.calibration`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Dict, Optional

from lightning_megatron.callbacks.flops import num_floating_point_operations
from lightning_megatron.planner.calibration import Hardware
from lightning_megatron.parallel.config import FSDP_STRATEGIES
from lightning_megatron.planner.memory import (
    ADAM_BYTES, GRAD_BYTES, MOMENT_BYTES, PARAM_BYTES, PARAMS_DTYPE_BYTES, RESIDUAL_BYTES, check_dtype_name,
    check_param_remainders, layer_activation_bytes, logits_bytes_per_token, rank_parameters, stage_layers, state_bytes,
)

__all__ = ["Workload", "Prediction", "predict", "flops_parts"]

GIB = 2.0 ** 30


@dataclass(frozen=True)
class Workload:
    """What is trained: ``model`` (a ``GPTConfig``), ``seq_length``, ``global_batch_size`` (sequences per
    optimizer step), ``precision`` (``"bf16"``: bf16-mixed; ``"fp8"``: FP8 GEMMs, same memory model),
    ``grads_kept_between_steps`` (True for code before the step path freed gradients before the forward; None:
    the current code), the Adam moments' dtypes ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (``"fp32"`` or
    ``"bf16"``: ``ParallelGPTModule``'s arguments of the same names) and ``params_dtype`` (``"fp32"`` or ``"bf16"``:
    ``MegatronPrecision(params_dtype=torch.bfloat16)``, bf16 parameters with fp32 main parameters and gradients;
    Megatron's ``--bf16``); ``store_param_remainders`` (with ``"bf16"``: the fp32 main parameters held as int16
    remainders, ``MegatronPrecision(store_param_remainders=...)``; None: on with ``"bf16"``, the library's and
    Megatron's default)."""

    model: Any
    seq_length: int
    global_batch_size: int
    precision: str = "bf16"
    grads_kept_between_steps: Optional[bool] = None
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    params_dtype: str = "fp32"
    store_param_remainders: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.store_param_remainders is None:
            object.__setattr__(self, "store_param_remainders", self.params_dtype == "bf16")
        for name, table in (("exp_avg_dtype", MOMENT_BYTES), ("exp_avg_sq_dtype", MOMENT_BYTES),
                            ("params_dtype", PARAMS_DTYPE_BYTES)):
            check_dtype_name(name, getattr(self, name), table)
        check_param_remainders(self.params_dtype, self.store_param_remainders)

    @property
    def moment_bytes(self) -> int:
        """Bytes per parameter of Adam's two moments."""
        return MOMENT_BYTES[self.exp_avg_dtype] + MOMENT_BYTES[self.exp_avg_sq_dtype]


@dataclass
class Prediction:
    """Predicted numbers of one layout: ``peak_gib`` per GPU (allocator peak), its ``memory`` parts (GiB, the
    peak rank's), ``step_s``, ``tokens_per_s_per_gpu``, ``mfu`` (library FLOPs, causal, over the dense bf16
    peak), the ``time`` parts (seconds per step) and ``reason`` when the layout is rejected."""

    peak_gib: float
    memory: Dict[str, float]
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    time: Dict[str, float] = field(default_factory=dict)
    reason: Optional[str] = None


def _ns(model: Any, **changes: Any) -> SimpleNamespace:
    fields = dict(model.to_dict()) if hasattr(model, "to_dict") else dict(vars(model))
    fields.update(changes)
    return SimpleNamespace(**fields)


def flops_parts(model: Any, seq: int) -> Dict[str, float]:
    """Training FLOPs per token from the library's formula, split: ``gemm`` (of which ``mlp``) / ``attention`` per
    dense layer, ``moe_gemm`` per MoE layer (attention projections + routed experts), ``head`` (the logits)."""
    def per_token(**changes: Any) -> float:
        return num_floating_point_operations(_ns(model, **changes), 1, seq, causal=True) / seq

    head = per_token(num_layers=0, num_moe_experts=None)
    full = per_token(num_layers=1, num_moe_experts=None)
    nc = num_floating_point_operations(_ns(model, num_layers=1, num_moe_experts=None), 1, seq, causal=False) / seq
    attention = nc - full
    f = _ns(model).ffn_hidden_size or 4 * model.hidden_size
    mlp = (full - per_token(num_layers=1, num_moe_experts=None, ffn_hidden_size=1)) * f / (f - 1)
    parts = {"head": head, "attention": attention, "gemm": full - head - attention, "mlp": mlp}
    if getattr(model, "num_moe_experts", None):
        parts["moe_gemm"] = per_token(num_layers=1, moe_layer_freq=1) - head - attention
    return parts


def _nccl_bw(hw: Hardware, size: float, span_nodes: bool) -> float:
    """Bus bandwidth (bytes/s) of a collective of ``size`` bytes: measured NVLink NCCL values by size inside a
    node, the InfiniBand port at the same efficiency between nodes."""
    table = hw.nccl_busbw
    if size <= table[0][0]:
        bw = hw.nccl_small + (table[0][1] - hw.nccl_small) * max(size, 1.0) / table[0][0]
    else:
        bw = table[-1][1]
        for (s0, b0), (s1, b1) in zip(table, table[1:]):
            if s0 <= size <= s1:
                bw = b0 + (b1 - b0) * math.log(size / s0) / math.log(s1 / s0)
                break
    if span_nodes:
        bw = hw.inter_node_gbps * bw / hw.nvlink_gbps
    return bw * 1e9


def _in_flight(layout: Any, pp_rank: int) -> int:
    """Chunk forwards (stages of ``L / (pp vp)`` layers) a pipeline rank holds at its peak: 1F1B ``pp - rank``;
    torch's interleaved 1F1B its warm-up forwards ``(vp-1) * per_round + 2 (pp-1-rank)`` and one more."""
    m, pp, vp = layout.num_microbatches, layout.pp, layout.vp or 1
    if pp == 1:
        return 1
    if vp == 1:
        return min(pp - pp_rank, m)
    per_round = m // max(1, m // pp)    # torch's ScheduleInterleaved1F1B: micro-batches per round
    return min((vp - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1, m * vp)


def _recompute_parts(name: str) -> tuple:
    """(drop norm outputs, drop mlp, whole layers recomputed: 'all' / int per stage / 0)."""
    if name == "selective_mlp":
        return True, True, 0
    if name == "full":
        return False, False, "all"
    if name.startswith("full_block:"):
        return False, False, int(name[11:])
    return False, False, 0


def _layer_params(model: Any, layout: Any) -> Dict[str, float]:
    """Elements of one layer on one rank: ``attention`` + ``mlp`` (first layer's shapes; MoE: routed experts
    of this rank)."""
    one = rank_parameters(_config_one_layer(model), replace(layout, pp=1, vp=None), 0)
    attn = sum(t.numel for t in one if "self_attention" in t.name or "layernorm" in t.name and "decoder.layers" in t.name)
    mlp = sum(t.numel for t in one if ".mlp." in t.name)
    return {"attention": attn, "mlp": mlp}


def _config_one_layer(model: Any) -> Any:
    return model.replace(num_layers=1, moe_layer_freq=1) if hasattr(model, "replace") else model


def _fsdp_time(layout: Any, hw: Hardware, t_mb: float, layers: int, groups: Any) -> tuple:
    """Exposed seconds per step of FSDP's collectives: (reduce-scatters, all-gathers). ``groups``: (ranks, elements
    the rank holds whole, spans nodes) for the dense dp x cp group and the expert edp group; ``t_mb`` the slowest
    rank's compute of one micro-batch over its ``layers`` layers (a third forward, two thirds backward).

    Per micro-batch each unit's bf16 weights are all-gathered before its forward (``optim_grads`` under a pipeline:
    once per step, its schedules keep them gathered) and, with ``optim_grads_params``, again before its backward;
    ``(r-1)/r`` of the bytes cross the bus. FSDP2 prefetches the next unit's gather during the current unit's
    compute, so only what exceeds the forward (backward) compute shows, and at least the first unit's gather. The
    fp32 gradients are reduce-scattered once per step: during the last backward without a pipeline (hidden the same
    way), after the schedule with one (not hidden)."""
    m, pp = layout.num_microbatches, layout.pp
    t_ag = t_rs = 0.0
    for ranks, n, span in groups:
        if ranks > 1 and n:
            unit = 2.0 * n / max(1, layers)                       # one layer's bf16 weights
            t_ag += (ranks - 1) / ranks * 2.0 * n / _nccl_bw(hw, unit, span)
            t_rs += (ranks - 1) / ranks * 4.0 * n / _nccl_bw(hw, 2.0 * unit, span)
    if not t_ag:
        return 0.0, 0.0
    first = 1.0 / max(1, layers)

    def exposed(t: float, behind: float) -> float:
        return max(t - behind, t * first)

    forward_gathers = 1 if layout.sharding == "optim_grads" and pp > 1 else m
    gathers = forward_gathers * exposed(t_ag, t_mb / 3)
    if layout.sharding == "optim_grads_params":
        gathers += m * exposed(t_ag, 2 * t_mb / 3)
    scatters = exposed(t_rs, 2 * t_mb / 3) if pp == 1 else t_rs
    return scatters, gathers


def predict(layout: Any, work: Workload, hw: Hardware, cache: Optional[Dict[Any, Any]] = None,
            pp_rank: Optional[int] = None) -> Prediction:
    """Peak memory and step time of ``layout`` running ``work`` on ``hw`` (see the module docstring). ``cache``:
    a dict kept across calls for the same model (the planner's), holding per-rank byte counts and FLOPs.
    ``pp_rank``: the memory of that pipeline rank instead of the largest one's, and ``time["rank compute"]``: that
    rank's compute alone per step (its micro-batches' layers and head without the TP / CP / EP collectives, and the
    optimizer step; no bubble, no pipeline or data-parallel transfers), what a dry run of the rank measures."""
    c, s = work.model, work.seq_length
    tp, pp, cp, vp = layout.tp, layout.pp, layout.cp, layout.vp or 1
    m, mbs = layout.num_microbatches, layout.micro_batch_size
    tokens = mbs * s / cp                                   # tokens of one micro-batch on one rank
    moe = bool(getattr(c, "num_moe_experts", None))
    drop_norm, drop_mlp, whole = _recompute_parts(layout.recompute)
    bf16_params = work.params_dtype == "bf16"
    residual = RESIDUAL_BYTES[work.params_dtype]            # bytes per element of the residual stream
    dense_act = layer_activation_bytes(c, layout, moe_layer=moe, params_dtype=work.params_dtype)
    lp_key = ("layer", id(c), layout.tp, layout.ep, layout.etp)
    lp = cache.get(lp_key) if cache is not None else None
    if lp is None:
        lp = _layer_params(c, layout)
        if cache is not None:
            cache[lp_key] = lp
    layer_in = residual * c.hidden_size / (tp if layout.sequence_parallel and tp > 1 else 1)
    kept = dict(dense_act)
    if drop_norm:
        kept["norm_outputs"] = 0.0
    if drop_mlp:
        kept["mlp"] = 0.0
    per_layer_full = sum(dense_act.values()) * tokens
    per_layer_kept = sum(kept.values()) * tokens
    copies_full = 2.0 * (lp["attention"] + lp["mlp"])
    copies_kept = 2.0 * (lp["attention"] + (0.0 if drop_mlp else lp["mlp"]))
    fsdp = layout.sharding in FSDP_STRATEGIES
    layer_bf16 = 2.0 * (lp["attention"] + lp["mlp"])    # one layer's weights in bf16 (this rank's tp / ep part)
    if fsdp or bf16_params:   # FSDP gathers bf16 weights (its mixed-precision policy), bf16 parameters are bf16
        copies_full = copies_kept = 0.0     # already: autocast keeps no copies of its own
    layers_of = stage_layers(c.num_layers, layout)
    chunk_layers = len(layers_of[0]) // vp
    if bf16_params:   # main gradients: from a step's first backward to its optimizer step (no DDP bucket)
        kept_grads = pp > 1 or m > 1
    else:
        kept_grads = (work.grads_kept_between_steps or layout.dp * cp > 1 or pp > 1 or m > 1)

    # ---- memory: the largest pipeline rank
    best = None
    for r in (range(pp) if pp_rank is None else [pp_rank]):
        key = (id(c), layout.tp, layout.pp, layout.vp, layout.ep, layout.etp, layout.schedule, layout.dp * cp,
               layout.edp, layout.sharding, r, work.moment_bytes, work.params_dtype, work.store_param_remainders)
        hit = cache.get(key) if cache is not None else None
        if hit is None:
            tensors = rank_parameters(c, layout, r)
            edge = sum(t.numel for t in tensors if "decoder.layers" not in t.name)
            numel = (sum(t.numel for t in tensors if not t.expert), sum(t.numel for t in tensors if t.expert))
            hit = (state_bytes(c, layout, r, dp_rank=None, edp_rank=None, moment_bytes=work.moment_bytes,
                               params_dtype=work.params_dtype, store_param_remainders=work.store_param_remainders),
                   edge, numel)
            if cache is not None:
                cache[key] = hit
        sb, edge, numel = hit
        chunks = _in_flight(layout, r)
        layers = chunks * chunk_layers
        n_whole = layers if whole == "all" else min(int(whole), chunk_layers) * chunks if whole else 0
        act = n_whole * layer_in * tokens + (layers - n_whole) * (per_layer_kept + copies_kept)
        gathered = unsharded_fwd = unsharded_bwd = 0.0
        if fsdp:
            # gathered bf16 weights: the root unit (embedding, output layer) from forward to backward; every layer
            # of the rank with optim_grads, or under a pipeline of several micro-batches (its schedules keep them
            # gathered after each backward but the last); else the layer running and the one prefetched
            keep_all = layout.sharding == "optim_grads" or (pp > 1 and m > 1)
            gathered = 2.0 * edge + layer_bf16 * (len(layers_of[r]) if keep_all else min(2, len(layers_of[r])))
            # gradients: accumulated whole in fp32 until the step's last backward reduce-scatters them
            # (several micro-batches), else one layer's bf16 gradients before its reduce-scatter
            unsharded_fwd = GRAD_BYTES * (numel[0] + numel[1]) if m > 1 else 0.0
            unsharded_bwd = unsharded_fwd or layer_bf16
        elif not bf16_params:
            act += 2.0 * edge * min(chunks, 2)      # bf16 copies of the embedding / output weights
        holds_last = (c.num_layers - 1) in layers_of[r]
        logits = logits_bytes_per_token(c, tp) * mbs * s / cp if holds_last else 0.0
        transient = (per_layer_full + copies_full) if whole else 0.0
        grads_at_peak = sb.grads if kept_grads else 0.0
        fwd_peak = sb.params + sb.optimizer + grads_at_peak + act + logits + gathered + unsharded_fwd
        bwd_end = sb.total + transient + gathered + unsharded_bwd
        peak = max(fwd_peak, bwd_end)
        parts = {"params": sb.params / GIB, "grads": sb.grads / GIB, "optimizer": sb.optimizer / GIB,
                 "activations": act / GIB, "logits": logits / GIB}
        if fsdp:
            parts.update({"gathered weights": gathered / GIB, "unsharded grads": unsharded_bwd / GIB})
        if best is None or peak > best[0]:
            best = (peak, parts, sb, numel)
    peak, mem_parts, sb, (dense_numel, expert_numel) = best

    # ---- time of one micro-batch on each pipeline rank
    fp = cache.get(("flops", id(c), s)) if cache is not None else None
    if fp is None:
        fp = flops_parts(c, s)
        if cache is not None:
            cache[("flops", id(c), s)] = fp
    peak_flops = hw.bf16_tflops * 1e12
    gemm_rate = peak_flops * hw.gemm_efficiency * (hw.fp8_gemm_speedup if work.precision == "fp8" else 1.0)
    attn_rate = peak_flops * hw.attention_efficiency(s / cp)
    hbm = hw.hbm_tbps * 1e12
    h = c.hidden_size
    t_gemm_dense = tokens * fp["gemm"] / tp / gemm_rate
    t_attn = tokens * fp["attention"] / tp / attn_rate
    if moe:
        mlp_flops = fp["moe_gemm"] - (fp["gemm"] - fp["mlp"])
        rows = tokens * c.moe_router_topk * layout.ep / c.num_moe_experts   # tokens each local expert gets
        t_gemm = (tokens * (fp["gemm"] - fp["mlp"]) / tp / gemm_rate
                  + tokens * mlp_flops / (layout.etp or tp) / (gemm_rate * hw.moe_efficiency(rows)))
    else:
        t_gemm = t_gemm_dense
    t_elem = hw.elementwise_passes * per_layer_full / hbm
    t_mlp_gemm = tokens * fp["mlp"] / tp / gemm_rate
    extra = 0.0
    if layout.recompute == "selective":
        extra = t_attn / 3
    elif layout.recompute == "selective_mlp":
        frac = (dense_act["norm_outputs"] + dense_act["mlp"]) / sum(dense_act.values())
        extra = t_attn / 3 + t_mlp_gemm / 3 + t_elem * frac / 2
    t_whole_extra = (t_gemm + t_attn + t_elem / 2) / 3
    intra = hw.gpus_per_node
    t_tp = 0.0
    if tp > 1:
        vol = 8.0 * (tp - 1) / tp * tokens * h * 2
        t_tp = vol / (hw.tp_bandwidth_gbps * 1e9 * (1.0 if tp <= intra else hw.inter_node_gbps / hw.nvlink_gbps))
    t_cp = 0.0
    if cp > 1:
        kv = c.num_query_groups * c.kv_channels / tp
        ring = 3.0 * (cp - 1) * tokens * 2 * kv * 2
        t_ring = ring / _nccl_bw(hw, tokens * 2 * kv * 2, tp * cp > intra)
        q = c.num_attention_heads * c.kv_channels / tp
        t_merge = hw.cp_passes * (cp - 1) * tokens * q * 4 / hbm
        t_cp = max(0.0, t_ring - t_attn) + t_merge
    else:
        t_merge = 0.0
    t_ep = 0.0
    if moe and layout.ep > 1:
        vol = 4.0 * tokens * c.moe_router_topk * h * 2 * (layout.ep - 1) / layout.ep
        t_ep = vol / _nccl_bw(hw, vol / 4, tp * cp * layout.ep > intra)
    t_layer = t_gemm + t_attn + t_elem + extra + t_tp + t_cp + t_ep
    t_head = tokens * fp["head"] / tp / gemm_rate + hw.elementwise_passes * logits_bytes_per_token(c, tp) * tokens / hbm
    per_rank, compute_of_rank = [], []
    t_layer_compute = t_gemm + t_attn + t_elem + extra + t_merge
    for r in range(pp):
        n = len(layers_of[r])
        n_whole = n if whole == "all" else min(int(whole), chunk_layers) * vp if whole else 0
        t = n * t_layer + n_whole * t_whole_extra
        compute = n * t_layer_compute + n_whole * t_whole_extra
        if (c.num_layers - 1) in layers_of[r]:
            t += t_head
            compute += t_head
        per_rank.append(t)
        compute_of_rank.append(compute)
    t_mb = max(per_rank)
    t_pipe = (m + (pp - 1) / vp) * t_mb
    t_p2p = 0.0
    if pp > 1:
        msg = tokens * h * residual / (tp if layout.sequence_parallel and tp > 1 else 1)
        t_p2p = m * vp * 2 * msg / _nccl_bw(hw, msg, tp * cp * layout.dp >= intra)

    # ---- data parallel, optimizer, fixed cost
    t_ar = t_gather = 0.0
    bucket = 25 * 2 ** 20   # DDP's default bucket
    for ranks, n, span in ((layout.dp * cp, dense_numel, tp * layout.dp * cp > intra),
                           (layout.edp, expert_numel, layout.world // layout.edp > intra or layout.edp > intra)):
        if ranks > 1 and n:   # an all-reduce moves twice a reduce-scatter's bytes (the distributed optimizer's)
            passes = 1.0 if layout.sharding == "optim" else 2.0
            t_ar += passes * (ranks - 1) / ranks * 4.0 * n / _nccl_bw(hw, bucket, span)
            if layout.sharding != "no_shard":
                t_gather += (ranks - 1) / ranks * PARAM_BYTES * n / _nccl_bw(hw, PARAM_BYTES * n / ranks, span)
    # without a pipeline the buffer's buckets start inside the backward (overlap_grad_reduce, on by default there);
    # a pipeline reduces after its last backward
    t_dp = t_ar * (1.0 - hw.dp_overlap) if pp == 1 else t_ar
    if fsdp:
        t_dp, t_gather = _fsdp_time(layout, hw, t_mb, max(len(l) for l in layers_of),
                                    ((layout.dp * cp, dense_numel, tp * layout.dp * cp > intra),
                                     (layout.edp, expert_numel, layout.world // layout.edp > intra
                                      or layout.edp > intra)))
    # one pass over the parameters the rank steps: the calibrated bytes are fp32 AdamW's, whose two moments are read
    # and written once (16 bytes); bf16 moments move half of that
    opt_params = sb.optimizer / work.moment_bytes
    t_opt = opt_params * (hw.optimizer_bytes_per_param - 2.0 * (ADAM_BYTES - work.moment_bytes)) / hbm
    step = t_pipe + t_p2p + t_dp + t_gather + t_opt + hw.step_overhead_ms / 1e3
    tokens_step = work.global_batch_size * s
    world = layout.world
    tps = tokens_step / step / world
    mfu = num_floating_point_operations(c, work.global_batch_size, s, causal=True) / step / world / peak_flops
    n0 = m * len(layers_of[0])
    time = {"micro-batches": m * t_mb, "bubble": (pp - 1) / vp * t_mb, "of which tp": n0 * t_tp,
            "of which cp": n0 * t_cp, "of which ep": n0 * t_ep, "p2p": t_p2p, "dp": t_dp + t_gather,
            "optimizer": t_opt}
    if pp_rank is not None:
        time["rank compute"] = m * compute_of_rank[pp_rank] + t_opt
    return Prediction(peak_gib=peak / GIB, memory=mem_parts, step_s=step, tokens_per_s_per_gpu=tps, mfu=mfu,
                      time=time)

