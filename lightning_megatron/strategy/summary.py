"""The model summary under :class:`~lightning_megatron.MegatronStrategy`: the whole model, not this rank's part.

Lightning's ``ModelSummary`` callback (on by default, ``Trainer(enable_model_summary=...)``) counts
``pl_module.parameters()``: on a tensor-parallel rank its shards (half the model at tp=2), on a pipeline stage its
layers only. :class:`ParallelModelSummary` counts each parameter at its full size (a tensor- or expert-parallel
shard as the full tensor a checkpoint holds; an FSDP ``DTensor`` by its global shape) and merges the pipeline stages'
parameters by name, so the table and its totals are those of the model every rank trains together, the numbers
Lightning's DDP shows for the same module (the vocabulary padded as at tp=1). :func:`count_whole_model` makes the
Trainer's summary callbacks use it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _tensor_has_shape
from torch import nn

import lightning.pytorch as pl
from lightning_megatron.checkpoint.state_dict import _full_shapes, tensor_parallel_owners

__all__ = ["ParallelModelSummary", "count_whole_model", "full_parameter_counts"]

#: parameter name -> (number of elements of the full parameter, trainable)
Counts = Dict[str, Tuple[int, bool]]


def full_parameter_counts(module: nn.Module, pp_group: Optional[Any] = None) -> Counts:
    """Every parameter of the whole model by name (as ``module.named_parameters()`` names it) with its full number of
    elements and whether it is trainable. Tensor- and expert-parallel shards count as the full tensors of a
    checkpoint (the plain model's shapes); with ``pp_group`` the stages' parameters are merged by name over the pipeline group (collective over it: call on
    every rank of the group)."""
    owners = tensor_parallel_owners(module)
    counts: Counts = {}
    for name, p in module.named_parameters():
        if _tensor_has_shape(p):   # an uninitialised (lazy) parameter: no size yet
            continue
        owner = owners.get(name)
        # a shard: the full tensor a checkpoint holds (the vocabulary padded as at tp=1, as the plain model has it)
        numel = math.prod(_full_shapes(*owner)[-1]) if owner is not None else p.numel()
        counts[name] = (int(numel), p.requires_grad)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts: List[Optional[Counts]] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, counts, group=pp_group)
        merged: Counts = {}
        for part in parts:
            for name, value in (part or {}).items():
                merged.setdefault(name, value)
        counts = merged
    return counts


class ParallelModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` with the parameter counts of the whole model (:func:`full_parameter_counts`):
    each row counts the full parameters under its module's name (from every pipeline stage), and the totals and the
    estimated size are the whole model's. The rows are this rank's modules (a pipeline stage lists its own layers at
    ``max_depth`` > 1). Collective over ``pp_group`` when given."""

    def __init__(self, model: "pl.LightningModule", max_depth: int = 1, pp_group: Optional[Any] = None) -> None:
        self._full_counts = full_parameter_counts(model, pp_group)
        super().__init__(model, max_depth=max_depth)

    def _count(self, prefix: str = "", trainable_only: bool = False) -> int:
        return sum(n for name, (n, trainable) in self._full_counts.items()
                   if (not prefix or name.startswith(prefix + ".")) and (trainable or not trainable_only))

    @property
    def param_nums(self) -> List[int]:
        return [self._count(name) for name in self._layer_summary]

    @property
    def total_parameters(self) -> int:
        return self._count()

    @property
    def trainable_parameters(self) -> int:
        return self._count(trainable_only=True)


def count_whole_model(trainer: "pl.Trainer", pp_group: Optional[Any]) -> None:
    """Make the Trainer's ``ModelSummary`` / ``RichModelSummary`` callbacks summarise with
    :class:`ParallelModelSummary` (collective over ``pp_group``; the callbacks run on every rank). A subclass with a
    summary of its own is left as it is."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummaryCallback) and \
                getattr(type(callback), "_summary", None) is ModelSummaryCallback._summary:
            def summary(trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                        _callback: ModelSummaryCallback = callback) -> ModelSummary:
                return ParallelModelSummary(pl_module, max_depth=_callback._max_depth, pp_group=pp_group)

            callback._summary = summary   # type: ignore[method-assign]
