"""Mixture of Experts (Megatron-Core ``transformer/moe``): config, router, experts, dispatchers, layer, and the
per-step bookkeeping (aux-loss scale and logging, expert-bias updates). Expert parallel (EP) and expert tensor
parallel (ETP) groups are passed in; nothing here holds process groups globally.
"""
from lightning_megatron.moe.config import MoEConfig, check_expert_parallel
from lightning_megatron.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from lightning_megatron.moe.experts import GroupedMLPExperts, SequentialMLPExperts
from lightning_megatron.moe.layer import MoELayer, SharedExpertMLP
from lightning_megatron.moe.training import pop_aux_loss_sums, routers, set_aux_loss_scale_of, update_expert_biases
from lightning_megatron.moe.router import (
    TopKRouter,
    apply_token_dropping,
    attach_aux_loss,
    expert_capacity,
    get_aux_loss_scale,
    set_aux_loss_scale,
    switch_load_balancing_loss,
    z_loss,
)

__all__ = [
    "MoEConfig", "check_expert_parallel", "TopKRouter", "attach_aux_loss", "set_aux_loss_scale",
    "get_aux_loss_scale", "switch_load_balancing_loss", "z_loss", "expert_capacity", "apply_token_dropping",
    "GroupedMLPExperts", "SequentialMLPExperts", "AllToAllDispatcher", "AllGatherDispatcher", "build_dispatcher",
    "MoELayer", "SharedExpertMLP", "routers", "set_aux_loss_scale_of", "pop_aux_loss_sums", "update_expert_biases",
]
