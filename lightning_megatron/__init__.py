"""lightning-megatron: Megatron-style 5D parallel training as a PyTorch Lightning strategy."""
from lightning_megatron.hf import HFCheckpointLoader, config_from_hf, config_to_hf, export_hf, load_hf_weights
from lightning_megatron.callbacks import LossCurve, MFUMonitor, flops_per_token, num_floating_point_operations
from lightning_megatron.dist_checkpoint import ShardedCheckpointIO
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.gpt import GPTModel
from lightning_megatron.models.kv_cache import KVCache
from lightning_megatron.models.module import ParallelGPTModule
from lightning_megatron.moe import GroupedMLPExperts, MoEConfig, MoELayer, TopKRouter
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.deferred_wgrad import DeferredWgrad
from lightning_megatron.parallel.main_grad import MainParams
from lightning_megatron.parallel.fsdp import FSDPModel, apply_fsdp
from lightning_megatron.parallel.grad_buckets import GradBucketReducer
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.param_gather import OverlappedParamGather
from lightning_megatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRNG,
    VocabParallelEmbedding,
    apply_tp,
    vocab_parallel_cross_entropy,
)
from lightning_megatron.parallelize import ParallelizedModel, parallelize
from lightning_megatron.planner import Layout, Plan
from lightning_megatron.precision import MegatronPrecision
from lightning_megatron.strategy import MegatronStrategy

__version__ = "0.1.0"

__all__ = [
    "GPTConfig",
    "GPTModel",
    "ParallelGPTModule",
    "MoEConfig",
    "MoELayer",
    "TopKRouter",
    "GroupedMLPExperts",
    "ParallelConfig",
    "ParallelMesh",
    "DeferredWgrad",
    "MainParams",
    "apply_fsdp",
    "FSDPModel",
    "GradBucketReducer",
    "OverlappedParamGather",
    "MegatronStrategy",
    "MegatronPrecision",
    "parallelize",
    "ParallelizedModel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "TensorParallelRNG",
    "apply_tp",
    "vocab_parallel_cross_entropy",
    "MFUMonitor",
    "LossCurve",
    "num_floating_point_operations",
    "flops_per_token",
    "Plan",
    "Layout",
    "KVCache",
    "config_from_hf",
    "config_to_hf",
    "load_hf_weights",
    "export_hf",
    "HFCheckpointLoader",
    "ShardedCheckpointIO",
]
