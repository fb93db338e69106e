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
from lightning_megatron.utils.tensors import coalesce, local_tensor

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
                     bucket_bytes: Optional[int] = None, reduce_dtype: Optional[torch.dtype] = None) -> None:
    """All-reduce the gradients of ``params`` over ``group`` in flattened buckets (one dtype and device per
    bucket, at most ``bucket_bytes`` each unless a single gradient is larger; None: one bucket per dtype).
    ``reduce_dtype``: communicate in this dtype (e.g. bfloat16: half the traffic), the result is cast back."""
    size = group_size(group)
    if size == 1:
        return
    buckets: Dict[tuple, List[List[torch.Tensor]]] = {}
    filled: Dict[tuple, int] = {}
    # FSDP: this rank's shard, laid out alike on every rank of a tp / embedding group. Adjacent views of a contiguous
    # gradient buffer are reduced as one flat tensor, in storage order (the same on every rank of the group)
    grads = coalesce([g for g in (local_tensor(p.grad) for p in params) if g is not None])
    for g in grads:
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
            narrow = reduce_dtype is not None
            if len(bucket) == 1 and not narrow and bucket[0].is_contiguous():   # a buffer's span: reduced in place
                dist.all_reduce(bucket[0], group=group)
                if average:
                    bucket[0].div_(size)
                continue
            flat = _flatten_dense_tensors(bucket)
            if narrow:
                flat = flat.to(reduce_dtype)
            # average before the sum in a narrow dtype (as torch's bf16 DDP hook), after it otherwise
            if average and narrow:
                flat.div_(size)
            dist.all_reduce(flat, group=group)
            if average and not narrow:
                flat.div_(size)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(reduced)


@torch.no_grad()
def allreduce_sequence_parallel_grads(params: List[nn.Parameter], group: Group) -> None:
    """Sum the gradients of ``params`` over the TP ``group`` in one flattened all-reduce (per dtype)."""
    _allreduce_grads(params, group, average=False)


@torch.no_grad()
def allreduce_data_parallel_grads(params: List[nn.Parameter], group: Group, bucket_bytes: int = 64 * 2**20,
                                  reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Average the gradients of ``params`` over the data-parallel ``group`` in flattened buckets
    (communicated in ``reduce_dtype`` when given).

    Used for pipeline stages, whose micro-batches run several backward passes per step (torch DDP's reducer
    expects one): one reduction per optimizer step after the schedule, no overlap with backward.
    """
    _allreduce_grads(params, group, average=True, bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype)


@torch.no_grad()
def allreduce_expert_parallel_grads(params: List[nn.Parameter], edp_group: Group, dp_cp_size: int,
                                    bucket_bytes: int = 64 * 2**20, reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Sum the gradients of expert ``params`` over the expert-data-parallel ``edp_group`` and divide by the
    dense data-parallel size ``dp_cp_size`` (Megatron's expert gradient scaling).

    Every rank's loss is ``dp_cp`` times its tokens' share of the global mean (dense gradients are then averaged
    over dp x cp). An expert sees the tokens of its whole ep x etp block, and the edp replicas of the block
    together see every token of the pipeline stage once, so the sum over edp divided by ``dp_cp`` is the
    gradient of the global mean. Runs (the scaling at least) even when edp = 1.
    """
    _allreduce_grads(params, edp_group, average=False, bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype)
    if dp_cp_size != 1:
        grads = coalesce([local_tensor(p.grad) for p in params if p.grad is not None])
        if grads:
            torch._foreach_div_(grads, float(dp_cp_size))


def _mean_allreduce(tensor: torch.Tensor, group: Group):
    """Start averaging ``tensor`` in place over ``group``; returns the work's future. NCCL averages inside the
    collective (``ReduceOp.AVG``, no extra kernel); other backends (gloo has no AVG) divide first, then sum."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()
    tensor.div_(group_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def mean_allreduce_hook(group, bucket):  # no annotations: DDP compares them to its classes, strings here
    """DDP communication hook ``(group, GradBucket) -> Future[Tensor]``: average ``bucket`` over ``group`` in its
    own dtype. The same result as DDP's default, without its cost: with no hook registered DDP divides every
    parameter's gradient by the group size in a kernel of its own (one per parameter, each a full read and write
    of that gradient), before and apart from the all-reduce. On NCCL the average happens inside the collective."""
    buffer = bucket.buffer()
    # the all-reduce is in place: the bucket itself is the result (a dry run's fake future carries no value)
    return _mean_allreduce(buffer, group).then(lambda f: buffer)


def bf16_allreduce_hook(group, bucket):  # no annotations: DDP compares them to its classes, strings here
    """DDP communication hook ``(group, GradBucket) -> Future[Tensor]``: average ``bucket`` over ``group``
    communicating in bfloat16 (half the traffic of float32 gradients), written back in the bucket's dtype.
    Torch's own ``bf16_compress_hook`` refuses anything but CUDA/XPU; this one also runs on gloo, so the CPU
    tests exercise the path the GPUs take."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16)

    def decompress(f):
        buffer.copy_(compressed)   # reduced in place
        return buffer

    return _mean_allreduce(compressed, group).then(decompress)
