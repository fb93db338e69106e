"""Cross-entropy over vocabulary-parallel logits, never gathering the full vocabulary."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_megatron.parallel.tensor_parallel.mappings import Group, group_rank, group_size


def _loss_dtype(logits: Tensor) -> torch.dtype:
    """Compute dtype of the loss: at least float32 (half types are promoted), float64 kept."""
    return torch.promote_types(logits.dtype, torch.float32)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: Group, vocab_size: Optional[int]):
        logits = logits.to(_loss_dtype(logits))
        per_rank = logits.shape[-1]
        start = per_rank * group_rank(group)
        distributed = group_size(group) > 1
        if vocab_size is not None and start + per_rank > vocab_size:
            # Padded vocabulary entries are masked out, so padding never changes the loss.
            padded = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padded, float("-inf"))
        logits_max = logits.max(dim=-1).values
        if distributed:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = target - start
        outside = (local_target < 0) | (local_target >= per_rank)
        local_target = local_target.masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if distributed:
            stacked = torch.stack([predicted, sum_exp])
            dist.all_reduce(stacked, group=group)
            predicted, sum_exp = stacked[0], stacked[1]
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, group: Group = None, vocab_size: Optional[int] = None
) -> Tensor:
    """Per-token cross-entropy of vocabulary-sharded logits.

    Args:
        logits: ``[..., V_pad/tp]``, this rank's contiguous slice of the (padded) vocabulary; any float
            dtype, computed in float32, or float64 for float64 logits (never narrower than the input).
        target: ``[...]`` global token ids.
        group: TP group the vocabulary is split over (three all-reduces of ``[...]``-sized tensors in
            forward, none in backward).
        vocab_size: true vocabulary size; logits of padded ids (``>= vocab_size``) are excluded.

    Returns:
        ``[...]`` per-token loss in the compute dtype (float32; float64 for float64 logits).
    """
    if group_size(group) == 1:
        # One rank holds the whole vocabulary: the fused kernel, padded columns sliced off.
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits = logits[..., :vocab_size]
        flat = logits.to(_loss_dtype(logits)).reshape(-1, logits.shape[-1])
        flat = F.cross_entropy(flat, target.reshape(-1), reduction="none")
        return flat.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
