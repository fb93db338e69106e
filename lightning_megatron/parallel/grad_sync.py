"""Gradient reductions besides torch DDP's: SP-replicated weights summed over the TP group, the
data-parallel average of pipeline stages' gradients, and expert weights over the expert-data-parallel group.

Under sequence parallelism every TP rank computes the gradient of a norm weight (or a row-parallel bias)
from its own slice of the sequence, so the true gradient is the sum over the TP group. Instead of one
small synchronous all-reduce per weight inside backward, the strategy defers them and reduces all of them
in one flattened collective before the optimizer step (as Megatron's ``finalize_model_grads``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_megatron.parallel.tensor_parallel.layers import RowParallelLinear
from lightning_megatron.parallel.tensor_parallel.mappings import Group, group_size

Owner = Tuple[nn.Module, str]


def defer_sequence_parallel_grad_reduce(module: nn.Module) -> List[Owner]:
    """Turn off the in-backward TP all-reduce of SP-replicated weights in ``module``; return their owners.

    Owners are ``(submodule, parameter name)``: resolve them to parameters after materialisation with
    :func:`owned_parameters`, and call :func:`allreduce_sequence_parallel_grads` after backward.
    """
    owners: List[Owner] = []
    for m in module.modules():
        if getattr(m, "sequence_parallel_group", None) is not None:
            m.sequence_parallel_group = None
            owners += [(m, name) for name, _ in m.named_parameters(recurse=False)]
        elif isinstance(m, RowParallelLinear) and m.sequence_parallel and m.bias is not None:
            m.reduce_bias_grad = False
            owners.append((m, "bias"))
    return owners


def owned_parameters(owners: List[Owner]) -> List[nn.Parameter]:
    """The current parameter objects of ``owners``."""
    return [getattr(m, name) for m, name in owners]


def _allreduce_grads(params: List[nn.Parameter], group: Group, average: bool,
                     bucket_bytes: Optional[int] = None) -> None:
    """All-reduce the gradients of ``params`` over ``group`` in flattened buckets (one dtype and device per
    bucket, at most ``bucket_bytes`` each unless a single gradient is larger; None: one bucket per dtype)."""
    size = group_size(group)
    if size == 1:
        return
    buckets: Dict[tuple, List[List[torch.Tensor]]] = {}
    filled: Dict[tuple, int] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.dtype, g.device)
        nbytes = g.numel() * g.element_size()
        per_key = buckets.setdefault(key, [[]])
        if bucket_bytes is not None and per_key[-1] and filled[key] + nbytes > bucket_bytes:
            per_key.append([])
            filled[key] = 0
        per_key[-1].append(g)
        filled[key] = filled.get(key, 0) + nbytes
    for per_key in buckets.values():
        for bucket in per_key:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            if average:
                flat.div_(size)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(reduced)


@torch.no_grad()
def allreduce_sequence_parallel_grads(params: List[nn.Parameter], group: Group) -> None:
    """Sum the gradients of ``params`` over the TP ``group`` in one flattened all-reduce (per dtype)."""
    _allreduce_grads(params, group, average=False)


@torch.no_grad()
def allreduce_data_parallel_grads(params: List[nn.Parameter], group: Group, bucket_bytes: int = 64 * 2**20) -> None:
    """Average the gradients of ``params`` over the data-parallel ``group`` in flattened buckets.

    Used for pipeline stages, whose micro-batches run several backward passes per step (torch DDP's reducer
    expects one): one reduction per optimizer step after the schedule, no overlap with backward.
    """
    _allreduce_grads(params, group, average=True, bucket_bytes=bucket_bytes)


@torch.no_grad()
def allreduce_expert_parallel_grads(params: List[nn.Parameter], edp_group: Group, dp_cp_size: int,
                                    bucket_bytes: int = 64 * 2**20) -> None:
    """Sum the gradients of expert ``params`` over the expert-data-parallel ``edp_group`` and divide by the
    dense data-parallel size ``dp_cp_size`` (Megatron's expert gradient scaling).

    Every rank's loss is ``dp_cp`` times its tokens' share of the global mean (dense gradients are then averaged
    over dp x cp). An expert sees the tokens of its whole ep x etp block, and the edp replicas of the block
    together see every token of the pipeline stage once, so the sum over edp divided by ``dp_cp`` is the
    gradient of the global mean. Runs (the scaling at least) even when edp = 1.
    """
    _allreduce_grads(params, edp_group, average=False, bucket_bytes=bucket_bytes)
    if dp_cp_size != 1:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, float(dp_cp_size))
