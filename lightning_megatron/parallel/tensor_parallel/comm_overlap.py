"""``tp_comm_overlap``: sequence-parallel collectives split into a ring of chunked GEMMs and point-to-point exchanges.

Under sequence parallelism (TP group of size ``t``, rank ``r``, each rank holding ``n = s/t`` rows of the sequence):

* column-parallel forward ``y = all_gather(x) @ W^T``: at ring step ``i`` rank ``r`` holds the chunk of rank
  ``r - i``, sends it on to ``r + 1`` and receives the next from ``r - 1`` while it multiplies the chunk it has
  into its rows of ``y``; the received chunks make up the gathered input kept for the weight gradient.
* row-parallel forward ``y = reduce_scatter(x @ W^T)``: at step ``i`` rank ``r`` computes the partial product of
  the rows of chunk ``r - 1 - i``, adds the partial sum received from ``r - 1`` and sends it to ``r + 1``; after
  ``t - 1`` steps it holds the complete sum of its own chunk. Each transfer is in flight during the next GEMM.
* backward mirrors them: the column layer's input gradient is a ring reduce-scatter of ``grad_y[c] @ W`` pieces
  (the weight-gradient GEMM runs while the first exchange is in flight), the row layer's a ring all-gather of
  ``grad_y`` whose chunks are multiplied by ``W`` as they arrive, with the weight gradient accumulated per chunk.

The math is that of the collectives (the same products; only the order of the sum over ranks differs, as between
collective algorithms). Exchanges use ``torch.distributed`` point-to-point operations over the TP group, which run
on every backend (gloo included) without symmetric memory or NVLink multicast. Chunk GEMMs run at ``1/t`` of the
layer's sequence length; where the layer's GEMMs are small, the launch cost of ``t`` pieces can outweigh the
communication hidden (measure: benchmarks/end_to_end/run_tp_bench.sh).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel.tensor_parallel.mappings import Group, all_gather_into, group_rank, group_size

__all__ = ["ring_column_parallel_linear", "ring_row_parallel_linear"]


class _Ring:
    """Ring neighbours of this rank in a TP group (global ranks, as point-to-point operations take them)."""

    def __init__(self, group: Group) -> None:
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: Tensor, recv: Tensor) -> List[dist.Work]:
        """Start sending ``send`` to the next rank and receiving into ``recv`` from the previous one."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops)


def _wait(works: List[dist.Work]) -> None:
    for w in works:
        w.wait()


def _mm(x: Tensor, w: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``x [n, b, k] @ w [k, m] -> [n, b, m]`` (written into ``out`` when given)."""
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        return torch.mm(x2, w).view(*x.shape[:-1], w.shape[-1])
    torch.mm(x2, w, out=out.view(-1, w.shape[-1]))
    return out


def _ring_all_gather_chunks(x: Tensor, ring: _Ring) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """All-gather ``x`` ``[n, ...]`` over the ring into ``total`` ``[n*t, ...]`` chunk by chunk: yields
    ``(src, chunk, total)`` for each rank's chunk as it is present (own first), while the next chunk is in flight;
    the caller computes on ``chunk`` before resuming the generator, which then waits for that exchange."""
    t, r, n = ring.size, ring.rank, x.shape[0]
    total = torch.empty((n * t,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    total[r * n:(r + 1) * n].copy_(x)
    for i in range(t):
        src = (r - i) % t
        chunk = total[src * n:(src + 1) * n]
        works: List[dist.Work] = []
        if i < t - 1:
            nxt = (r - i - 1) % t
            works = ring.exchange(chunk, total[nxt * n:(nxt + 1) * n])
        yield src, chunk, total
        _wait(works)


def _ring_reduce_scatter_mm(x: Tensor, w: Tensor, ring: _Ring, while_first=None) -> Tensor:
    """``reduce_scatter_dim0(x @ w)`` as a ring: ``x [s, b, k]``, ``w [k, m]`` -> ``[s/t, b, m]``.
    ``while_first()`` (optional) runs while the first exchange is in flight."""
    t, r = ring.size, ring.rank
    n = x.shape[0] // t
    acc: Optional[Tensor] = None
    works: List[dist.Work] = []
    recv: Optional[Tensor] = None
    for i in range(t):
        c = (r - 1 - i) % t
        part = _mm(x[c * n:(c + 1) * n], w)
        if recv is not None:
            _wait(works)
            part.add_(recv)
        acc = part
        if i < t - 1:
            recv = torch.empty_like(part)
            works = ring.exchange(part, recv)
            if i == 0 and while_first is not None:
                while_first()
    assert acc is not None
    return acc


class _RingColumnParallelFn(torch.autograd.Function):
    """``y = all_gather_sp(x) @ W^T + b`` with the gather as a ring under the chunk GEMMs (see the module)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, compute_dtype, recompute_gather):
        ring = _Ring(group)
        x_dtype, w_dtype = x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            if compute_dtype is not None:
                x, weight = x.to(compute_dtype), weight.to(compute_dtype)
                bias = bias.to(compute_dtype) if bias is not None else None
            x = x.contiguous()
            t, n = ring.size, x.shape[0]
            y = torch.empty((n * t,) + tuple(x.shape[1:-1]) + (weight.shape[0],), dtype=x.dtype, device=x.device)
            wt = weight.t()
            for src, chunk, total in _ring_all_gather_chunks(x, ring):
                _mm(chunk, wt, out=y[src * n:(src + 1) * n])
            if bias is not None:
                y.add_(bias)
        ctx.save_for_backward(x if recompute_gather else total, weight)
        ctx.group, ctx.regather, ctx.has_bias = group, recompute_gather, bias is not None
        ctx.x_dtype, ctx.w_dtype, ctx.b_dtype = x_dtype, w_dtype, bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, grad_out):
        saved, weight = ctx.saved_tensors
        ring = _Ring(ctx.group)
        grad_out = grad_out.to(weight.dtype).contiguous()
        gather = None
        total = saved
        if ctx.regather:
            total = torch.empty((saved.shape[0] * ring.size,) + tuple(saved.shape[1:]), dtype=saved.dtype,
                                device=saved.device)
            gather = all_gather_into(total, saved.contiguous(), group=ctx.group, async_op=True)
        grads: dict = {}

        def weight_grad() -> None:
            if gather is not None:
                gather.wait()
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            grads["w"] = g2.t().mm(total.reshape(-1, total.shape[-1])).to(ctx.w_dtype)
            grads["b"] = g2.sum(0).to(ctx.b_dtype) if ctx.has_bias else None

        grad_input = _ring_reduce_scatter_mm(grad_out, weight, ring, while_first=weight_grad)
        if "w" not in grads:   # a ring of one exchange less than expected (t == 1 never reaches here)
            weight_grad()
        return grad_input.to(ctx.x_dtype), grads["w"], grads["b"], None, None, None


class _RingRowParallelFn(torch.autograd.Function):
    """``y = reduce_scatter_sp(x @ W^T)`` with the reduce-scatter as a ring under the chunk GEMMs (no bias: the
    layer adds its replicated bias after the reduction)."""

    @staticmethod
    def forward(ctx, x, weight, group, compute_dtype):
        ring = _Ring(group)
        x_dtype, w_dtype = x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            if compute_dtype is not None:
                x, weight = x.to(compute_dtype), weight.to(compute_dtype)
            x = x.contiguous()
            y = _ring_reduce_scatter_mm(x, weight.t(), ring)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.x_dtype, ctx.w_dtype = group, x_dtype, w_dtype
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ring = _Ring(ctx.group)
        grad_out = grad_out.to(weight.dtype).contiguous()
        n = grad_out.shape[0]
        grad_input = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
        grad_weight = None
        for src, chunk, _ in _ring_all_gather_chunks(grad_out, ring):
            _mm(chunk, weight, out=grad_input[src * n:(src + 1) * n])
            g2 = chunk.reshape(-1, chunk.shape[-1])
            piece = g2.t().mm(x[src * n:(src + 1) * n].reshape(-1, x.shape[-1]))
            grad_weight = piece if grad_weight is None else grad_weight.add_(piece)
        return grad_input.to(ctx.x_dtype), grad_weight.to(ctx.w_dtype), None, None


def ring_column_parallel_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Group,
                                compute_dtype: Optional[torch.dtype] = None,
                                recompute_gather: bool = False) -> Tensor:
    """``x [s/t, b, in]`` (this rank's sequence chunk), ``weight [out/t, in]`` -> ``[s, b, out/t]``: the
    sequence-parallel all-gather and the GEMM as a ring over the TP ``group``; backward reduce-scatters the input
    gradient in a ring. ``compute_dtype``: the autocast dtype (inputs cast to it); ``recompute_gather``: keep only
    the local chunk for backward and all-gather it again there."""
    return _RingColumnParallelFn.apply(x, weight, bias, group, compute_dtype, recompute_gather)


def ring_row_parallel_linear(x: Tensor, weight: Tensor, group: Group,
                             compute_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``x [s, b, in/t]``, ``weight [out, in/t]`` -> ``[s/t, b, out]``: the GEMM and the sequence-parallel
    reduce-scatter as a ring over the TP ``group``; backward all-gathers the output gradient in a ring."""
    return _RingRowParallelFn.apply(x, weight, group, compute_dtype)
