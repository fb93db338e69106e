"""MoE configuration with Megatron-Core's field names (``TransformerConfig``'s ``moe_*`` options)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
# Megatron names we recognise for validation but do not implement.
UNIMPLEMENTED_LOAD_BALANCING_TYPES = ("global_aux_loss", "sinkhorn")
# Megatron: "moe_expert_capacity_factor only works with aux_loss / seq_aux_loss / global_aux_loss / none".
CAPACITY_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHER_TYPES = ("alltoall", "allgather")


@dataclass
class MoEConfig:
    num_moe_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: Optional[float] = None  # None = dropless
    moe_token_drop_policy: str = "probs"
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    gated_linear_unit: bool = True  # SwiGLU experts (Megatron: gated_linear_unit + activation_func=silu)

    def __post_init__(self) -> None:
        E, k = self.num_moe_experts, self.moe_router_topk
        if not isinstance(E, int) or E < 1:
            raise ValueError(f"num_moe_experts must be a positive int, got {E!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"moe_router_topk must be a positive int, got {k!r}")
        if k > E:
            raise ValueError(f"moe_router_topk ({k}) must be <= num_moe_experts ({E})")
        if self.moe_ffn_hidden_size is None or self.moe_ffn_hidden_size < 1:
            raise ValueError(f"moe_ffn_hidden_size must be a positive int, got {self.moe_ffn_hidden_size!r}")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"moe_router_score_function must be one of {SCORE_FUNCTIONS}, "
                             f"got {self.moe_router_score_function!r}")
        if self.moe_router_score_function == "softmax" and k == 1 and not self.moe_router_pre_softmax:
            # Megatron arguments.py: a softmax over a single top-k logit is always 1.
            raise ValueError("Please use --moe-router-pre-softmax when topk is 1 "
                             "(moe_router_pre_softmax=True with moe_router_topk=1 and softmax scores).")
        lb = self.moe_router_load_balancing_type
        if lb not in LOAD_BALANCING_TYPES + UNIMPLEMENTED_LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type must be one of {LOAD_BALANCING_TYPES}, got {lb!r}")
        if self.moe_expert_capacity_factor is not None:
            if self.moe_expert_capacity_factor <= 0:
                raise ValueError(f"moe_expert_capacity_factor must be > 0 or None, "
                                 f"got {self.moe_expert_capacity_factor}")
            if lb not in CAPACITY_LOAD_BALANCING_TYPES:
                raise ValueError(f"moe_expert_capacity_factor only works with load balancing types "
                                 f"{CAPACITY_LOAD_BALANCING_TYPES}, got moe_router_load_balancing_type={lb!r}")
        if lb in UNIMPLEMENTED_LOAD_BALANCING_TYPES:
            raise NotImplementedError(f"moe_router_load_balancing_type={lb!r} is not implemented "
                                      f"(supported: {LOAD_BALANCING_TYPES})")
        if self.moe_token_drop_policy not in DROP_POLICIES:
            raise ValueError(f"moe_token_drop_policy must be one of {DROP_POLICIES}, got {self.moe_token_drop_policy!r}")
        if self.moe_token_dispatcher_type not in DISPATCHER_TYPES:
            raise ValueError(f"moe_token_dispatcher_type must be one of {DISPATCHER_TYPES}, "
                             f"got {self.moe_token_dispatcher_type!r}")
        if self.moe_router_enable_expert_bias:
            if self.moe_router_score_function != "sigmoid":
                raise ValueError("moe_router_enable_expert_bias (aux-loss-free balancing) requires "
                                 "moe_router_score_function='sigmoid'")
            if self.moe_router_bias_update_rate <= 0:
                raise ValueError("moe_router_bias_update_rate must be > 0 with moe_router_enable_expert_bias")
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0):
            raise ValueError("moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0")
        if self.moe_shared_expert_intermediate_size is not None and self.moe_shared_expert_intermediate_size < 1:
            raise ValueError("moe_shared_expert_intermediate_size must be a positive int or None")


def check_expert_parallel(config: MoEConfig, ep: int) -> int:
    """Validate ``ep`` against ``config`` and return ``num_local_experts`` (Megatron ``moe_layer.py``)."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_model_parallel_size must be a positive int, got {ep!r}")
    if config.num_moe_experts % ep != 0:
        raise ValueError(f"num_moe_experts ({config.num_moe_experts}) must be divisible by "
                         f"expert_model_parallel_size ({ep})")
    return config.num_moe_experts // ep


def moe_layer_pattern(config: Any) -> List[int]:
    """1 for each layer whose MLP is a MoE layer, 0 for a dense one (all 0 without ``num_moe_experts``)."""
    num_layers = config.num_layers
    if getattr(config, "num_moe_experts", None) is None:
        return [0] * num_layers
    freq = getattr(config, "moe_layer_freq", 1)
    if freq is None:
        freq = 1
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq} must be >= 1")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    pattern = [int(x) for x in freq]
    if len(pattern) != num_layers or any(x not in (0, 1) for x in pattern):
        raise ValueError(f"moe_layer_freq={freq!r} must be an int or a 0/1 list of length num_layers={num_layers}")
    return pattern
