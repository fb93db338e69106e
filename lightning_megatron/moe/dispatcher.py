"""Token dispatchers (Megatron ``token_dispatcher.py``), expert-tensor-parallel size 1 only (no ETP).

Protocol: ``tokens, tokens_per_expert = d.dispatch(hidden [T, h], probs [T, k], indices [T, k])`` gives this
rank's local-expert inputs sorted by local expert; ``d.combine(expert_out)`` returns ``[T, h]`` =
``sum_k probs[t, k] * expert_{indices[t, k]}(hidden[t])`` for this rank's tokens. Slots with ``indices == -1``
(dropped by capacity) contribute nothing. ``ep_group=None`` (or size 1) is the single-process path.
All collectives are autograd-aware, so gradients flow back to hidden, probs (router) and expert weights.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.moe.config import MoEConfig, check_expert_parallel
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
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _flatten_routing(probs: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(token id, expert id, prob) of every kept (token, slot) pair."""
    T, k = indices.shape
    token = torch.arange(T, device=indices.device).repeat_interleave(k)
    expert, prob = indices.reshape(-1), probs.reshape(-1)
    keep = expert >= 0
    return token[keep], expert[keep], prob[keep]


class _DispatcherBase:
    def __init__(self, config: MoEConfig, ep_group=None) -> None:
        self.config = config
        self.ep_group = ep_group
        self.ep = group_size(ep_group)
        self.ep_rank = group_rank(ep_group)
        self.num_experts = config.num_moe_experts
        self.num_local_experts = check_expert_parallel(config, self.ep)
        self.local_expert_start = self.ep_rank * self.num_local_experts


class AllToAllDispatcher(_DispatcherBase):
    """Permute by expert -> A2A(EP) of counts then tokens -> sort by local expert -> experts -> reverse."""

    def dispatch(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor]:
        E, El, ep = self.num_experts, self.num_local_experts, self.ep
        self.num_tokens = hidden.shape[0]
        token, expert, prob = _flatten_routing(probs, indices)
        order = torch.argsort(expert, stable=True)
        self.token_of_row, self.prob_of_row = token[order], prob[order]
        permuted = hidden.index_select(0, self.token_of_row)                       # [n, h], grouped by expert
        counts = torch.bincount(expert, minlength=E)                               # [E]
        if ep == 1:
            self.sort_idx = None
            return permuted, counts
        # tokens from every rank for each of my local experts: recv[r, j]
        recv = _a2a(counts, [El] * ep, [El] * ep, self.ep_group).view(ep, El)
        self.input_splits = counts.view(ep, El).sum(1).tolist()
        self.output_splits = recv.sum(1).tolist()
        received = all_to_all(permuted, self.output_splits, self.input_splits, self.ep_group)
        # received is [rank 0: e0.., e1.., rank 1: e0.., ...]; regroup by local expert (sort_chunks_by_idxs)
        local_id = torch.arange(El, device=hidden.device).repeat(ep).repeat_interleave(recv.reshape(-1))
        self.sort_idx = torch.argsort(local_id, stable=True)
        return received.index_select(0, self.sort_idx), recv.sum(0)

    def combine(self, expert_out: Tensor) -> Tensor:
        if self.sort_idx is not None:
            expert_out = all_to_all(_unsort(expert_out, self.sort_idx), self.input_splits, self.output_splits, self.ep_group)
        weighted = expert_out * self.prob_of_row.unsqueeze(-1).to(expert_out.dtype)
        out = expert_out.new_zeros((self.num_tokens, expert_out.shape[-1]))
        return out.index_add(0, self.token_of_row, weighted)


def _unsort(x: Tensor, sort_idx: Tensor) -> Tensor:
    """Inverse of ``x_sorted = y[sort_idx]``: returns y (differentiable gather)."""
    return x.index_select(0, torch.argsort(sort_idx))


class AllGatherDispatcher(_DispatcherBase):
    """All-gather tokens + routing over EP, run local experts on the tokens routed to them, reduce-scatter back.

    Every rank of the EP group must pass the same number of tokens.
    """

    def dispatch(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor]:
        self.num_tokens = hidden.shape[0]
        if self.ep > 1:
            n = torch.tensor([self.num_tokens], device=hidden.device)
            sizes = all_gather_dim0(n, self.ep_group)
            if not bool((sizes == sizes[0]).all()):
                raise ValueError(f"AllGatherDispatcher needs the same token count on every EP rank, got {sizes.tolist()}")
        hidden_all = gather_from_sequence_parallel_region(hidden, self.ep_group)    # [ep*T, h]
        probs_all = gather_from_sequence_parallel_region(probs, self.ep_group)      # [ep*T, k]
        indices_all = all_gather_dim0(indices, self.ep_group)
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
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_group)       # partial sums -> [T, h]


def build_dispatcher(config: MoEConfig, ep_group=None):
    if config.moe_token_dispatcher_type == "alltoall":
        return AllToAllDispatcher(config, ep_group)
    return AllGatherDispatcher(config, ep_group)
