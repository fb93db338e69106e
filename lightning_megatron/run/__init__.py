"""The run without Lightning: :class:`ParallelRun` (the mesh, the parallelised model, the gradient finaliser, the
optimizers' sharding, the per-step calls, checkpoint I/O), which :class:`~lightning_megatron.strategy.MegatronStrategy`
and the plain quick-start loop both use; ``model_setup``: what fitting does to a parallelised model (replicas made
equal, FSDP2 units, the distributed optimizer's shards).

The names are imported on first use (PEP 562)."""
from __future__ import annotations

from typing import Dict, List

from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS: Dict[str, str] = {
    "ParallelRun": "lightning_megatron.run.parallel_run",
}
__all__: List[str] = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
