"""``MoELayer``: router -> dispatcher -> local experts (-> + shared expert), ``[s, b, h] -> [s, b, h]``.

Weights come from one seeded generator in a fixed order (router ``[E, h]``, all experts' ``weight1 [E, h, 2f]``,
all experts' ``weight2 [E, f, h]``, shared expert ``fc1``/``fc2``); a rank of an EP group of size ``ep`` keeps
experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of those global tensors. So a layer built with the same
seed holds the same global model for every ``ep``, and ``ep_group=None`` is the single-process reference.

Gradient reduction is the caller's job: router and shared-expert grads over the dense DP(xCP) group, expert
grads over the expert-data-parallel group. Aux losses ride on autograd (see ``router.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.moe.config import MoEConfig, check_expert_parallel
from lightning_megatron.moe.dispatcher import build_dispatcher
from lightning_megatron.moe.experts import GroupedMLPExperts, SequentialMLPExperts
from lightning_megatron.moe.router import TopKRouter
from lightning_megatron.parallel.tensor_parallel.mappings import group_rank, group_size


class SharedExpertMLP(nn.Module):
    """Dense (SwiGLU) MLP applied to every token; ``fc1 [h, 2f]``, ``fc2 [f, h]``."""

    def __init__(self, fc1: Tensor, fc2: Tensor, swiglu: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2, self.swiglu = nn.Parameter(fc1), nn.Parameter(fc2), swiglu

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.fc1.to(x.dtype)
        if self.swiglu:
            g, u = torch.chunk(h, 2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.gelu(h)
        return h @ self.fc2.to(x.dtype)


class MoELayer(nn.Module):
    def __init__(self, hidden_size: int, config: MoEConfig, ep_group=None, seed: int = 0, init_std: float = 0.02,
                 output_init_std: Optional[float] = None, use_grouped_mm: Optional[bool] = None) -> None:
        super().__init__()
        self.config, self.hidden_size, self.ep_group = config, hidden_size, ep_group
        self.ep, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.num_local_experts = check_expert_parallel(config, self.ep)
        out_std = init_std if output_init_std is None else output_init_std
        E, f, swiglu = config.num_moe_experts, config.moe_ffn_hidden_size, config.gated_linear_unit
        gen = torch.Generator().manual_seed(seed)

        self.router = TopKRouter(hidden_size, config, init_std=init_std, generator=gen)
        fc1_out = 2 * f if swiglu else f
        w1 = torch.empty(E, hidden_size, fc1_out).normal_(0.0, init_std, generator=gen)
        w2 = torch.empty(E, f, hidden_size).normal_(0.0, out_std, generator=gen)
        lo, hi = self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts
        self.local_expert_indices = list(range(lo, hi))
        cls = GroupedMLPExperts if config.moe_grouped_gemm else SequentialMLPExperts
        kw = {"use_grouped_mm": use_grouped_mm} if config.moe_grouped_gemm else {}
        self.experts = cls(self.num_local_experts, hidden_size, f, swiglu=swiglu, weight1=w1[lo:hi],
                           weight2=w2[lo:hi], **kw)
        for p in self.experts.parameters():
            p.allreduce = False          # Megatron's marker: reduced over expert-DP, not dense DP
        self.shared_experts = None
        fs = config.moe_shared_expert_intermediate_size
        if fs:
            s1 = torch.empty(hidden_size, 2 * fs if swiglu else fs).normal_(0.0, init_std, generator=gen)
            s2 = torch.empty(fs, hidden_size).normal_(0.0, out_std, generator=gen)
            self.shared_experts = SharedExpertMLP(s1, s2, swiglu)
        self.dispatcher = build_dispatcher(config, ep_group)

    def forward(self, hidden: Tensor) -> Tensor:
        s, b, h = hidden.shape
        probs, indices = self.router(hidden)
        x = hidden.reshape(-1, h)
        tokens, tokens_per_expert = self.dispatcher.dispatch(x, probs, indices)
        out = self.dispatcher.combine(self.experts(tokens, tokens_per_expert))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(s, b, h)
