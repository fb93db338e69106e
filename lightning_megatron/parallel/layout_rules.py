"""Layout rules that need no torch: the pipeline schedules and how layers split over stages, the activation
recompute options, and Megatron's padded vocabulary size. :class:`~lightning_megatron.parallel.config.ParallelConfig`,
the layout planner (:mod:`lightning_megatron.planner`) and the modules that run these layouts
(:mod:`~lightning_megatron.parallel.pipeline`, :mod:`~lightning_megatron.parallel.recompute`,
:mod:`~lightning_megatron.parallel.tensor_parallel.layers`) share them, so the planner's command line does not
import torch."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Protocol


class RecomputeLayout(Protocol):
    """The :class:`~lightning_megatron.parallel.config.ParallelConfig` fields the recompute checks read (declared
    here so that these rules do not import the config that calls them)."""

    pp: int
    vp: Optional[int]
    num_layers_in_first_pipeline_stage: Optional[int]
    num_layers_in_last_pipeline_stage: Optional[int]
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    recompute_modules: Optional[List[str]]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
V_SHAPE_SCHEDULES = ("zbv", "dualpipev")


def default_schedule(vp: Optional[int]) -> str:
    """``"interleaved_1f1b"`` with virtual stages, else ``"1f1b"``."""
    return "interleaved_1f1b" if vp and vp > 1 else "1f1b"


def check_schedule(schedule: str, pp: int, vp: Optional[int]) -> None:
    """Raise ValueError when ``schedule`` cannot run ``pp`` ranks with ``vp`` stages per rank."""
    vp = vp or 1
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not one of {SCHEDULE_NAMES}")
    if schedule in SINGLE_STAGE_SCHEDULES and vp > 1:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs one stage per rank but vp={vp}: use 'interleaved_1f1b', "
            "'looped_bfs' or 'interleaved_zero_bubble' with virtual stages, or drop vp"
        )
    if schedule in V_SHAPE_SCHEDULES and vp != 2:
        raise ValueError(f"pipeline_schedule={schedule!r} places two stages per rank in a V: it needs vp=2, got vp={vp}")
    if schedule not in SINGLE_STAGE_SCHEDULES and schedule not in V_SHAPE_SCHEDULES and vp < 2:
        raise ValueError(f"pipeline_schedule={schedule!r} is a multi-stage schedule: it needs vp >= 2, got vp={vp}")


def layers_per_stage(num_layers: int, num_stages: int, first: Optional[int] = None,
                     last: Optional[int] = None) -> List[int]:
    """Number of layers of each global stage: an even split, or ``first`` / ``last`` layers on the first /
    last stage and an even split of the rest (Megatron's ``num_layers_in_first/last_pipeline_stage``).

    Raises:
        ValueError: the layers do not split as asked (naming the numbers).
    """
    if num_stages == 1:
        return [num_layers]
    fixed = {}
    if first is not None:
        fixed[0] = first
    if last is not None:
        fixed[num_stages - 1] = last
    rest_layers = num_layers - sum(fixed.values())
    rest_stages = num_stages - len(fixed)
    if any(n < 0 for n in fixed.values()) or rest_layers < 0:
        raise ValueError(
            f"num_layers_in_first/last_pipeline_stage={first}/{last} leave {rest_layers} of num_layers={num_layers}"
        )
    if rest_stages == 0:
        if rest_layers != 0:
            raise ValueError(f"first+last stage layers {first}+{last} != num_layers={num_layers}")
        return [fixed[0], fixed[num_stages - 1]]
    if rest_layers % rest_stages != 0:
        if not fixed:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by the {num_stages} pipeline stages (pp*vp): set "
                f"num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for an uneven split"
            )
        raise ValueError(
            f"after num_layers_in_first/last_pipeline_stage={first}/{last}, the remaining {rest_layers} layers "
            f"do not divide over the other {rest_stages} stages"
        )
    per = rest_layers // rest_stages
    return [fixed.get(i, per) for i in range(num_stages)]


def stage_placement(pp: int, vp: int, v_shape: bool) -> List[List[int]]:
    """Global stage indices held by each pipeline rank, in the rank's chunk order."""
    if v_shape:
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[v * pp + r for v in range(vp)] for r in range(pp)]

def min_microbatches(schedule: str, pp: int) -> int:
    """Fewest micro-batches per step a schedule needs (torch's rules, checked early with a clear error; DualPipeV
    needs one per stage, ``2 * pp``)."""
    return 1 if schedule == "gpipe" else 2 * pp if schedule == "dualpipev" else pp

RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
#: Megatron's ``recompute_modules`` names (``mla_up_proj`` is refused: the model has no multi-latent attention)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
#: names recomputed by discarding the function's kept output (Megatron's "output-discarding checkpointing")
OUTPUT_DISCARDING = ("layernorm", "moe_act")
#: names that need a mixture-of-experts model
MOE_RECOMPUTE_MODULES = ("moe", "moe_act", "shared_experts")

def check_recompute_options(granularity: Any, method: Any, num_layers: Any,
                            modules: Any) -> Optional[List[str]]:
    """Validate the recompute options (the ``ParallelConfig`` fields) on their own; returns ``recompute_modules``
    as a list (``["core_attn"]`` for selective granularity without one; None for the other granularities).

    Raises:
        ValueError: an unknown granularity / method / module name; ``full`` without a method or a number of
            layers; a method, a number of layers or modules with a granularity that does not take them.
    """
    if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={granularity!r} is not None or one of {RECOMPUTE_GRANULARITIES}")
    if method is not None and method not in RECOMPUTE_METHODS:
        raise ValueError(f"recompute_method={method!r} is not None or one of {RECOMPUTE_METHODS}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"recompute_num_layers={num_layers!r} must be a positive integer or None")
    if granularity == "full":
        if method is None or num_layers is None:
            raise ValueError(
                f"recompute_granularity='full' needs recompute_method ('uniform': every layer, in groups of "
                f"recompute_num_layers; 'block': the first recompute_num_layers layers of each pipeline stage) and "
                f"recompute_num_layers; got recompute_method={method!r}, recompute_num_layers={num_layers!r}")
        if modules is not None:
            raise ValueError(f"recompute_modules={list(modules)!r} names the parts selective recompute recomputes; "
                             "recompute_granularity='full' recomputes whole layers: drop recompute_modules")
        return None
    if method is not None or num_layers is not None:
        raise ValueError(
            f"recompute_method={method!r} / recompute_num_layers={num_layers!r} choose which whole layers are "
            f"recomputed: they need recompute_granularity='full', got recompute_granularity={granularity!r}")
    if granularity is None:
        if modules is not None:
            raise ValueError(f"recompute_modules={list(modules)!r} needs recompute_granularity='selective'")
        return None
    names = list(DEFAULT_RECOMPUTE_MODULES if modules is None else ([modules] if isinstance(modules, str) else modules))
    if not names:
        raise ValueError("recompute_modules=[] recomputes nothing: name at least one of "
                         f"{RECOMPUTE_MODULES} or drop recompute_granularity")
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"recompute_modules {unknown} are not among Megatron's names {RECOMPUTE_MODULES}")
    if "mla_up_proj" in names:
        raise ValueError("recompute_modules 'mla_up_proj' recomputes multi-latent attention's up projection; the "
                         "model has no multi-latent attention")
    return list(dict.fromkeys(names))

def recompute_chunk_sizes(config: RecomputeLayout, num_layers: int) -> List[int]:
    """Layers per chunk that ``run_layers`` runs at once: the whole model, or each of the ``pp * vp`` pipeline
    stages (virtual chunks), uneven first / last stages included."""
    if config.pp == 1:
        return [num_layers]

    return layers_per_stage(num_layers, config.pp * (config.vp or 1), config.num_layers_in_first_pipeline_stage,
                            config.num_layers_in_last_pipeline_stage)


def check_recompute_layers(config: RecomputeLayout, num_layers: int) -> None:
    """Check ``recompute_num_layers`` against the model's ``num_layers`` split into chunks (pipeline stages and
    virtual chunks): it may not exceed the largest chunk.

    Raises:
        ValueError: naming the chunk sizes and the number asked for.
    """
    if config.recompute_granularity != "full":
        return
    sizes = recompute_chunk_sizes(config, num_layers)
    n = config.recompute_num_layers
    if n > max(sizes):
        where = ("the model's num_layers" if len(sizes) == 1 else
                 f"the layers of each of the pp*vp = {len(sizes)} pipeline chunks {sizes}")
        raise ValueError(
            f"recompute_num_layers={n} is larger than {where} ({max(sizes)}): recompute_method="
            f"{config.recompute_method!r} recomputes "
            + ("groups of recompute_num_layers layers of a chunk" if config.recompute_method == "uniform" else
               "the first recompute_num_layers layers of each chunk")
            + f"; use 1 <= recompute_num_layers <= {max(sizes)}")


def check_recompute_model(config: RecomputeLayout, model_config: Any) -> None:
    """Check the recompute options against a model shape with Megatron's field names (``num_layers``,
    ``num_moe_experts``, ``moe_shared_expert_intermediate_size``; missing fields are skipped).

    Raises:
        ValueError: ``recompute_num_layers`` larger than a pipeline chunk (see :func:`check_recompute_layers`); an
            MoE name in ``recompute_modules`` on a dense model, or ``shared_experts`` without shared experts.
    """
    layers = getattr(model_config, "num_layers", None)
    if layers is not None:
        check_recompute_layers(config, layers)
    names = config.recompute_modules or []
    if getattr(model_config, "num_moe_experts", "absent") is None:
        moe = [n for n in names if n in MOE_RECOMPUTE_MODULES]
        if moe:
            raise ValueError(f"recompute_modules {moe} recompute parts of mixture-of-experts layers, but the model is "
                             "dense (num_moe_experts=None)")
    if "shared_experts" in names and getattr(model_config, "num_moe_experts", None) is not None \
            and not getattr(model_config, "moe_shared_expert_intermediate_size", 1):
        raise ValueError("recompute_modules 'shared_experts' needs shared experts "
                         "(moe_shared_expert_intermediate_size), the model has none")


def pad_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
