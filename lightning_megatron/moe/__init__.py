"""Mixture of Experts (Megatron-Core ``transformer/moe``): config, router, experts, dispatchers, layer, and the
per-step bookkeeping (aux-loss scale and logging, expert-bias updates). Expert parallel (EP) and expert tensor
parallel (ETP) groups are passed in; nothing here holds process groups globally.
"""
from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS = {
    "MoEConfig": "lightning_megatron.moe.config",
    "check_expert_parallel": "lightning_megatron.moe.config",
    "AllGatherDispatcher": "lightning_megatron.moe.dispatcher",
    "AllToAllDispatcher": "lightning_megatron.moe.dispatcher",
    "build_dispatcher": "lightning_megatron.moe.dispatcher",
    "GroupedMLPExperts": "lightning_megatron.moe.experts",
    "SequentialMLPExperts": "lightning_megatron.moe.experts",
    "MoELayer": "lightning_megatron.moe.layer",
    "SharedExpertMLP": "lightning_megatron.moe.layer",
    "pop_aux_loss_sums": "lightning_megatron.moe.training",
    "routers": "lightning_megatron.moe.training",
    "set_aux_loss_scale_of": "lightning_megatron.moe.training",
    "update_expert_biases": "lightning_megatron.moe.training",
    "TopKRouter": "lightning_megatron.moe.router",
    "apply_token_dropping": "lightning_megatron.moe.router",
    "attach_aux_loss": "lightning_megatron.moe.router",
    "expert_capacity": "lightning_megatron.moe.router",
    "get_aux_loss_scale": "lightning_megatron.moe.router",
    "set_aux_loss_scale": "lightning_megatron.moe.router",
    "switch_load_balancing_loss": "lightning_megatron.moe.router",
    "z_loss": "lightning_megatron.moe.router",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
