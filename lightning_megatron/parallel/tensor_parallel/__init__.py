"""Tensor (+ sequence) parallelism: collectives, layers, vocab-parallel loss, RNG, plans."""
from lightning_megatron.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_megatron.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
    pad_vocab_size,
    tensor_parallel_sharded,
)
from lightning_megatron.parallel.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from lightning_megatron.parallel.tensor_parallel import plan
from lightning_megatron.parallel.tensor_parallel.plan import (
    ColumnParallelStyle,
    RowParallelStyle,
    SequenceParallelNormStyle,
    VocabParallelStyle,
    apply_tp,
)
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG, tensor_parallel_seed

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "TensorParallelModule",
    "pad_vocab_size", "tensor_parallel_sharded", "vocab_parallel_cross_entropy", "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "ColumnParallelStyle", "RowParallelStyle", "SequenceParallelNormStyle",
    "VocabParallelStyle", "apply_tp", "TensorParallelRNG", "tensor_parallel_seed",
]


def __getattr__(name: str) -> type:
    """The plan styles' earlier names (``plan.RENAMED``), deprecated."""
    if name in plan.RENAMED:
        return plan.deprecated_style(name, stacklevel=2)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
