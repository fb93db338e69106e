"""``plan()``: every candidate layout of a model on N GPUs, predicted and ranked; the ranked table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from lightning_megatron.planner.calibration import Hardware, load_hardware
from lightning_megatron.planner.layout import SUPPORTED_SHARDING, Layout, enumerate_layouts, refusal_reason
from lightning_megatron.planner.memory import check_params_dtype
from lightning_megatron.planner.model import Prediction, Workload, predict

__all__ = ["PlanRow", "Plan", "plan", "format_table"]


@dataclass
class PlanRow:
    """One candidate: its ``layout``, ``prediction`` (None when the library's rules refuse the layout) and
    ``reason`` it is rejected (None when it fits)."""

    layout: Layout
    prediction: Optional[Prediction]
    reason: Optional[str]

    @property
    def feasible(self) -> bool:
        """Whether the layout runs and fits (no rejection reason)."""
        return self.reason is None


@dataclass
class Plan:
    """The ranked candidates of one workload on ``gpus`` GPUs of ``hardware``: feasible rows first, fastest
    (predicted tokens/s per GPU) first; then the rejected ones, those closest to fitting first."""

    work: Workload
    gpus: int
    hardware: Hardware
    rows: List[PlanRow] = field(default_factory=list)

    @property
    def feasible(self) -> List[PlanRow]:
        """The ranked rows that fit, fastest first."""
        return [r for r in self.rows if r.feasible]

    @property
    def best(self) -> Layout:
        """The top-ranked feasible layout (ValueError when none fits)."""
        if not self.feasible:
            reasons = sorted({r.reason for r in self.rows if r.reason})
            raise ValueError(f"no layout of {self.gpus} GPUs fits: {reasons[:5]}")
        return self.feasible[0].layout

    def rank_of(self, **fields: Any) -> Optional[PlanRow]:
        """The first row whose layout has all ``fields`` (e.g. ``tp=4, pp=4, cp=2``), or None."""
        for row in self.rows:
            if all(getattr(row.layout, k) == v for k, v in fields.items()):
                return row
        return None

    def index(self, row: PlanRow) -> int:
        """1-based rank of a feasible row."""
        return self.feasible.index(row) + 1

    def strategy_kwargs(self) -> Dict[str, Any]:
        """``MegatronStrategy`` keywords of the best layout."""
        return self.best.strategy_kwargs()


def plan(model: Any, gpus: int, global_batch_size: int, seq_length: Optional[int] = None,
         hardware: str = "h200", gpu_memory_gib: Optional[float] = None, precision: str = "bf16",
         recompute: Sequence[str] = ("none", "selective", "full"), sharding: Sequence[str] = SUPPORTED_SHARDING,
         micro_batch_sizes: Sequence[int] = (1, 2, 4), exp_avg_dtype: str = "fp32",
         exp_avg_sq_dtype: str = "fp32", params_dtype: str = "fp32",
         store_param_remainders: Optional[bool] = None) -> Plan:
    """Enumerate, validate (the library's rules), predict and rank the layouts of ``model`` (a ``GPTConfig``) on
    ``gpus`` GPUs of ``hardware`` (``"h100"``/``"h200"``, memory overridden by ``gpu_memory_gib``) for
    ``global_batch_size`` sequences of ``seq_length`` (default ``model.seq_length``) per step. ``sharding``: the
    levels considered (default all four: ``no_shard``, ``optim``, and FSDP's ``optim_grads`` /
    ``optim_grads_params``). ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: the Adam moments' dtypes (``"bf16"``: the
    precision-aware optimizer, ``ParallelGPTModule``'s arguments of the same names). ``params_dtype``: ``"fp32"`` or
    ``"bf16"`` (``MegatronPrecision(params_dtype=torch.bfloat16)``: bf16 parameters with fp32 main parameters and
    gradients; under FSDP's levels FSDP2 holds them as fp32 shards). ``store_param_remainders``: with ``"bf16"``, the
    fp32 main parameters held as int16 remainders (2 bytes per parameter less; None: on with ``"bf16"``, as
    ``MegatronPrecision``'s default)."""
    for name, value in (("gpus", gpus), ("global_batch_size", global_batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision={precision!r} must be 'bf16' or 'fp8'")
    seq = seq_length or model.seq_length
    if seq != model.seq_length:
        model = model.replace(seq_length=seq, max_position_embeddings=max(seq, model.max_position_embeddings))
    hw = load_hardware(hardware, gpu_memory_gib)
    work = Workload(model, seq, global_batch_size, precision, exp_avg_dtype=exp_avg_dtype,
                    exp_avg_sq_dtype=exp_avg_sq_dtype, params_dtype=params_dtype,
                    store_param_remainders=store_param_remainders)
    out = Plan(work, gpus, hw)
    cache: Dict[Any, Any] = {}
    feasible, rejected = [], []
    for layout, reason in enumerate_layouts(model, gpus, global_batch_size, hw.gpus_per_node, recompute, sharding,
                                            micro_batch_sizes, precision):
        if reason is None:
            try:   # the library's rule for bf16 parameters (FSDP's levels refused)
                check_params_dtype(layout.sharding, params_dtype)
            except ValueError as e:
                reason = refusal_reason(e)
        if reason is not None:
            rejected.append(PlanRow(layout, None, reason))
            continue
        p = predict(layout, work, hw, cache)
        if not hw.fits(p.peak_gib):
            rejected.append(PlanRow(layout, p, f"out of memory: {p.peak_gib:.1f} GiB predicted, "
                                               f"{(hw.memory_gib - hw.reserved_gib) / (1 + hw.fragmentation):.1f} usable"))
        else:
            feasible.append(PlanRow(layout, p, None))
    feasible.sort(key=lambda r: -r.prediction.tokens_per_s_per_gpu)
    rejected.sort(key=lambda r: (r.prediction is None, r.prediction.peak_gib if r.prediction else 0.0))
    out.rows = feasible + rejected
    return out


def _line(rank: str, row: PlanRow) -> str:
    lay, p = row.layout, row.prediction
    mem = f"{p.peak_gib:7.1f}" if p else "      -"
    tps = f"{p.tokens_per_s_per_gpu:9,.0f}" if p else "        -"
    mfu = f"{100 * p.mfu:5.1f}%" if p else "     -"
    return (f"| {rank:>4} | {lay.tp:>2} | {lay.pp:>2} | {lay.vp or 1:>2} | {lay.cp:>2} | {lay.ep:>2} | {lay.dp:>3} "
            f"| {lay.micro_batch_size:>3} | {lay.sharding:<8} | {lay.recompute:<9} | {mem} | {tps} | {mfu} "
            f"| {row.reason or ''} |")


HEADER = ("| rank | tp | pp | vp | cp | ep |  dp | mbs | sharding | recompute | GiB/GPU | tokens/s/GPU |   MFU "
          "| rejected because |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_table(result: Plan, top: int = 10, rejected: int = 5, show: Sequence[Layout] = ()) -> str:
    """The ranked table as Markdown: the ``top`` feasible layouts, any layout of ``show`` (marked with its rank
    or as rejected), and the first ``rejected`` refused layouts (those closest to fitting) with their reasons,
    then a count of the refusals by reason."""
    lines = [HEADER]
    feasible = result.feasible
    for i, row in enumerate(feasible[:top], 1):
        lines.append(_line(str(i), row))
    for wanted in show:
        for i, row in enumerate(result.rows, 1):
            if row.layout == wanted and not (row.feasible and i <= top):
                lines.append(_line(str(i) if row.feasible else "x", row))
    refused = [r for r in result.rows if not r.feasible]
    for row in refused[:rejected]:
        lines.append(_line("x", row))
    counts: Dict[str, int] = {}
    for row in refused:
        key = row.reason.split(":")[0] if row.reason.startswith("out of memory") else row.reason
        counts[key] = counts.get(key, 0) + 1
    work = result.work
    lines.append("")
    lines.append(f"{len(feasible)} of {len(result.rows)} layouts fit on {result.gpus} x {result.hardware.name} "
                 f"({result.hardware.memory_gib:g} GiB); seq {work.seq_length}, global batch "
                 f"{work.global_batch_size}, {work.precision}"
                 + (", bf16 parameters" if work.params_dtype == "bf16" else "") + ". Refused: "
                 + "; ".join(f"{n} x {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:6]))
    return "\n".join(lines)
