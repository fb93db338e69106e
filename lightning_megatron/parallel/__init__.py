"""Parallel layout, process grid and the per-dimension transformations."""
from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS = {
    "ParallelConfig": "lightning_megatron.parallel.config",
    "ParallelMesh": "lightning_megatron.parallel.mesh",
    "apply_tp": "lightning_megatron.parallel.tensor_parallel",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
