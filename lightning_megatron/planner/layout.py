"""A candidate layout, its translation to ``ParallelConfig`` / ``MegatronStrategy`` / Megatron flags, and the
enumeration of candidates. Validity is decided by the library's own rules only: a candidate is valid when
``ParallelConfig(...)`` (with the layout's sharding level), ``resolve(world)`` and ``validate_model(model)`` accept
it (their ValueError is the rejection reason), plus the pipeline schedule's fewest micro-batches
(``min_microbatches``) and the global batch dividing into micro-batches."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from lightning_megatron.parallel.config import FSDP_STRATEGIES, SHARDING_STRATEGIES, ParallelConfig
from lightning_megatron.parallel.layout_rules import default_schedule, min_microbatches

__all__ = ["Layout", "RECOMPUTE_PRESETS", "recompute_options", "enumerate_layouts", "check_layout",
           "SUPPORTED_SHARDING"]

#: recompute presets by name -> ``ParallelConfig`` fields; ``full_block:N`` is also accepted (the first N layers
#: of each stage recomputed whole)
RECOMPUTE_PRESETS: Dict[str, Dict[str, Any]] = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),  # core_attn, Megatron's default
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "mlp"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
#: sharding levels MegatronStrategy runs (``data_parallel_sharding_strategy``): whole states (DDP), the distributed
#: optimizer (states over dp x cp), FSDP2 with gradients (ZeRO-2) and parameters (ZeRO-3) sharded too
SUPPORTED_SHARDING = SHARDING_STRATEGIES


def recompute_options(name: str) -> Dict[str, Any]:
    """``ParallelConfig`` fields of a recompute preset name (see :data:`RECOMPUTE_PRESETS`, or ``full_block:N``)."""
    if name.startswith("full_block:"):
        return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=int(name[11:]))
    if name not in RECOMPUTE_PRESETS:
        raise ValueError(f"recompute={name!r} is not one of {tuple(RECOMPUTE_PRESETS)} or 'full_block:N'")
    return dict(RECOMPUTE_PRESETS[name])


@dataclass(frozen=True)
class Layout:
    """One candidate layout of ``world = tp * pp * cp * dp`` GPUs (``ep`` carved out of dp x cp x tp).

    ``sharding``: ``data_parallel_sharding_strategy``: ``no_shard``, ``optim`` (``use_distributed_optimizer``),
    ``optim_grads`` or ``optim_grads_params`` (FSDP2, :mod:`lightning_megatron.parallel.fsdp`). ``recompute``: a preset name of
    :data:`RECOMPUTE_PRESETS` or ``full_block:N``. ``micro_batch_size`` sequences per micro-batch,
    ``num_microbatches`` per optimizer step and data-parallel rank (``Trainer(accumulate_grad_batches=...)``).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    vp: Optional[int] = None
    etp: Optional[int] = None
    sequence_parallel: bool = False
    sharding: str = "no_shard"
    recompute: str = "none"
    micro_batch_size: int = 1
    num_microbatches: int = 1
    cp_comm_type: str = "p2p"
    schedule: str = field(default="")

    def __post_init__(self) -> None:
        if not self.schedule:
            object.__setattr__(self, "schedule", default_schedule(self.vp))

    @property
    def world(self) -> int:
        """GPUs of the layout: ``tp * pp * cp * dp``."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size ``world / (etp * ep * pp)``."""
        return self.world // ((self.etp or self.tp) * self.ep * self.pp)

    def parallel_config(self, model: Any = None) -> ParallelConfig:
        """The library's ``ParallelConfig`` of this layout, resolved against ``world`` and, when given, validated
        against ``model`` (a ``GPTConfig``). Raises the library's ValueError when the layout is invalid."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = ParallelConfig(**self.strategy_kwargs())
        config.resolve(self.world)
        if model is not None:
            config.validate_model(model)
        return config

    def strategy_kwargs(self) -> Dict[str, Any]:
        """``MegatronStrategy`` keywords of this layout (Megatron's names)."""
        kw: Dict[str, Any] = dict(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)
        if self.vp:
            kw["vp"] = self.vp
        if self.etp is not None:
            kw["etp"] = self.etp
        if self.sequence_parallel:
            kw["sequence_parallel"] = True
        if self.cp > 1 and self.cp_comm_type != "p2p":
            kw["cp_comm_type"] = self.cp_comm_type
        if self.pp > 1 and self.schedule != default_schedule(self.vp):
            kw["pipeline_schedule"] = self.schedule
        if self.sharding == "optim":
            kw["use_distributed_optimizer"] = True
        elif self.sharding != "no_shard":
            kw["data_parallel_sharding_strategy"] = self.sharding
        kw.update(recompute_options(self.recompute))
        return kw

    def flags(self, global_batch_size: Optional[int] = None) -> List[str]:
        """The Megatron flags of this layout (``examples/pretrain_gpt.py`` accepts them)."""
        out = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}",
               f"--context-parallel-size {self.cp}", f"--micro-batch-size {self.micro_batch_size}"]
        if global_batch_size is not None:
            out.append(f"--global-batch-size {global_batch_size}")
        if self.ep > 1:
            out.append(f"--expert-model-parallel-size {self.ep}")
        if self.vp:
            out.append(f"--virtual-pipeline-model-parallel-size {self.vp}")
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.cp > 1 and self.cp_comm_type != "p2p":
            out.append(f"--cp-comm-type {self.cp_comm_type}")
        if self.sharding == "optim":
            out.append("--use-distributed-optimizer")
        elif self.sharding in FSDP_STRATEGIES:
            out.append(f"--use-custom-fsdp --data-parallel-sharding-strategy {self.sharding}")
        rc = recompute_options(self.recompute)
        if rc:
            out.append(f"--recompute-granularity {rc['recompute_granularity']}")
            if "recompute_method" in rc:
                out.append(f"--recompute-method {rc['recompute_method']} --recompute-num-layers "
                           f"{rc['recompute_num_layers']}")
            if "recompute_modules" in rc:
                out.append("--recompute-modules " + " ".join(rc["recompute_modules"]))
        return out


def refusal_reason(error: ValueError) -> str:
    """What a plan row shows for a layout the library refuses: the first clause of its ValueError (the text up to the
    first ``": "``, which names the rule; the rest holds the numbers and the fix)."""
    return str(error).split(": ")[0]


def check_layout(layout: Layout, model: Any, global_batch_size: int, precision: str = "bf16") -> Optional[str]:
    """The reason ``layout`` cannot run ``model`` in ``precision`` (``"bf16"`` / ``"fp8"``: FP8 layers), the
    library's ValueError text, or None when it can."""
    try:
        layout.parallel_config(model)
    except ValueError as e:
        return refusal_reason(e)
    per_step = layout.micro_batch_size * layout.num_microbatches * layout.dp
    if per_step != global_batch_size:
        return f"global batch {global_batch_size} != micro-batch x micro-batches x dp = {per_step}"
    if layout.pp > 1 and layout.num_microbatches < min_microbatches(layout.schedule, layout.pp):
        return f"{layout.num_microbatches} micro-batches < pp={layout.pp} (the schedule's fewest)"
    rounds = max(1, layout.num_microbatches // layout.pp)
    if layout.pp > 1 and (layout.vp or 1) > 1 and layout.num_microbatches % rounds:
        # torch.distributed.pipelining's interleaved schedules split the micro-batches into whole rounds
        return f"{layout.num_microbatches} micro-batches are not a multiple of the {rounds} rounds of pp={layout.pp}"
    return None


def _divisors(n: int, cap: int) -> List[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0 and d & (d - 1) == 0]


def enumerate_layouts(model: Any, gpus: int, global_batch_size: int, gpus_per_node: int = 8,
                      recompute: Sequence[str] = ("none", "selective", "full"),
                      sharding: Sequence[str] = SUPPORTED_SHARDING,
                      micro_batch_sizes: Sequence[int] = (1, 2, 4),
                      precision: str = "bf16") -> Iterator[Tuple[Layout, Optional[str]]]:
    """Every candidate of powers of two ``tp`` (within a node), ``pp`` (up to 64), ``vp`` (1, 2), ``cp`` (up to
    16), ``ep`` (MoE only),
    micro-batch sizes, sharding levels and recompute presets; yields ``(layout, reason or None)`` (the reason from
    :func:`check_layout` in ``precision``). Sequence parallelism is on whenever tp > 1 (it only saves memory and
    traffic); the sharded levels are offered where dp x cp > 1."""
    experts = getattr(model, "num_moe_experts", None)
    for tp in _divisors(gpus, gpus_per_node):
        for pp in _divisors(gpus // tp, 64):
            for cp in _divisors(gpus // (tp * pp), 16):
                dp = gpus // (tp * pp * cp)
                eps = _divisors(experts, dp * cp * tp) if experts else [1]
                for ep in eps:
                    for vp in ([None, 2] if pp > 1 else [None]):
                        for mbs in micro_batch_sizes:
                            if global_batch_size % (mbs * dp):
                                continue
                            m = global_batch_size // (mbs * dp)
                            for shard in sharding:
                                if shard != "no_shard" and dp * cp == 1:
                                    continue
                                for rc in recompute:
                                    layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, vp=vp,
                                                    etp=1 if experts and tp > 1 else None,
                                                    sequence_parallel=tp > 1, sharding=shard, recompute=rc,
                                                    micro_batch_size=mbs, num_microbatches=m)
                                    yield layout, check_layout(layout, model, global_batch_size, precision)
