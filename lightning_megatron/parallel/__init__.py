"""Parallel layout, process grid and the per-dimension transformations."""
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.tensor_parallel import apply_tp

__all__ = ["ParallelConfig", "ParallelMesh", "apply_tp"]
