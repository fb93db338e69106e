"""lightning-megatron: Megatron-style 5D parallel training as a PyTorch Lightning strategy.

The public names below are imported on first use (PEP 562), so ``import lightning_megatron`` and the layout
planner's command line (``python -m lightning_megatron.planner``) do not pay for importing Lightning. The strategy
names ``"megatron"`` and ``"megatron_spawn"`` are registered in Lightning's ``StrategyRegistry`` as soon as
Lightning is loaded (:mod:`lightning_megatron.strategy.registry`), whichever of the two packages is imported first.
"""
from __future__ import annotations

from typing import Dict, List

from lightning_megatron.utils.lazy import lazy_exports
from lightning_megatron.strategy.registry import register_when_lightning_loads

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: Dict[str, str] = {
    "GPTConfig": "lightning_megatron.models.config",
    "GPTModel": "lightning_megatron.models.gpt",
    "ParallelGPTModule": "lightning_megatron.models.module",
    "KVCache": "lightning_megatron.models.kv_cache",
    "MoEConfig": "lightning_megatron.moe",
    "MoELayer": "lightning_megatron.moe",
    "TopKRouter": "lightning_megatron.moe",
    "GroupedMLPExperts": "lightning_megatron.moe",
    "ParallelConfig": "lightning_megatron.parallel.config",
    "ParallelMesh": "lightning_megatron.parallel.mesh",
    "DryRun": "lightning_megatron.parallel.dry_run",
    "DeferredWgrad": "lightning_megatron.parallel.deferred_wgrad",
    "MainParams": "lightning_megatron.parallel.param_buffer.buffer",
    "apply_fsdp": "lightning_megatron.parallel.fsdp",
    "FSDPModel": "lightning_megatron.parallel.fsdp",
    "GradBucketReducer": "lightning_megatron.parallel.grad_buckets",
    "OverlappedParamGather": "lightning_megatron.parallel.param_gather",
    "DistributedOptimizer": "lightning_megatron.parallel.param_buffer.optimizer",
    "ColumnParallelLinear": "lightning_megatron.parallel.tensor_parallel",
    "RowParallelLinear": "lightning_megatron.parallel.tensor_parallel",
    "VocabParallelEmbedding": "lightning_megatron.parallel.tensor_parallel",
    "TensorParallelRNG": "lightning_megatron.parallel.tensor_parallel",
    "apply_tp": "lightning_megatron.parallel.tensor_parallel",
    "vocab_parallel_cross_entropy": "lightning_megatron.parallel.tensor_parallel",
    "parallelize": "lightning_megatron.parallelize",
    "ParallelizedModel": "lightning_megatron.parallelize",
    "ParallelRun": "lightning_megatron.run",
    "MegatronStrategy": "lightning_megatron.strategy",
    "REQUEUE_EXIT_CODE": "lightning_megatron.strategy.resilience",
    "MegatronPrecision": "lightning_megatron.precision",
    "ParamPrecision": "lightning_megatron.precision",
    "PrecisionAwareAdamW": "lightning_megatron.optimizer",
    "MFUMonitor": "lightning_megatron.callbacks",
    "LossCurve": "lightning_megatron.callbacks",
    "StragglerMonitor": "lightning_megatron.callbacks",
    "num_floating_point_operations": "lightning_megatron.callbacks",
    "flops_per_token": "lightning_megatron.callbacks",
    "Plan": "lightning_megatron.planner",
    "Layout": "lightning_megatron.planner",
    "config_from_hf": "lightning_megatron.hf",
    "config_to_hf": "lightning_megatron.hf",
    "load_hf_weights": "lightning_megatron.hf",
    "export_hf": "lightning_megatron.hf",
    "HFCheckpointLoader": "lightning_megatron.hf",
    "ShardedCheckpointIO": "lightning_megatron.checkpoint.distributed",
}

__all__: List[str] = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

register_when_lightning_loads("lightning_megatron.strategy.megatron_strategy")
