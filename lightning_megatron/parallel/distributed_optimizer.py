"""Megatron's distributed optimizer (``--use-distributed-optimizer``, ZeRO stage 1): the optimizer states are
sharded over the data-parallel group (dp x cp), built on torch's ``ZeroRedundancyOptimizer``.

Each rank of the group keeps the states of about ``1/(dp*cp)`` of the parameters, steps only those after the
gradients have been reduced as usual (DDP, or the pipeline's flattened reduction), and broadcasts them to the
other ranks. The gradients and the parameters stay whole on every rank; memory drops by the optimizer states
(Adam: 8 bytes per parameter) times ``1 - 1/(dp*cp)``. Checkpoints hold the full, layout-independent state
(:func:`gathered_state_dict`), so they load with or without sharding and under any layout.

With expert parallelism the routed experts differ between the dp x cp ranks (ep is carved out of them), so their
states are sharded over expert data parallel instead (edp: the ranks holding the same experts), Megatron's
layout: :class:`ExpertShardedOptimizer` keeps one ``ZeroRedundancyOptimizer`` per kind of parameter.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_megatron.optimizer.param_groups import constructor_kwargs, indexed_param_groups

__all__ = ["ExpertShardedOptimizer", "shard_optimizer", "gathered_state_dict", "is_sharded_optimizer",
           "rebind_lr_scheduler"]


def shard_optimizer(optimizer: Optimizer, group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` over ``group`` with ``optimizer``'s class, parameter groups (the same group
    dicts, so per-group hyper-parameters and an LR scheduler's entries carry over) and defaults.

    ``optimizer`` must not have stepped yet (its states would be dropped). The caller rebinds LR schedulers.
    """
    if optimizer.state:
        raise RuntimeError(f"shard_optimizer: {type(optimizer).__name__} already has state; shard it before the "
                           "first step")
    return ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer), process_group=group,
                                   **constructor_kwargs(optimizer))


class ExpertShardedOptimizer(Optimizer):
    """The distributed optimizer of a model with expert parallelism: the states of the dense parameters sharded
    over ``dense_group`` (dp x cp), those of the routed experts (``expert_params``) over ``expert_group`` (edp), each
    part a ``ZeroRedundancyOptimizer`` of ``optimizer``'s class and defaults.

    ``param_groups`` are ``optimizer``'s own group dicts (an LR scheduler's writes reach them); their
    hyper-parameters are copied into both parts before each step. ``state`` stays empty: the parts hold the states.
    :meth:`state_dict` / :meth:`load_state_dict` use the whole, unsharded state indexed over ``param_groups``
    (``state_dict`` after :meth:`consolidate_state_dict`, as ``ZeroRedundancyOptimizer``).
    ``optimizer`` must not have stepped yet.
    """

    def __init__(self, optimizer: Optimizer, expert_params: Sequence[torch.Tensor], dense_group: dist.ProcessGroup,
                 expert_group: dist.ProcessGroup) -> None:
        if optimizer.state:
            raise RuntimeError(f"ExpertShardedOptimizer: {type(optimizer).__name__} already has state; shard it "
                               "before the first step")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        experts = {id(p) for p in expert_params}
        #: ``(ZeroRedundancyOptimizer, index into param_groups of each of its groups)`` for the dense and expert parts
        self.parts: List[Tuple[ZeroRedundancyOptimizer, List[int]]] = []
        for wanted, group in ((lambda p: id(p) not in experts, dense_group), (lambda p: id(p) in experts, expert_group)):
            groups, links = [], []
            for i, g in enumerate(self.param_groups):
                params = [p for p in g["params"] if wanted(p)]
                if params:
                    groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
                    links.append(i)
            if groups:
                self.parts.append((ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                                           process_group=group, **constructor_kwargs(optimizer)),
                                   links))

    def _sync_hyperparameters(self) -> None:
        for zero, links in self.parts:
            for sub, i in zip(zero.param_groups, links):
                sub.update({k: v for k, v in self.param_groups[i].items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (with gradients on), then step both parts (each steps its shard and broadcasts it over
        its group)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        for zero, _ in self.parts:
            zero.step()
        return loss

    def _index_maps(self) -> List[List[int]]:
        """Per part: the index over ``param_groups`` of each of its parameters, in its own order."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return [[index[id(p)] for g in zero.param_groups for p in g["params"]] for zero, _ in self.parts]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather each part's states on rank ``to`` of its group (collective over both groups)."""
        for zero, _ in self.parts:
            zero.consolidate_state_dict(to=to)

    def part_state_dicts(self) -> List[Dict[str, Any]]:
        """Each part's whole state (after :meth:`consolidate_state_dict`, on the rank it was gathered to)."""
        return [zero.state_dict() for zero, _ in self.parts]

    def merge_state_dicts(self, parts: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        """The whole state indexed over ``param_groups`` from each part's whole state."""
        state: Dict[int, Any] = {}
        for raw, indices in zip(parts, self._index_maps()):
            for k, values in raw["state"].items():
                state[indices[k]] = values
        return {"state": dict(sorted(state.items())), "param_groups": indexed_param_groups(self.param_groups)}

    def state_dict(self) -> Dict[str, Any]:
        """The whole state (call :meth:`consolidate_state_dict` first, on every rank; valid where both parts were
        gathered)."""
        return self.merge_state_dicts(self.part_state_dicts())

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a whole state indexed over ``param_groups``: each part keeps its shard's states."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for (zero, links), indices in zip(self.parts, self._index_maps()):
            state = {k: state_dict["state"][i] for k, i in enumerate(indices) if i in state_dict["state"]}
            groups, start = [], 0
            for sub, i in zip(zero.param_groups, links):
                hyper = {k: v for k, v in state_dict["param_groups"][i].items() if k != "params"}
                groups.append({**hyper, "params": list(range(start, start + len(sub["params"])))})
                start += len(sub["params"])
            zero.load_state_dict({"state": state, "param_groups": groups})
            zero.state.clear()   # ZeroRedundancyOptimizer also keeps every loaded state; its shard's are in .optim


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
    from lightning_megatron.parallel.param_buffer.optimizer import DistributedOptimizer

    return isinstance(getattr(optimizer, "_optimizer", optimizer),
                      (ZeroRedundancyOptimizer, ExpertShardedOptimizer, DistributedOptimizer))


def _gathered(zero: ZeroRedundancyOptimizer) -> Dict[str, Any]:
    """``zero``'s whole state (consolidated) on every rank of its group, on CPU."""
    from lightning.fabric.utilities.apply_func import move_data_to_device   # only here: the run needs no Lightning

    group = zero.process_group
    cpu = torch.device("cpu")
    payload: List[Any] = [move_data_to_device(zero.state_dict(), cpu) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return payload[0]


def gathered_state_dict(optimizer: Any) -> Dict[str, Any]:
    """The whole optimizer state in ``torch.optim.Optimizer.state_dict()`` form (indices over all parameters, on
    CPU), on every rank of the optimizer's group(s). Collective over them: gathered on each group's first rank,
    then broadcast (checkpoints are layout-independent and the gathering of tensor-parallel shards that follows
    needs every rank)."""
    from lightning_megatron.parallel.param_buffer.optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.gathered_state_dict()
    optimizer.consolidate_state_dict(to=0)
    if isinstance(optimizer, ExpertShardedOptimizer):
        return optimizer.merge_state_dicts([_gathered(zero) for zero, _ in optimizer.parts])
    return _gathered(optimizer)


def shard_optimizers(optimizers: List[Optimizer], lr_scheduler_configs: List[Any], group: dist.ProcessGroup,
                     expert_params: Sequence[torch.Tensor] = (),
                     expert_group: Optional[dist.ProcessGroup] = None) -> List[Optimizer]:
    """Each optimizer replaced by its states-sharded version over ``group`` (dp x cp), or, with
    ``expert_params`` (expert parallelism), by an :class:`ExpertShardedOptimizer` sharding those over
    ``expert_group`` (edp); the LR schedulers of ``lr_scheduler_configs`` (Lightning's) are rebound to the new
    optimizers."""
    if expert_params:
        if expert_group is None:
            raise ValueError("shard_optimizers: expert_params need the expert data-parallel group (expert_group=)")
        sharded: List[Optimizer] = [ExpertShardedOptimizer(opt, expert_params, group, expert_group)
                                    for opt in optimizers]
    else:
        sharded = [shard_optimizer(opt, group) for opt in optimizers]
    for old, new in zip(optimizers, sharded):
        for config in lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is old:
                rebind_lr_scheduler(config.scheduler, new)
    return sharded
