"""Sequence parallelism switched off for a while (incremental decoding: one new token cannot be split over the
sequence). The tensor-parallel layers then all-reduce instead of reduce-scattering and skip the all-gather, which
gives the same values with every TP rank holding the whole (short) sequence; parameters are untouched."""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

from torch import nn

from lightning_megatron.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@contextlib.contextmanager
def sequence_parallel_disabled(module: nn.Module) -> Iterator[None]:
    """Within the block, every TP layer of ``module`` runs without sequence parallelism (over the same TP group),
    the embedding does not scatter over the sequence, and a model's ``sequence_parallel`` flag is False; all are
    restored after. Forward only (the gradient reductions of SP-replicated weights assume SP)."""
    saved: List[Tuple[object, str, object]] = []

    def override(obj: object, name: str, value: object) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for m in module.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel:
                override(m, "sequence_parallel", False)
            elif isinstance(m, VocabParallelEmbedding) and m.reduce_scatter:
                override(m, "reduce_scatter", False)
            if getattr(m, "scatter_group", None) is not None:
                override(m, "scatter_group", None)
            if getattr(m, "sequence_parallel", None) is True and not isinstance(m, (ColumnParallelLinear,
                                                                                     RowParallelLinear)):
                override(m, "sequence_parallel", False)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
