"""``MoELayer``: router -> dispatcher -> local experts (-> + shared expert), ``[s, b, h] -> [s, b, h]``.

Built standalone, the weights come from one seeded generator in a fixed order (router ``[E, h]``, all experts'
``weight1 [E, h, 2f]``, all experts' ``weight2 [E, f, h]``, shared expert ``linear_fc1``/``linear_fc2``); a rank
of an EP group of size ``ep`` keeps experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of those global tensors.
So a layer built with the same seed holds the same global model for every ``ep``, and ``ep_group=None`` is the
single-process reference. Inside :class:`lightning_megatron.GPTModel` the model initialises it instead (one
seeded generator per parameter name, full tensors drawn then sliced) and the strategy shards it with
:meth:`MoELayer.set_expert_parallel`.

Gradient reduction is the caller's job: router and shared-expert grads over the dense DP(xCP) group (and TP
under sequence parallelism), expert grads over the expert-data-parallel group. Expert parameters carry
``allreduce = False`` (Megatron's marker). Aux losses ride on autograd (see ``router.py``).
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
    """Dense (SwiGLU) MLP applied to every token: ``linear_fc1`` ``h -> 2f`` (``[gate; up]``), ``linear_fc2``
    ``f -> h``. Plain ``nn.Linear`` layers, so the model's TP plan can split them like the dense MLP."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, swiglu: bool = True) -> None:
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size if swiglu else ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            g, u = torch.chunk(h, 2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)


def _mark_expert_params(module: nn.Module) -> None:
    for p in module.parameters():
        p.allreduce = False          # Megatron's marker: reduced over expert-DP, not dense DP


class MoELayer(nn.Module):
    """Mixture-of-experts MLP: ``forward(hidden [s, b, h]) -> [s, b, h]`` (``s`` is this rank's part of the
    sequence under SP/CP).

    Args:
        hidden_size, config: the shape (``MoEConfig``).
        ep_group, etp_group, ep_etp_group: expert-parallel groups (see ``dispatcher.py``); None = one process.
        seed, init_std, output_init_std: standalone initialisation (skipped on the meta device).
        use_grouped_mm: passed to :class:`GroupedMLPExperts` when ``config.moe_grouped_gemm``; with
            ``moe_grouped_gemm=False`` the experts loop (``use_grouped_mm=False``), same weights.
        sequential_experts: use :class:`SequentialMLPExperts` (a reference; no expert tensor parallelism).
    """

    def __init__(self, hidden_size: int, config: MoEConfig, ep_group=None, seed: int = 0, init_std: float = 0.02,
                 output_init_std: Optional[float] = None, use_grouped_mm: Optional[bool] = None,
                 etp_group=None, ep_etp_group=None, sequential_experts: bool = False) -> None:
        super().__init__()
        self.config, self.hidden_size = config, hidden_size
        self.use_grouped_mm = use_grouped_mm if config.moe_grouped_gemm else False
        self.sequential_experts = sequential_experts
        out_std = init_std if output_init_std is None else output_init_std
        E, f, swiglu = config.num_moe_experts, config.moe_ffn_hidden_size, config.gated_linear_unit
        meta = torch.empty(0).is_meta
        gen = None if meta else torch.Generator().manual_seed(seed)

        self.router = TopKRouter(hidden_size, config, init_std=init_std, generator=gen)
        w1 = w2 = None
        if not meta:
            w1 = torch.empty(E, hidden_size, 2 * f if swiglu else f).normal_(0.0, init_std, generator=gen)
            w2 = torch.empty(E, f, hidden_size).normal_(0.0, out_std, generator=gen)
        self.shared_experts = None
        fs = config.moe_shared_expert_intermediate_size
        if fs:
            self.shared_experts = SharedExpertMLP(hidden_size, fs, swiglu)
            if not meta:
                with torch.no_grad():
                    s1 = torch.empty(hidden_size, 2 * fs if swiglu else fs).normal_(0.0, init_std, generator=gen)
                    s2 = torch.empty(fs, hidden_size).normal_(0.0, out_std, generator=gen)
                    self.shared_experts.linear_fc1.weight.copy_(s1.t())
                    self.shared_experts.linear_fc2.weight.copy_(s2.t())
        self.set_expert_parallel(ep_group, etp_group, ep_etp_group, _full_weights=(w1, w2))

    def set_expert_parallel(self, ep_group=None, etp_group=None, ep_etp_group=None, _full_weights=(None, None)) -> None:
        """(Re)build the local experts and the dispatcher for these groups: this rank keeps experts
        ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` and, under ``etp > 1``, its slice of their ffn dimension.
        On the meta device (the strategy's case) this only changes shapes; weights are initialised later by
        the model (``GPTModel.init_weights``) from the full tensors, so the result does not depend on the layout.

        Raises:
            ValueError: ``num_moe_experts`` not divisible by ep, or ``moe_ffn_hidden_size`` not by etp.
        """
        config = self.config
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.num_local_experts = check_expert_parallel(config, self.ep)
        lo, hi = self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts
        self.local_expert_indices = list(range(lo, hi))
        f, swiglu, h = config.moe_ffn_hidden_size, config.gated_linear_unit, self.hidden_size
        device = self.router.weight.device
        if self.sequential_experts:
            if group_size(etp_group) > 1:
                raise ValueError("sequential_experts=True does not support expert tensor parallelism (etp > 1)")
            w1, w2 = _full_weights
            self.experts = SequentialMLPExperts(self.num_local_experts, h, f, swiglu=swiglu,
                                                weight1=None if w1 is None else w1[lo:hi],
                                                weight2=None if w2 is None else w2[lo:hi])
        else:
            with torch.device(device):
                self.experts = GroupedMLPExperts(self.num_local_experts, h, f, swiglu=swiglu,
                                                 use_grouped_mm=self.use_grouped_mm, ep_group=ep_group,
                                                 etp_group=etp_group)
            w1, w2 = _full_weights
            if w1 is not None:
                with torch.no_grad():
                    self.experts.weight1.copy_(self.experts.shard_global("weight1", w1))
                    self.experts.weight2.copy_(self.experts.shard_global("weight2", w2))
        _mark_expert_params(self.experts)
        self.dispatcher = build_dispatcher(config, ep_group, etp_group, ep_etp_group)

    def forward(self, hidden: Tensor) -> Tensor:
        if hidden.is_meta:  # shape inference (e.g. a pipeline stage's): routing needs real values
            return torch.empty_like(hidden)
        s, b, h = hidden.shape
        probs, indices = self.router(hidden)
        x = hidden.reshape(-1, h)
        tokens, tokens_per_expert = self.dispatcher.dispatch(x, probs, indices)
        out = self.dispatcher.combine(self.experts(tokens, tokens_per_expert))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden).reshape(-1, h)
        return out.reshape(s, b, h)
