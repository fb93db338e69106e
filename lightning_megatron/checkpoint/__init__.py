"""Checkpoint state and storage: full model and optimizer state in the tp=1 layout (``state_dict``), every shard
described by its global position (``sharded_state``), the sharded checkpoint directories of
``torch.distributed.checkpoint`` (``distributed``: :class:`ShardedCheckpointIO`) and the atomic single-file writer
(``atomic_io``: :class:`AtomicCheckpointIO`). The strategy's checkpoint hooks
(:mod:`lightning_megatron.strategy.checkpoints`) use them."""
from __future__ import annotations

from typing import Dict, List

from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS: Dict[str, str] = {
    "AtomicCheckpointIO": "lightning_megatron.checkpoint.atomic_io",
    "ShardedCheckpointIO": "lightning_megatron.checkpoint.distributed",
}
__all__: List[str] = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
