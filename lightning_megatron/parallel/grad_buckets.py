"""``overlap_grad_reduce``: data-parallel gradient reduction in buckets launched while backward still runs.

Under :class:`~lightning_megatron.MegatronStrategy` (and ``parallelize(..., param_buffer=True)``) the parameters'
contiguous buffer reduces its own buckets (:meth:`~lightning_megatron.parallel.param_buffer.buffer.MainParams.
overlap_reduction`); :func:`overlaps_grad_reduce` resolves the option's default for it. What is here serves a loop
that builds no buffer:

* pp = 1: torch DDP (:func:`~lightning_megatron.parallel.data_parallel.apply_dp`) reduces its buckets as they fill
  during backward, and skips the reduction for all but the last micro-batch of a step (``no_sync``):
  ``overlap_grad_reduce`` True (or None, the default) keeps DDP's buckets, sized by ``bucket_size``; False gives
  DDP one bucket holding every gradient (:func:`ddp_bucket_kwargs`).
* pp > 1: without overlap the stages' gradients are averaged in flattened buckets after the schedule
  (:func:`~lightning_megatron.parallel.grad_sync.allreduce_data_parallel_grads`). With it, a
  :class:`GradBucketReducer` counts each parameter's gradient accumulations (post-accumulate-grad hooks); when a
  parameter has received every micro-batch's contribution (the last micro-batch of its chunk) it is ready, and a
  bucket whose parameters are all ready starts its asynchronous all-reduce, in bucket order on every rank.
  :meth:`GradBucketReducer.finish` (before clipping and the optimizer step) starts the buckets that did not fill in
  backward, waits, and writes the averages into ``.grad``.

The arithmetic is that of the path without overlap (the same average, the same bf16 communication under
``grad_reduce_in_bf16``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.param_buffer.buffer import DEFAULT_BUCKET_ELEMENTS
from lightning_megatron.parallel.tensor_parallel.mappings import Group, group_size

__all__ = ["GradBucketReducer", "ddp_bucket_kwargs", "overlaps_grad_reduce"]


def overlaps_grad_reduce(config: ParallelConfig) -> bool:
    """Whether ``config`` reduces data-parallel gradients during backward (``overlap_grad_reduce`` resolved:
    None means True for pp = 1, torch DDP's default, and False for pp > 1)."""
    if config.overlap_grad_reduce is None:
        return config.pp == 1
    return config.overlap_grad_reduce


def ddp_bucket_kwargs(module: nn.Module, config: ParallelConfig, ddp_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The ``DistributedDataParallel`` bucket arguments that realise ``overlap_grad_reduce`` / ``bucket_size`` for
    ``module`` (pp = 1): ``{}`` for DDP's defaults; ``bucket_cap_mb`` from ``bucket_size`` (elements, times the
    element size of ``module``'s first parameter); without overlap one bucket of every parameter.

    Raises:
        ValueError: ``bucket_size`` or ``overlap_grad_reduce=False`` together with a ``bucket_cap_mb`` of
            ``ddp_kwargs`` (two sizes for the same buckets).
    """
    overlap = overlaps_grad_reduce(config)
    if config.bucket_size is None and overlap:
        return {}
    if "bucket_cap_mb" in ddp_kwargs:
        raise ValueError(
            f"bucket_cap_mb={ddp_kwargs['bucket_cap_mb']!r} and bucket_size={config.bucket_size!r} / "
            f"overlap_grad_reduce={config.overlap_grad_reduce!r} both size DDP's gradient buckets: give one of them")
    params = [p for p in module.parameters() if p.requires_grad]
    if not overlap:
        total = sum(p.numel() * p.element_size() for p in params)
        return {"bucket_cap_mb": total / 2**20 + 1.0}
    element = params[0].element_size() if params else 4
    return {"bucket_cap_mb": config.bucket_size * element / 2**20}


class _Bucket:
    """Parameters reduced together: one flattened buffer in flight at a time."""

    def __init__(self, params: List[nn.Parameter]) -> None:
        self.params = params
        self.ready = 0
        self.work: Optional[Any] = None
        self.flat: Optional[torch.Tensor] = None
        self.grads: List[torch.Tensor] = []


class GradBucketReducer:
    """Average the gradients of a pipeline rank's ``params`` over the data-parallel ``group`` (dp x cp), starting
    each bucket's all-reduce in backward once all its parameters have their step's last contribution.

    Args:
        params: the parameters to reduce (dense ones; experts are reduced over edp elsewhere). Buckets follow their
            reverse order (the order backward produces them), one dtype and device per bucket, up to
            ``bucket_size`` elements each (a larger parameter gets a bucket of its own).
        group: the data-parallel group; ``reduce_dtype``: communicate in this dtype (bf16 under
            ``grad_reduce_in_bf16``), written back in the gradient's dtype.
        uses: per parameter, the backward passes it takes part in per micro-batch (a weight shared by two pipeline
            chunks of this rank, as the tied embedding of V-shaped schedules, gets one per chunk). Default 1.

    Per optimizer step: :meth:`start_step` before the schedule, the hooks during it, :meth:`finish` after it.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Group, bucket_size: Optional[int] = None,
                 reduce_dtype: Optional[torch.dtype] = None, uses: Optional[Dict[int, int]] = None) -> None:
        self.group, self.size, self.reduce_dtype = group, group_size(group), reduce_dtype
        limit = bucket_size or DEFAULT_BUCKET_ELEMENTS
        self.buckets: List[_Bucket] = []
        open_: Dict[tuple, List[nn.Parameter]] = {}
        filled: Dict[tuple, int] = {}
        self._bucket_of: Dict[int, int] = {}
        groups: List[List[nn.Parameter]] = []
        for p in reversed([p for p in params if p.requires_grad]):
            key = (p.dtype, p.device)
            if key in open_ and filled[key] + p.numel() > limit and open_[key]:
                groups.append(open_.pop(key))
            if key not in open_:
                open_[key], filled[key] = [], 0
            open_[key].append(p)
            filled[key] += p.numel()
        groups += list(open_.values())
        for i, bucket_params in enumerate(groups):
            self.buckets.append(_Bucket(bucket_params))
            for p in bucket_params:
                self._bucket_of[id(p)] = i
        self._uses = dict(uses or {})
        self._expected: Optional[int] = None
        self._counts: Dict[int, int] = {}
        self._next = 0
        #: buckets whose all-reduce started inside backward, over all steps (the rest started in :meth:`finish`)
        self.started_in_backward = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets for p in b.params] if self.size > 1 else []

    def start_step(self, microbatches: int) -> None:
        """Arm the hooks for a step of ``microbatches`` backward passes per chunk (each micro-batch's loss carries
        the division by their count, so the gradients are reduced as they are)."""
        self._expected = microbatches
        self._counts = {}
        self._next = 0
        for b in self.buckets:
            b.ready, b.work, b.flat, b.grads = 0, None, None, []

    def _on_grad(self, p: nn.Parameter) -> None:
        if self._expected is None:
            return
        n = self._counts.get(id(p), 0) + 1
        self._counts[id(p)] = n
        if n != self._expected * self._uses.get(id(p), 1):
            return
        self.buckets[self._bucket_of[id(p)]].ready += 1
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                break
            self._launch(bucket)
            self._next += 1
            self.started_in_backward += 1

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params if p.grad is not None]
        bucket.grads = grads
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])   # a copy (flattening one tensor would alias its grad)
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
            flat.div_(self.size)   # average before the sum in a narrow dtype, as the path without overlap
        bucket.flat = flat
        bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Start the buckets that backward did not (in bucket order), wait for all, and write the averages into the
        parameters' ``.grad``. Collective over ``group``; disarms the hooks until the next :meth:`start_step`."""
        if self.size == 1:
            return
        self._expected = None
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)
        for bucket in self.buckets:
            if bucket.work is None:
                continue
            bucket.work.wait()
            flat = bucket.flat
            if self.reduce_dtype is None:
                flat.div_(self.size)
            for g, reduced in zip(bucket.grads, _unflatten_dense_tensors(flat, bucket.grads)):
                g.copy_(reduced)
            bucket.work, bucket.flat, bucket.grads = None, None, []

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
