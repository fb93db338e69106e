"""Token dispatchers (Megatron ``token_dispatcher.py``): all-to-all and all-gather, with expert tensor parallelism.

Protocol: ``tokens, tokens_per_expert = d.dispatch(hidden [T, h], probs [T, k], indices [T, k])`` gives the
inputs of this rank's local experts, sorted by local expert; ``d.combine(expert_out)`` returns ``[T, h]`` =
``sum_k probs[t, k] * expert_{indices[t, k]}(hidden[t])`` for this rank's ``T`` tokens. Slots with
``indices == -1`` (dropped by the capacity limit) contribute nothing. All collectives are autograd-aware, so
gradients reach hidden, probs (the router) and the expert weights.

Process groups (``None`` or size 1 = not split; all ``None`` is the single-process path):

* ``ep_group``: expert-parallel group; its rank ``r`` holds experts ``[r * E/ep, (r+1) * E/ep)``.
* ``etp_group``: expert-tensor-parallel group; its ranks hold slices of the same experts' ffn dimension, so
  every one of them must see the same tokens and their partial outputs are summed.
* ``ep_etp_group``: the ``ep x etp`` block (all-gather dispatcher only); defaults to ``ep_group`` when etp = 1.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.moe.config import MoEConfig, check_expert_parallel
from lightning_megatron.parallel.dry_run import is_fake_group
from lightning_megatron.parallel.tensor_parallel.mappings import (
    all_gather_dim0,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_scatter_to_sequence_parallel_region,
)


def _a2a(x: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of dim 0; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _a2a(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return _a2a(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
    """Uneven ``all_to_all_single`` of ``x [sum(input_splits), ...]`` over ``group`` (differentiable)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _gather_uneven(x: Tensor, sizes: List[int], group) -> Tensor:
    n = group_size(group)
    return _a2a(torch.cat([x] * n, dim=0), sizes, [x.shape[0]] * n, group)


def _reduce_scatter_uneven(x: Tensor, sizes: List[int], group) -> Tensor:
    n, mine = group_size(group), sizes[group_rank(group)]
    out = _a2a(x, [mine] * n, sizes, group)
    return out.view((n, mine) + tuple(x.shape[1:])).sum(0)


class _GatherUneven(torch.autograd.Function):
    """``[n_r, ...]`` on rank r -> ``[sum_r n_r, ...]`` in rank order; backward: uneven reduce-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _gather_uneven(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter_uneven(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterUneven(torch.autograd.Function):
    """Sum ``[sum_r n_r, ...]`` over the group and keep rank r's ``n_r`` rows; backward: uneven all-gather."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_uneven(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather_uneven(grad, ctx.sizes, ctx.group), None, None


def _flatten_routing(probs: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(token id, expert id, prob) of every kept (token, slot) pair."""
    T, k = indices.shape
    token = torch.arange(T, device=indices.device).repeat_interleave(k)
    expert, prob = indices.reshape(-1), probs.reshape(-1)
    keep = expert >= 0
    return token[keep], expert[keep], prob[keep]


class _DispatcherBase:
    def __init__(self, config: MoEConfig, ep_group=None, etp_group=None, ep_etp_group=None) -> None:
        self.config = config
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        self.ep_etp_group = ep_etp_group if ep_etp_group is not None else (ep_group if self.etp == 1 else None)
        if self.etp > 1 and group_size(self.ep_etp_group) != self.ep * self.etp:
            raise ValueError(f"ep_etp_group must hold ep*etp = {self.ep}*{self.etp} ranks, "
                             f"got {group_size(self.ep_etp_group)}")
        self.ep_rank = group_rank(ep_group)
        self.num_experts = config.num_moe_experts
        self.num_local_experts = check_expert_parallel(config, self.ep)
        self.local_expert_start = self.ep_rank * self.num_local_experts


class AllToAllDispatcher(_DispatcherBase):
    """Permute by expert -> all-to-all over EP (counts, then tokens) -> all-gather over ETP -> sort by local
    expert -> experts -> the reverse (reduce-scatter over ETP, all-to-all back, un-permute, weight by probs)."""

    def dispatch(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor]:
        E, El, ep, etp = self.num_experts, self.num_local_experts, self.ep, self.etp
        self.num_tokens = hidden.shape[0]
        token, expert, prob = _flatten_routing(probs, indices)
        order = torch.argsort(expert, stable=True)
        self.token_of_row, self.prob_of_row = token[order], prob[order]
        permuted = hidden.index_select(0, self.token_of_row)                       # [n, h], grouped by expert
        counts = torch.bincount(expert, minlength=E)                               # [E]
        self.sort_idx = None
        if ep == 1 and etp == 1:
            return permuted, counts
        # recv[r, j]: tokens from EP rank r for my local expert j
        recv = _a2a(counts, [El] * ep, [El] * ep, self.ep_group).view(ep, El) if ep > 1 else counts.view(1, El)
        dry_run = is_fake_group(self.ep_group if ep > 1 else self.etp_group)
        if dry_run:   # fake collectives receive nothing: every peer sends each of my experts its balanced share
            share = max(1, int(counts.sum()) // E)   # of the tokens x top-k it routes (the planner's assumption)
            recv = torch.full((ep, El), share, dtype=counts.dtype, device=counts.device)
        self.input_splits = counts.view(ep, El).sum(1).tolist()
        self.output_splits = recv.sum(1).tolist()
        received = all_to_all(permuted, self.output_splits, self.input_splits, self.ep_group)
        if etp > 1:  # every ETP rank of my experts computes on the tokens all of them received
            recv = (recv.repeat(etp, 1) if dry_run
                    else all_gather_dim0(recv.unsqueeze(0), self.etp_group).view(etp * ep, El))
            self.etp_sizes = recv.view(etp, ep * El).sum(1).tolist()
            received = _GatherUneven.apply(received, self.etp_sizes, self.etp_group)
        # rows are [source block: e0.., e1.., next block: e0.., ...]; regroup by local expert
        local_id = torch.arange(El, device=hidden.device).repeat(recv.shape[0]).repeat_interleave(recv.reshape(-1))
        self.sort_idx = torch.argsort(local_id, stable=True)
        return received.index_select(0, self.sort_idx), recv.sum(0)

    def combine(self, expert_out: Tensor) -> Tensor:
        if self.sort_idx is not None:
            expert_out = _unsort(expert_out, self.sort_idx)
            if self.etp > 1:
                expert_out = _ReduceScatterUneven.apply(expert_out, self.etp_sizes, self.etp_group)
            expert_out = all_to_all(expert_out, self.input_splits, self.output_splits, self.ep_group)
        weighted = expert_out * self.prob_of_row.unsqueeze(-1).to(expert_out.dtype)
        out = expert_out.new_zeros((self.num_tokens, expert_out.shape[-1]))
        return out.index_add(0, self.token_of_row, weighted)


def _unsort(x: Tensor, sort_idx: Tensor) -> Tensor:
    """Inverse of ``x_sorted = y[sort_idx]``: returns y (differentiable gather)."""
    return x.index_select(0, torch.argsort(sort_idx))


class AllGatherDispatcher(_DispatcherBase):
    """All-gather tokens + routing over the EP x ETP block, run the local experts (this rank's ffn slice) on
    the tokens routed to them, reduce-scatter the partial outputs back over the same block.

    Every rank of the block must pass the same number of tokens.
    """

    def dispatch(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor]:
        self.num_tokens = hidden.shape[0]
        group = self.ep_etp_group
        if group_size(group) > 1 and not is_fake_group(group):   # a dry run's fake all-gather fills nothing
            n = torch.tensor([self.num_tokens], device=hidden.device)
            sizes = all_gather_dim0(n, group)
            if not bool((sizes == sizes[0]).all()):
                raise ValueError(f"AllGatherDispatcher needs the same token count on every EP rank, got {sizes.tolist()}")
        hidden_all = gather_from_sequence_parallel_region(hidden, group)    # [ep*etp*T, h]
        probs_all = gather_from_sequence_parallel_region(probs, group)      # [ep*etp*T, k]
        indices_all = all_gather_dim0(indices, group)
        self.total_tokens = hidden_all.shape[0]
        lo, El = self.local_expert_start, self.num_local_experts
        local = indices_all - lo
        local = torch.where((indices_all >= lo) & (local < El), local, torch.full_like(local, -1))
        token, expert, prob = _flatten_routing(probs_all, local)
        order = torch.argsort(expert, stable=True)
        self.token_of_row, self.prob_of_row = token[order], prob[order]
        return hidden_all.index_select(0, self.token_of_row), torch.bincount(expert, minlength=El)

    def combine(self, expert_out: Tensor) -> Tensor:
        weighted = expert_out * self.prob_of_row.unsqueeze(-1).to(expert_out.dtype)
        out = expert_out.new_zeros((self.total_tokens, expert_out.shape[-1])).index_add(0, self.token_of_row, weighted)
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_etp_group)   # partial sums -> [T, h]


def build_dispatcher(config: MoEConfig, ep_group=None, etp_group=None, ep_etp_group=None):
    """The dispatcher named by ``config.moe_token_dispatcher_type`` over the given groups."""
    if config.moe_token_dispatcher_type == "alltoall":
        return AllToAllDispatcher(config, ep_group, etp_group, ep_etp_group)
    return AllGatherDispatcher(config, ep_group, etp_group, ep_etp_group)
