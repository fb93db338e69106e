"""Megatron's distributed optimizer (``--use-distributed-optimizer``, ZeRO stage 1): the optimizer states are
sharded over the data-parallel group (dp x cp), built on torch's ``ZeroRedundancyOptimizer``.

Each rank of the group keeps the states of about ``1/(dp*cp)`` of the parameters, steps only those after the
gradients have been reduced as usual (DDP, or the pipeline's flattened reduction), and broadcasts them to the
other ranks. The gradients and the parameters stay whole on every rank; memory drops by the optimizer states
(Adam: 8 bytes per parameter) times ``1 - 1/(dp*cp)``. Checkpoints hold the full, layout-independent state
(:func:`gathered_state_dict`), so they load with or without sharding and under any layout.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

__all__ = ["shard_optimizer", "gathered_state_dict", "is_sharded_optimizer", "rebind_lr_scheduler"]


def _constructor_kwargs(optimizer: Optimizer) -> Dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW records ``decoupled_weight_decay`` in its
    defaults but does not take it)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def shard_optimizer(optimizer: Optimizer, group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` over ``group`` with ``optimizer``'s class, parameter groups (the same group
    dicts, so per-group hyper-parameters and an LR scheduler's entries carry over) and defaults.

    ``optimizer`` must not have stepped yet (its states would be dropped). The caller rebinds LR schedulers.
    """
    if optimizer.state:
        raise RuntimeError(f"shard_optimizer: {type(optimizer).__name__} already has state; shard it before the "
                           "first step")
    return ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer), process_group=group,
                                   **_constructor_kwargs(optimizer))


def rebind_lr_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point an LR scheduler made for another optimizer at ``optimizer``. The scheduler checks, on its first
    step, that the optimizer's ``step`` carries its call tracking (torch's ``LRScheduler`` protocol: the
    ``_wrapped_by_lr_sched`` mark and the ``_opt_called`` flag); the new optimizer's ``step`` gets the same."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return
    opt_ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        if opt is not None:
            opt._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


def is_sharded_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a ``LightningOptimizer`` wraps) shards its states."""
    return isinstance(getattr(optimizer, "_optimizer", optimizer), ZeroRedundancyOptimizer)


def gathered_state_dict(optimizer: ZeroRedundancyOptimizer) -> Dict[str, Any]:
    """The whole optimizer state in ``torch.optim.Optimizer.state_dict()`` form (indices over all parameters, on
    CPU), on every rank of the optimizer's group. Collective over that group: gathered on its first rank, then
    broadcast (checkpoints are layout-independent and the gathering of tensor-parallel shards that follows
    needs every rank)."""
    group = optimizer.process_group
    optimizer.consolidate_state_dict(to=0)
    cpu = torch.device("cpu")
    payload: List[Any] = [move_data_to_device(optimizer.state_dict(), cpu) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return payload[0]


def shard_optimizers(optimizers: List[Optimizer], lr_scheduler_configs: List[Any],
                     group: dist.ProcessGroup) -> List[ZeroRedundancyOptimizer]:
    """Each optimizer replaced by its states-sharded version over ``group`` (dp x cp); the LR schedulers of
    ``lr_scheduler_configs`` (Lightning's) are rebound to the new optimizers."""
    sharded = [shard_optimizer(opt, group) for opt in optimizers]
    for old, new in zip(optimizers, sharded):
        for config in lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is old:
                rebind_lr_scheduler(config.scheduler, new)
    return sharded
