"""``apply_dp``: data parallelism over the dp x cp group with torch DDP."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_megatron.contract import TokenRouter
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.grad_buckets import ddp_bucket_kwargs
from lightning_megatron.parallel.grad_sync import bf16_allreduce_hook, mean_allreduce_hook
from lightning_megatron.parallel.mesh import ParallelMesh


def ddp_ignored_names(module: nn.Module, expert_params: List[nn.Parameter]) -> List[str]:
    """Names DDP must leave alone: expert weights (they differ between dp ranks and are reduced over expert data
    parallel instead) and the routers' per-rank token-count buffers."""
    experts = {id(p) for p in expert_params}
    names = [n for n, p in module.named_parameters() if id(p) in experts]
    for mod_name, m in module.named_modules():
        if isinstance(m, TokenRouter):
            names += [f"{mod_name}.{b}" for b, _ in m.named_buffers(recurse=False)]
    return names


def apply_dp(module: nn.Module, mesh: ParallelMesh, config: ParallelConfig, *,
             expert_params: Optional[List[nn.Parameter]] = None, device_ids: Optional[List[int]] = None,
             ddp_kwargs: Optional[Dict[str, Any]] = None, register_hook: bool = True) -> nn.Module:
    """Wrap ``module`` in torch DDP over the dp x cp group (returned as is when that group has one rank).

    Gradients live in DDP's buckets (``gradient_as_bucket_view=True`` unless given; Megatron's contiguous grad
    buffer). Expert parameters and router buffers are ignored by DDP. With ``register_hook`` the bucket all-reduce
    averages once per bucket (:func:`mean_allreduce_hook`; :func:`bf16_allreduce_hook` under
    ``grad_reduce_in_bf16``) instead of DDP's per-parameter division kernels. Bucket sizes follow
    ``overlap_grad_reduce`` / ``bucket_size`` (:func:`~lightning_megatron.parallel.grad_buckets.ddp_bucket_kwargs`). Pipeline stages are not wrapped (a
    schedule runs one backward per micro-batch; their gradients are averaged in ``finalize_grads``).
    """
    if mesh.size("dp_cp") == 1:
        return module
    group = mesh.group("dp_cp")
    kwargs = dict(ddp_kwargs or {})
    kwargs.setdefault("process_group", group)
    kwargs.setdefault("gradient_as_bucket_view", True)
    kwargs.update(ddp_bucket_kwargs(module, config, kwargs))   # overlap_grad_reduce / bucket_size
    ignored = ddp_ignored_names(module, expert_params or [])
    if ignored:
        module._ddp_params_and_buffers_to_ignore = list(getattr(module, "_ddp_params_and_buffers_to_ignore", [])) + ignored
    ddp = DistributedDataParallel(module, device_ids=device_ids, **kwargs)
    if register_hook:
        ddp.register_comm_hook(group, bf16_allreduce_hook if config.grad_reduce_in_bf16 else mean_allreduce_hook)
    return ddp
