"""All-gather context-parallel attention: gather K/V in global order, local queries attend at their positions."""
from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_megatron.parallel.context_parallel.kernels import _attention_output
from lightning_megatron.parallel.context_parallel.layout import zigzag_gather, zigzag_split


class _AllGatherSeq(torch.autograd.Function):
    """All-gather zigzag shards along dim 2 into global order; backward sums over ranks and re-splits."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return zigzag_gather(x, group, dim=2)

    @staticmethod
    def backward(ctx, g):
        # gloo has no reduce-scatter: all-reduce then keep this rank's zigzag chunks (exact, more traffic)
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return zigzag_split(g, dist.get_world_size(ctx.group), dist.get_rank(ctx.group), 2), None


def _all_gather_attention(q, k, v, group, causal: bool, scale: float, document_ids=None) -> torch.Tensor:
    """``document_ids``: ``[b, S]`` in global order (packed sequences): each chunk's queries also see only the keys
    of their own document."""
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    kg = _AllGatherSeq.apply(k, group)
    vg = _AllGatherSeq.apply(v, group)
    c = q.shape[2] // 2
    if not causal:
        local = None if document_ids is None else zigzag_split(document_ids, cp, rank, 1)
        mask = None if local is None else local.unsqueeze(-1) == document_ids.unsqueeze(-2)
        return _attention_output(q, kg, vg, "full", scale, mask)
    outs = []
    for i, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c  # queries of global chunk `chunk` see keys [0, end), causal at the end
        mask = None
        if document_ids is not None:
            mask = document_ids[:, chunk * c:end].unsqueeze(-1) == document_ids[:, :end].unsqueeze(-2)
        outs.append(_attention_output(q[:, :, i * c:(i + 1) * c], kg[:, :, :end], vg[:, :, :end], "causal", scale,
                                      mask))
    return torch.cat(outs, dim=2).to(q.dtype)
