"""Tensor-parallel plans: module-name patterns mapped to styles, and ``apply_tp`` which swaps the layers.

A style says what one module becomes: :class:`ColumnParallelStyle` (a :class:`ColumnParallelLinear`),
:class:`RowParallelStyle` (a :class:`RowParallelLinear`), :class:`VocabParallelStyle` (a
:class:`VocabParallelEmbedding`), :class:`SequenceParallelNormStyle` (the norm kept, its weights marked
sequence-parallel). They are not torch's DTensor styles (``torch.distributed.tensor.parallel.ColwiseParallel``):
the layers they make hold plain local tensors and communicate with the tensor-parallel mappings. Their earlier
names ``ColwiseParallel``, ``RowwiseParallel``, ``VocabParallel`` and ``SequenceParallelNorm`` still import, with a
``DeprecationWarning`` naming the new one.
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Optional

from torch import nn

from lightning_megatron.contract import TensorParallelAware, TensorParallelModel
from lightning_megatron.parallel.tensor_parallel.mappings import Group, group_size

__all__ = ["ColumnParallelStyle", "RowParallelStyle", "VocabParallelStyle", "SequenceParallelNormStyle", "apply_tp"]

#: the styles' earlier names -> their names now (the earlier ones import with a DeprecationWarning)
RENAMED = {"ColwiseParallel": "ColumnParallelStyle", "RowwiseParallel": "RowParallelStyle",
           "VocabParallel": "VocabParallelStyle", "SequenceParallelNorm": "SequenceParallelNormStyle"}


@dataclass
class ColumnParallelStyle:
    """Swap an ``nn.Linear``-like module for :class:`ColumnParallelLinear` (output rows split).

    ``stride``: 2 for fused ``[gate; up]``. ``vocab_size``/``padded_size``: output rows are a vocabulary
    padded to ``padded_size`` for this tp (``canonical_size``: its padding at tp=1, used in checkpoints).
    ``tied``: the layer holds no weight (uses the embedding's).
    """

    stride: int = 1
    vocab_size: Optional[int] = None
    padded_size: Optional[int] = None
    tied: bool = False
    canonical_size: Optional[int] = None

    def apply(self, module: nn.Module, group: Group, sequence_parallel: bool) -> nn.Module:
        from lightning_megatron.parallel.tensor_parallel.layers import ColumnParallelLinear

        layer = ColumnParallelLinear.from_linear(module, group, sequence_parallel, self.stride, self.vocab_size,
                                                 self.padded_size, self.tied)
        layer._canonical_rows = self.canonical_size
        return layer


@dataclass
class RowParallelStyle:
    """Swap an ``nn.Linear`` for :class:`RowParallelLinear` (input columns split)."""

    def apply(self, module: nn.Module, group: Group, sequence_parallel: bool) -> nn.Module:
        from lightning_megatron.parallel.tensor_parallel.layers import RowParallelLinear

        return RowParallelLinear.from_linear(module, group, sequence_parallel)


@dataclass
class VocabParallelStyle:
    """Swap an ``nn.Embedding`` for :class:`VocabParallelEmbedding` (vocabulary rows split).

    ``reduce_scatter``: reduce-scatter the output over the sequence (sequence parallel).
    """

    vocab_size: int
    padded_size: int
    reduce_scatter: bool = False
    canonical_size: Optional[int] = None

    def apply(self, module: nn.Module, group: Group, sequence_parallel: bool) -> nn.Module:
        from lightning_megatron.parallel.tensor_parallel.layers import VocabParallelEmbedding

        layer = VocabParallelEmbedding.from_embedding(module, group, self.vocab_size, self.padded_size,
                                                      self.reduce_scatter and sequence_parallel)
        layer._canonical_rows = self.canonical_size
        return layer


@dataclass
class SequenceParallelNormStyle:
    """Keep the norm; mark its weights SP-replicated (their grads are all-reduced over TP in backward)."""

    def apply(self, module: nn.Module, group: Group, sequence_parallel: bool) -> nn.Module:
        if not hasattr(module, "sequence_parallel_group"):
            raise TypeError(f"{type(module).__name__} has no sequence_parallel_group attribute")
        module.sequence_parallel_group = group if sequence_parallel else None
        return module


def apply_tp(
    model: nn.Module,
    group: Group,
    sequence_parallel: bool = False,
    plan: Optional[Dict[str, object]] = None,
    tp_fork: Optional[Callable[[], ContextManager]] = None,
) -> nn.Module:
    """Apply tensor (and sequence) parallelism to ``model`` in place over the TP ``group``; returns it.

    ``plan`` maps module-name patterns (``fnmatch``, ``*`` spans dots) to styles; default
    ``model.tensor_parallel_plan(tp, sequence_parallel)``. Weights on the meta device stay on meta (to be
    initialised after materialisation); real weights are sliced to this rank's shard. Afterwards
    ``model.set_tensor_parallel(group, sequence_parallel, tp_fork)`` is called if the model has it.

    Raises:
        ValueError: a plan pattern matches no module (a typo would otherwise silently skip parallelism).
    """
    tp = group_size(group)
    if tp == 1:
        return model
    if plan is None:
        if not isinstance(model, TensorParallelModel):
            raise ValueError(
                f"{type(model).__name__} has no tensor_parallel_plan(tp, sequence_parallel): pass plan= to "
                "apply_tp or use lightning_megatron.GPTModel"
            )
        plan = model.tensor_parallel_plan(tp, sequence_parallel)
    matched = {pattern: 0 for pattern in plan}
    for name, module in list(model.named_modules()):
        for pattern, style in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                matched[pattern] += 1
                new = style.apply(module, group, sequence_parallel)
                if new is not module:
                    parent_name, _, child = name.rpartition(".")
                    parent = model.get_submodule(parent_name) if parent_name else model
                    setattr(parent, child, new)
                break
    missing = [p for p, n in matched.items() if n == 0]
    if missing:
        raise ValueError(f"tensor-parallel plan patterns matched no module: {missing}")
    if isinstance(model, TensorParallelAware):
        model.set_tensor_parallel(group, sequence_parallel, tp_fork)
    return model


def deprecated_style(name: str, stacklevel: int = 2) -> type:
    """The style an earlier name (a key of :data:`RENAMED`) stands for, with a ``DeprecationWarning`` naming the new
    name; ``stacklevel`` as :func:`warnings.warn`'s, counted from the caller."""
    warnings.warn(f"lightning_megatron.parallel.tensor_parallel.{name} is deprecated: use {RENAMED[name]}, the same "
                  "class under a name that is not one of torch's DTensor styles", DeprecationWarning,
                  stacklevel=stacklevel + 1)
    return globals()[RENAMED[name]]


def __getattr__(name: str) -> type:
    """The styles' earlier names (:data:`RENAMED`), deprecated."""
    if name in RENAMED:
        return deprecated_style(name, stacklevel=2)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
