"""``apply_cp``: route a model's core attention through context-parallel attention over the CP group."""
from __future__ import annotations

import functools
from typing import Callable, List

import torch
from torch import nn

from lightning_megatron.contract import ContextParallelModel
from lightning_megatron.parallel.config import A2A_COMM_TYPES, ParallelConfig
from lightning_megatron.parallel.mesh import ParallelMesh


def resolve_delay_wgrad(config: ParallelConfig, models: List[nn.Module]) -> bool:
    """``delay_wgrad_compute`` for this layout and these models: the explicit setting, or (None) on wherever the
    layout allows it and every model declares ``supports_delayed_wgrad``."""
    if config.delay_wgrad_compute is not None:
        return config.delay_wgrad_compute
    return config.delay_wgrad_applies and all(m.supports_delayed_wgrad for m in models)


def attention_for_layer(mesh: ParallelMesh, config: ParallelConfig) -> Callable[[int], Callable[..., torch.Tensor]]:
    """Layer index -> its context-parallel attention callable ``(q, k, v, [wgrad=]) -> out`` over the CP group
    (the ``a2a+p2p`` type also over the inner (a2a) and outer (ring) CP groups), with the config's kernel options
    (``cp_attention_kernel``, ``cp_compile_merge``, ``cp_sm_carveout``)."""
    from lightning_megatron.parallel.context_parallel import context_parallel_attention

    def for_layer(layer: int) -> Callable[..., torch.Tensor]:
        comm_type = config.cp_comm_type_of(layer)
        hierarchical = comm_type == "a2a+p2p"
        return functools.partial(
            context_parallel_attention, group=mesh.group("cp"), comm_type=comm_type,
            inner_group=mesh.group("cp_inner") if hierarchical else None,
            outer_group=mesh.group("cp_outer") if hierarchical else None,
            attention_kernel=config.cp_attention_kernel, compile_merge=config.cp_compile_merge,
            sm_carveout=config.cp_sm_carveout,
        )

    return for_layer


def apply_cp(models: List[nn.Module], mesh: ParallelMesh, config: ParallelConfig) -> bool:
    """Context parallelism for ``models`` (each a :class:`ContextParallelModel`) over ``mesh``'s CP group.

    Every layer's core attention becomes :func:`context_parallel_attention` with the layer's ``cp_comm_type``;
    with ``delay_wgrad_compute`` (resolved by :func:`resolve_delay_wgrad`) the a2a layers hand their weight-gradient
    GEMMs to the attention's backward. Inputs must be the load-balanced (zigzag) shards of each sequence (the
    strategy's ``batch_to_device`` cuts them). Returns whether weight gradients are delayed. No-op at cp == 1.

    Raises:
        ValueError: cp > 1 and a model does not implement :class:`ContextParallelModel`.
    """
    if config.cp == 1:
        return False
    bad = [type(m).__name__ for m in models if not isinstance(m, ContextParallelModel)]
    if not models or bad:
        raise ValueError(
            f"cp={config.cp} needs models implementing lightning_megatron.contract.ContextParallelModel "
            f"(set_context_parallel(attention_for_layer, delay_wgrad_for_layer) and supports_delayed_wgrad, as "
            f"lightning_megatron.GPTModel); got {bad or 'no model with a tensor_parallel_plan'}"
        )
    delay = resolve_delay_wgrad(config, models)
    attention = attention_for_layer(mesh, config)

    def delays(layer: int) -> bool:
        return delay and config.cp_comm_type_of(layer) in A2A_COMM_TYPES

    for model in models:
        model.set_context_parallel(attention, delays)
    return delay
