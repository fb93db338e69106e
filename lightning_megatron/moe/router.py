"""Top-k router (Megatron ``router.py::TopKRouter`` / ``moe_utils.py``), written from the formulas.

Auxiliary losses travel on an autograd side channel, as in Megatron's ``MoEAuxLossAutoScaler``:
``attach_aux_loss(output, aux_loss)`` returns ``output`` unchanged, and its backward hands
``aux_loss`` a gradient of ``ones * scale`` (``scale`` set with ``set_aux_loss_scale``; Megatron sets it
to ``loss_scale * cp / num_microbatches`` so that the aux loss is scaled like the main loss). So the caller
never adds the aux loss to its loss: ``loss.backward()`` already back-propagates it through the router.
Detached values are kept in ``router.aux_losses`` (dict name -> scalar) for logging.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.moe.config import MoEConfig


class _AuxLossAutoScaler(torch.autograd.Function):
    scale: Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor) -> Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = _AuxLossAutoScaler.scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale


def attach_aux_loss(output: Tensor, aux_loss: Tensor) -> Tensor:
    """Identity on ``output``; in backward, ``aux_loss`` receives gradient ``scale`` (default 1)."""
    return _AuxLossAutoScaler.apply(output, aux_loss)


def set_aux_loss_scale(scale) -> None:
    """Gradient that every attached aux loss gets in backward (e.g. ``1 / num_microbatches``)."""
    _AuxLossAutoScaler.scale = torch.as_tensor(float(scale) if not torch.is_tensor(scale) else scale.detach())


def get_aux_loss_scale() -> Tensor:
    return _AuxLossAutoScaler.scale


# --------------------------------------------------------------------------------------------- formulas
def _acc(t: Tensor) -> torch.dtype:
    """Scoring dtype: at least fp32 (Megatron scores in fp32, then casts back to the logits dtype)."""
    return torch.promote_types(t.dtype, torch.float32)


def switch_load_balancing_loss(scores: Tensor, tokens_per_expert: Tensor, num_tokens: int, topk: int,
                               coeff: float) -> Tensor:
    """``E * coeff / (k * T^2) * sum_e (sum_t p_te) * n_e`` (= ``E * coeff * sum_e f_e * P_e``, ``f_e = n_e / (T k)``,
    ``P_e = mean_t p_te``). ``scores`` [..., E'] with ``tokens_per_expert`` broadcasting against ``scores.sum(0)``."""
    num_experts = scores.shape[-1]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * num_tokens * num_tokens))


def z_loss(logits: Tensor, coeff: float) -> Tensor:
    """``coeff * mean_t(logsumexp(logits_t)^2)`` (ST-MoE router z-loss)."""
    return torch.mean(torch.square(torch.logsumexp(logits.to(_acc(logits)), dim=-1))) * coeff


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """``ceil(T * k / E * cf)``, at least 1 and at most ``T``."""
    return max(1, min(num_tokens, math.ceil(num_tokens * topk / num_experts * capacity_factor)))


def apply_token_dropping(routing_probs: Tensor, routing_map: Tensor, capacity: int,
                         drop_policy: str) -> Tuple[Tensor, Tensor]:
    """Keep at most ``capacity`` tokens per expert. ``routing_probs``/``routing_map``: [T, E].

    ``probs``: keep each expert's highest-probability tokens. ``position``: keep each expert's earliest tokens.
    """
    if drop_policy == "probs":
        _, idx = torch.topk(routing_probs.detach().masked_fill(~routing_map, -1.0), k=capacity, dim=0)
        keep = torch.zeros_like(routing_map).scatter(0, idx, True)
    elif drop_policy == "position":
        keep = torch.cumsum(routing_map.int(), dim=0) <= capacity
    else:
        raise ValueError(f"unknown moe_token_drop_policy {drop_policy!r}")
    final_map = routing_map & keep
    return routing_probs * final_map, final_map


# ----------------------------------------------------------------------------------------------- router
class TopKRouter(nn.Module):
    """``logits = x @ W^T`` (``W``: [E, h]) -> scores -> top-k ``(probs [T, k], indices [T, k])``.

    ``indices`` are global expert ids; a slot dropped by the capacity limit has index ``-1`` and prob 0.
    """

    def __init__(self, hidden_size: int, config: MoEConfig, init_std: float = 0.02,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        weight = torch.empty(self.num_experts, hidden_size)
        weight.normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(weight)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.aux_losses: Dict[str, Tensor] = {}

    # -- scoring --------------------------------------------------------------------------------------
    def topk_routing(self, logits: Tensor) -> Tuple[Tensor, Tensor]:
        """Megatron ``topk_routing_with_score_function``: returns (probs [T, k], indices [T, k])."""
        cfg, k = self.config, self.topk
        if cfg.moe_router_score_function == "softmax":
            if cfg.moe_router_pre_softmax:
                scores = torch.softmax(logits, dim=-1, dtype=_acc(logits)).type_as(logits)
                probs, indices = torch.topk(scores, k, dim=-1)
            else:
                top_logits, indices = torch.topk(logits, k, dim=-1)
                probs = torch.softmax(top_logits, dim=-1, dtype=_acc(logits)).type_as(logits)
        else:  # sigmoid
            scores = torch.sigmoid(logits.to(_acc(logits))).type_as(logits)
            if self.expert_bias is not None:
                _, indices = torch.topk(scores + self.expert_bias.to(scores.dtype), k, dim=-1)
                probs = torch.gather(scores, 1, indices)
            else:
                probs, indices = torch.topk(scores, k, dim=-1)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        return probs, indices

    def scores_for_aux_loss(self, logits: Tensor) -> Tuple[Tensor, Tensor]:
        """Unbiased scores over all experts [T, E] and the top-k routing map [T, E] they select."""
        if self.config.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=_acc(logits))
        else:
            scores = torch.sigmoid(logits.to(_acc(logits)))
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        _, top = torch.topk(scores, self.topk, dim=-1)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        return scores, routing_map

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, hidden: Tensor) -> Tuple[Tensor, Tensor]:
        """``hidden`` [s, b, h] (or [T, h] = one sequence) -> (probs [s*b, k], indices [s*b, k])."""
        if hidden.dim() == 2:
            hidden = hidden.unsqueeze(1)
        seq_len, bsz, _ = hidden.shape
        x = hidden.reshape(-1, self.hidden_size)
        logits = F.linear(x, self.weight.to(x.dtype))
        cfg = self.config
        self.aux_losses = {}
        train = self.training and torch.is_grad_enabled()

        if cfg.moe_z_loss_coeff and train:
            zl = z_loss(logits, cfg.moe_z_loss_coeff)
            logits = attach_aux_loss(logits, zl)
            self.aux_losses["z_loss"] = zl.detach()

        probs, indices = self.topk_routing(logits)
        num_tokens = logits.shape[0]

        if cfg.moe_expert_capacity_factor is not None:
            dense_probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(1, indices, probs)
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
            cap = expert_capacity(num_tokens, self.num_experts, self.topk, cfg.moe_expert_capacity_factor)
            dense_probs, routing_map = apply_token_dropping(dense_probs, routing_map, cap, cfg.moe_token_drop_policy)
            kept = torch.gather(routing_map, 1, indices)
            probs = torch.gather(dense_probs, 1, indices)
            indices = torch.where(kept, indices, torch.full_like(indices, -1))

        if self.local_tokens_per_expert is not None and torch.is_grad_enabled():
            valid = indices[indices >= 0]
            self.local_tokens_per_expert += torch.bincount(valid, minlength=self.num_experts).float()

        lb = cfg.moe_router_load_balancing_type
        if train and lb != "none" and cfg.moe_aux_loss_coeff > 0:
            scores, aux_map = self.scores_for_aux_loss(logits)
            if lb == "aux_loss":
                aux = switch_load_balancing_loss(scores, aux_map.sum(0).float(), num_tokens, self.topk,
                                                 cfg.moe_aux_loss_coeff)
            else:  # seq_aux_loss: the switch loss of each sequence, averaged over the batch
                E = self.num_experts
                s_scores = scores.reshape(seq_len, bsz * E)
                s_counts = aux_map.reshape(seq_len, bsz * E).sum(0).float()
                aux = (s_scores.sum(0) * s_counts).sum() * (E * cfg.moe_aux_loss_coeff
                                                            / (self.topk * seq_len * seq_len)) / bsz
            probs = attach_aux_loss(probs, aux)
            self.aux_losses[lb] = aux.detach()
        return probs, indices

    # -- aux-loss-free balancing ------------------------------------------------------------------------
    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_global: Optional[Tensor] = None) -> None:
        """``bias += rate * sign(mean_e(n) - n_e)``. ``tokens_per_expert_global`` defaults to the counts this
        router accumulated since the last update (all-reduce them over TP x DP x CP first, as Megatron's
        ``finalize_model_grads`` does); the accumulated counts are reset."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs moe_router_enable_expert_bias=True")
        n = self.local_tokens_per_expert if tokens_per_expert_global is None else tokens_per_expert_global
        n = n.to(self.expert_bias.device, torch.float32)
        self.expert_bias += torch.sign(n.mean() - n) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()
