"""Autograd-aware collectives of Megatron's tensor and sequence parallel regions.

Every function takes the process group explicitly; ``group=None`` or a group of size 1 is the identity
(so the same model code runs unsharded). Activations are sequence-first ``[s, b, h]``: sequence parallel
collectives act on dim 0, tensor parallel gathers on the last dim.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

Group = Optional[dist.ProcessGroup]

# torch >= 2.13 renames the single-tensor collectives; older releases only have the *_tensor names.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    """World size of ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: Tensor, group: Group) -> Tensor:
    """Sum ``x`` over ``group`` in place and return it."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_dim0(x: Tensor, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0: ``[n, ...] -> [n * size, ...]``."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group=group)
    return out


def reduce_scatter_dim0(x: Tensor, group: Group) -> Tensor:
    """Sum over ``group`` and keep this rank's slice of dim 0: ``[n * size, ...] -> [n, ...]``."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size != 0:
        raise ValueError(
            f"dim 0 of size {x.shape[0]} is not divisible by the group size {size} "
            "(sequence parallelism needs seq_length divisible by tp)"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x, group=group)
    return out


def split_dim0(x: Tensor, group: Group) -> Tensor:
    """This rank's contiguous slice of dim 0 (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size != 0:
        raise ValueError(f"dim 0 of size {x.shape[0]} is not divisible by the group size {size}")
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


def all_gather_last_dim(x: Tensor, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along the last dim."""
    size = group_size(group)
    if size == 1:
        return x
    gathered = all_gather_dim0(x, group)
    return torch.cat(gathered.chunk(size, dim=0), dim=-1)


def split_last_dim(x: Tensor, group: Group) -> Tensor:
    """This rank's contiguous slice of the last dim."""
    size = group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, reduce_grad: bool) -> Tensor:
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.reduce_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_dim0(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_dim0(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return split_last_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: Tensor, group: Group) -> Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient over ``group`` backward.

    Also used on SP-replicated weights (norms, row-parallel bias) so their partial gradients are summed
    over the TP group inside autograd.
    """
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: Tensor, group: Group) -> Tensor:
    """Megatron's ``g``: all-reduce forward over ``group``, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: Tensor, group: Group, reduce_grad: bool = True) -> Tensor:
    """``[s/tp, b, h] -> [s, b, h]``: all-gather dim 0 forward; reduce-scatter (or split) backward."""
    return x if group_size(group) == 1 else _GatherFromSequenceRegion.apply(x, group, reduce_grad)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: Group) -> Tensor:
    """``[s, b, h]`` partial sums ``-> [s/tp, b, h]``: reduce-scatter dim 0 forward; all-gather backward."""
    return x if group_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: Tensor, group: Group) -> Tensor:
    """``[s, b, h]`` replicated ``-> [s/tp, b, h]``: split dim 0 forward; all-gather backward."""
    return x if group_size(group) == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: Tensor, group: Group) -> Tensor:
    """``[..., n/tp] -> [..., n]``: all-gather of the last dim forward; split backward."""
    return x if group_size(group) == 1 else _GatherFromTensorRegion.apply(x, group)
