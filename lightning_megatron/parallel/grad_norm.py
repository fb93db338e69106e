"""Gradient norm and clipping by the true global norm of a model split over TP, PP and EP/ETP."""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel.tensor_parallel.mappings import Group, group_size
from lightning_megatron.utils.tensors import coalesce, local_tensor


def global_grad_norm(params: Iterable[torch.nn.Parameter], sharded: Set[int], tp_group: Group,
                     model_parallel_groups: Optional[List[Group]] = None, expert: Optional[Set[int]] = None,
                     expert_group: Group = None, shard_group: Group = None,
                     expert_shard_group: Group = None,
                     local_norms: Optional[List[Tuple[torch.nn.Parameter, Tensor]]] = None) -> Tensor:
    """L2 norm of the gradients of the whole model, the same value on every rank.

    Args:
        params: this rank's parameters (grads already reduced over data parallel).
        sharded: ``id()`` of the parameters split over ``tp_group``; their squared norms are summed over it.
            Every other parameter is replicated over TP (SP-replicated norms have identical, already
            all-reduced grads) and is counted once.
        tp_group: the TP group (one all-reduce of a scalar).
        model_parallel_groups: further groups whose ranks hold disjoint parameters (pipeline stages):
            the total is summed over each.
        expert, expert_group: ``id()`` of expert parameters (split over the ep x etp block ``expert_group``,
            identical over expert data parallel); their squared norms are summed over ``expert_group``.
        shard_group, expert_shard_group: under FSDP, the groups the gradients are sharded over (dp x cp, and edp
            for the experts): ``DTensor`` gradients count by their local shards, whose squares are summed over
            these groups. None: gradients are whole on every data-parallel rank.
        local_norms: a list to extend with ``(parameter, norm of its local gradient)`` pairs (0-d tensors, no
            communication), computed in the same pass over the gradients (per tensor instead of per flat span: the
            same bytes); None: not wanted.

    The norm is accumulated in float32, or float64 when any parameter is float64 (never narrower than the
    gradients). The dtype comes from the parameters, not their gradients, so every rank of a group agrees on
    it even where some hold no gradient.
    """
    expert = expert or set()
    params = list(params)
    acc = _norm_dtype(params)
    grads_sharded, grads_replicated, grads_expert = [], [], []
    for p in params:
        if p.grad is None:
            continue
        grad = (p, local_tensor(p.grad.detach()))
        if id(p) in expert:
            grads_expert.append(grad)
        else:
            (grads_sharded if id(p) in sharded else grads_replicated).append(grad)
    every = grads_sharded + grads_replicated + grads_expert
    device = every[0][1].device if every else torch.device("cpu")
    sharded_sq = _sum_squares(grads_sharded, device, acc, local_norms)
    if group_size(tp_group) > 1:
        dist.all_reduce(sharded_sq, group=tp_group)
    total = sharded_sq + _sum_squares(grads_replicated, device, acc, local_norms)
    if shard_group is not None and group_size(shard_group) > 1:
        dist.all_reduce(total, group=shard_group)
    if expert:
        expert_sq = _sum_squares(grads_expert, device, acc, local_norms)
        if group_size(expert_group) > 1:
            dist.all_reduce(expert_sq, group=expert_group)
        if expert_shard_group is not None and group_size(expert_shard_group) > 1:
            dist.all_reduce(expert_sq, group=expert_shard_group)
        total = total + expert_sq
    for group in model_parallel_groups or []:
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def _norm_dtype(params: List[torch.nn.Parameter]) -> torch.dtype:
    """float32, or float64 when any of ``params`` is float64."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def _sum_squares(grads: List[Tuple[torch.nn.Parameter, Tensor]], device: torch.device, dtype: torch.dtype,
                 local_norms: Optional[List[Tuple[torch.nn.Parameter, Tensor]]] = None) -> Tensor:
    """Sum of the squares of every element of the gradients of ``grads`` (``(parameter, local gradient)`` pairs), over
    their flat spans (adjacent views of a contiguous gradient buffer count as one tensor: one norm per bucket, not per
    parameter); with ``local_norms``, per gradient, each norm appended there with its parameter."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    tensors = [g for _, g in grads]
    # half-precision gradients (bf16 main-gradient buffers, a direct step's): their norms in ``dtype``, not rounded
    half = all(t.dtype in (torch.bfloat16, torch.float16) for t in tensors) and dtype != tensors[0].dtype
    kwargs = {"dtype": dtype} if half else {}
    if local_norms is None:
        norms = torch._foreach_norm(coalesce(tensors), 2.0, **kwargs)
    else:
        norms = torch._foreach_norm(tensors, 2.0, **kwargs)
        local_norms.extend(zip([p for p, _ in grads], norms))
    return torch.stack([n.to(dtype) for n in norms]).pow(2).sum()


@torch.no_grad()
def clip_coefficient(norm: Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """``min(1, max_norm / (norm + eps))``, and 1 for a non-finite ``norm``: a step whose norm is NaN/inf is dropped by
    the non-finite guard, and its gradients stay as they were (to name the first non-finite one)."""
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, sharded: Set[int], tp_group: Group,
                    model_parallel_groups: Optional[List[Group]] = None, eps: float = 1e-6,
                    expert: Optional[Set[int]] = None, expert_group: Group = None,
                    check: Optional[Callable[[Tensor, Optional[list]], None]] = None, shard_group: Group = None,
                    expert_shard_group: Group = None, check_local_norms: bool = True) -> Tensor:
    """Scale gradients in place so the global norm is at most ``max_norm``; returns the norm before clipping.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + eps)``, clamped at 1)
    but with the norm from :func:`global_grad_norm` (``shard_group`` / ``expert_shard_group``: FSDP's, see there;
    ``DTensor`` gradients are scaled shard by shard). ``check(norm, local_norms)`` runs before any gradient is scaled
    (the non-finite guard raises there, so a NaN norm never reaches the gradients; ``local_norms``: each parameter's
    local gradient norm, see :func:`global_grad_norm`, when ``check_local_norms``, else None: the norm is then taken
    over the gradients' flat spans).
    """
    params = list(params)
    local_norms: Optional[list] = [] if check is not None and check_local_norms else None
    norm = global_grad_norm(params, sharded, tp_group, model_parallel_groups, expert, expert_group, shard_group,
                            expert_shard_group, local_norms)
    if check is not None:
        check(norm, local_norms)
    params = [p for p in params if p.grad is not None]
    coef = clip_coefficient(norm, max_norm, eps)
    if params:   # over the gradients' flat spans (one tensor per contiguous bucket)
        torch._foreach_mul_(coalesce([local_tensor(p.grad) for p in params]), coef.to(params[0].grad.device))
    return norm
