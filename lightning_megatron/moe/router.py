"""Top-k router (Megatron ``router.py::TopKRouter`` / ``moe_utils.py``), written from the formulas.

Auxiliary losses travel on an autograd side channel, as in Megatron's ``MoEAuxLossAutoScaler``:
``attach_aux_loss(output, aux_loss)`` returns ``output`` unchanged, and its backward hands
``aux_loss`` a gradient of ``ones * scale`` (``scale`` set with ``set_aux_loss_scale``; Megatron sets it
to ``loss_scale * cp / num_microbatches`` so that the aux loss is scaled like the main loss). So the caller
never adds the aux loss to its loss: ``loss.backward()`` already back-propagates it through the router.
Detached values are kept in ``router.aux_losses`` (dict name -> scalar) for logging, and one record per training
forward is kept until :meth:`TopKRouter.pop_aux_loss_sums` sums (the last ``n`` of) them: a pipeline schedule may
run extra forwards before the real micro-batches (torch's metadata inference), which the caller then skips.

Layout independence (:meth:`TopKRouter.set_token_groups`): when the tokens of one micro-batch are spread over
ranks (data parallel: whole sequences; context and sequence parallel: parts of each sequence), every rank
routes its own tokens but the statistics of the losses are global: the token counts per expert are summed
over the groups holding the rest of the micro-batch (``aux_loss``) or the rest of each sequence
(``seq_aux_loss``), and the normalisations use the global token / sequence counts. Each rank's loss is then
its tokens' share of the single-process loss of the whole micro-batch, so the shares add up to it exactly.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.contract import TokenRouter
from lightning_megatron.moe.config import MoEConfig
from lightning_megatron.parallel.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, group_size


class _AuxLossAutoScaler(torch.autograd.Function):
    scale: Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, scale: Optional[float]) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (aux_loss,) = ctx.saved_tensors
        if ctx.scale is not None:
            return grad_output, torch.full_like(aux_loss, float(ctx.scale)), None
        scale = _AuxLossAutoScaler.scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale, None


def attach_aux_loss(output: Tensor, aux_loss: Tensor, scale: Optional[float] = None) -> Tensor:
    """Identity on ``output``; in backward, ``aux_loss`` receives gradient ``scale`` (``None``: the process-wide
    value of :func:`set_aux_loss_scale`, default 1)."""
    return _AuxLossAutoScaler.apply(output, aux_loss, scale)


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
def _all_reduce_(t: Tensor, groups: Sequence) -> Tensor:
    for g in groups:
        dist.all_reduce(t, group=g)
    return t


def _product(groups: Sequence) -> int:
    n = 1
    for g in groups:
        n *= group_size(g)
    return n


class TopKRouter(TokenRouter):
    """``logits = x @ W^T`` (``W``: [E, h]) -> scores -> top-k ``(probs [T, k], indices [T, k])``.

    ``indices`` are global expert ids; a slot dropped by the capacity limit has index ``-1`` and prob 0.

    Attributes set by the model / strategy:
        sequence_parallel_group: under sequence parallelism the weight is replicated over this TP group while
            each rank routes its own part of the sequence; its gradient is summed over the group (in backward,
            or deferred by the strategy like the norms').
        aux_loss_scale: gradient the aux / z losses get in backward (``None``: :func:`set_aux_loss_scale`'s).
        recomputing: True while activation recompute runs this forward again in backward: the routing is
            computed again but nothing is recorded (token counts, aux-loss records, ``aux_losses``).
        sequence_groups / batch_groups: see :meth:`set_token_groups` (all-reduces of ``[E]`` or ``[b*E]``
            counts in forward while training).
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
        self._aux_history: List[Dict[str, Tensor]] = []     # one dict per training forward
        self._count_history: List[Tensor] = []              # expert-bias token counts, one per training forward
        self.aux_loss_scale: Optional[float] = None
        self.recomputing = False
        self.sequence_parallel_group = None
        self.sequence_groups: List = []
        self.batch_groups: List = []

    def set_token_groups(self, sequence_groups: Sequence = (), batch_groups: Sequence = ()) -> None:
        """Groups over which one micro-batch's tokens are spread: ``sequence_groups`` hold other parts of the
        same sequences (context parallel, tensor parallel under SP), ``batch_groups`` other sequences (data
        parallel). Groups of size 1 (or None) are dropped."""
        self.sequence_groups = [g for g in sequence_groups if group_size(g) > 1]
        self.batch_groups = [g for g in batch_groups if group_size(g) > 1]

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the expert bias and the token counts (after materialising a meta-device model)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.local_tokens_per_expert.zero_()

    def pop_aux_loss_sums(self, last: Optional[int] = None) -> Dict[str, Tensor]:
        """This rank's share of each aux loss summed over the training forwards since the last call (only the
        ``last`` most recent ones if given); resets."""
        history, self._aux_history = self._aux_history, []
        sums: Dict[str, Tensor] = {}
        for record in history[-last:] if last else history:
            for name, value in record.items():
                sums[name] = sums[name] + value if name in sums else value
        return sums

    def tokens_per_expert_since_update(self, last: Optional[int] = None) -> Tensor:
        """Kept tokens per expert ``[E]`` routed by this rank since the last bias update (the ``last`` most recent
        training forwards if given); needs ``moe_router_enable_expert_bias``."""
        if self.local_tokens_per_expert is None:
            raise RuntimeError("token counts are kept only with moe_router_enable_expert_bias=True")
        if not last:
            return self.local_tokens_per_expert.clone()
        recent = self._count_history[-last:]
        return torch.stack(recent).sum(0) if recent else torch.zeros_like(self.local_tokens_per_expert)

    def _record(self, name: str, value: Tensor) -> None:
        self.aux_losses[name] = value.detach()

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
        weight = self.weight
        if self.sequence_parallel_group is not None:
            weight = copy_to_tensor_model_parallel_region(weight, self.sequence_parallel_group)
        logits = F.linear(x, weight.to(x.dtype))
        cfg = self.config
        record = not self.recomputing
        if record:
            self.aux_losses = {}
        train = self.training and torch.is_grad_enabled()
        token_groups = self.batch_groups + self.sequence_groups
        num_tokens_global = logits.shape[0] * _product(token_groups)

        if cfg.moe_z_loss_coeff and train:
            zl = z_loss(logits, cfg.moe_z_loss_coeff) * (logits.shape[0] / num_tokens_global)
            logits = attach_aux_loss(logits, zl, self.aux_loss_scale)
            if record:
                self._record("z_loss", zl)

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

        if self.local_tokens_per_expert is not None and torch.is_grad_enabled() and record:
            valid = indices[indices >= 0]
            counts = torch.bincount(valid, minlength=self.num_experts).float()
            self.local_tokens_per_expert += counts
            self._count_history.append(counts)

        lb = cfg.moe_router_load_balancing_type
        if train and lb != "none" and cfg.moe_aux_loss_coeff > 0:
            scores, aux_map = self.scores_for_aux_loss(logits)
            if lb == "aux_loss":  # counts over the whole micro-batch
                counts = _all_reduce_(aux_map.sum(0).float(), token_groups)
                aux = switch_load_balancing_loss(scores, counts, num_tokens_global, self.topk,
                                                 cfg.moe_aux_loss_coeff)
            else:  # seq_aux_loss: the switch loss of each sequence, averaged over the (global) batch
                E = self.num_experts
                seq_global = seq_len * _product(self.sequence_groups)
                bsz_global = bsz * _product(self.batch_groups)
                s_scores = scores.reshape(seq_len, bsz * E)
                s_counts = _all_reduce_(aux_map.reshape(seq_len, bsz * E).sum(0).float(), self.sequence_groups)
                aux = (s_scores.sum(0) * s_counts).sum() * (E * cfg.moe_aux_loss_coeff
                                                            / (self.topk * seq_global * seq_global)) / bsz_global
            probs = attach_aux_loss(probs, aux, self.aux_loss_scale)
            if record:
                self._record(lb, aux)
        if train and record and self.aux_losses:
            self._aux_history.append(dict(self.aux_losses))
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
        n = n.to(self.expert_bias.device, _acc(self.expert_bias))
        self.expert_bias += torch.sign(n.mean() - n) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()
        self._count_history = []
