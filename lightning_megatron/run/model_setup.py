"""What :class:`~lightning_megatron.run.ParallelRun` does to a parallelised model after
:func:`~lightning_megatron.parallelize.parallelize` when fitting, one function per concern: the data
parallel replicas made equal (the parameter-and-gradient buffer broadcast over dp x cp, or FSDP2 at the sharding
level asked for), the distributed optimizer's sharded states with their overlapped parameter gathers, and bf16
parameters' hook that copies the stepped fp32 main parameters back."""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.contract import ParallelContext, ParallelLightningModule, TiedWeightsModel
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.distributed_optimizer import rebind_lr_scheduler, shard_optimizers
from lightning_megatron.parallel.fsdp import FSDPModel, apply_fsdp, mixed_precision_policy
from lightning_megatron.parallel.param_buffer.optimizer import (
    ELEMENTWISE_OPTIMIZERS,
    BucketParamGather,
    DistributedOptimizer,
    elementwise,
)
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.param_gather import OverlappedParamGather, zero_optimizers
from lightning_megatron.parallelize import ParallelizedModel

__all__ = ["check_pipeline_module", "parallel_context", "equalize_replicas", "shard_fsdp", "shard_optimizer_states",
           "tied_head_waits"]


def check_pipeline_module(module: nn.Module, cfg: ParallelConfig) -> None:
    """Under pipeline parallelism the strategy runs the schedule with the module's step pieces: ValueError unless
    ``module`` implements :class:`~lightning_megatron.contract.ParallelLightningModule`."""
    if cfg.pp > 1 and not isinstance(module, ParallelLightningModule):
        raise ValueError(
            f"pp={cfg.pp}: {type(module).__name__} does not implement lightning_megatron.contract."
            "ParallelLightningModule (forward_step, loss_sum, token_count, ...): under pipeline parallelism the "
            "strategy runs the schedule and needs the module's step pieces (see ParallelGPTModule)")


def parallel_context(mesh: ParallelMesh, cfg: ParallelConfig) -> ParallelContext:
    """The layout a :class:`~lightning_megatron.contract.ParallelLightningModule` is told: its data-parallel group
    (dp x cp), the groups its token counts are summed over (and tp under sequence parallelism), the pipeline
    group."""
    tokens = [mesh.group("dp_cp")] + ([mesh.group("tp")] if cfg.sequence_parallel else [])
    return ParallelContext(dp_group=mesh.group("dp_cp"), dp_size=mesh.size("dp_cp"), token_groups=tokens,
                           pp_group=mesh.group("pp") if cfg.pp > 1 else None)


def equalize_replicas(parallelized: ParallelizedModel, mesh: ParallelMesh) -> None:
    """Data parallelism over dp x cp outside the FSDP levels: the parameters' contiguous buffer
    (:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`) owns the gradient reduction, so nothing wraps the
    model; the replicas are made equal (:meth:`MainParams.broadcast_replicas`: dense buckets from the first rank of
    dp x cp, routed experts' from the first of edp), as torch DDP does when it wraps a model."""
    assert parallelized.main_params is not None, "outside the FSDP levels the strategy holds the parameters in a buffer"
    parallelized.main_params.broadcast_replicas(lambda bucket: _bucket_group(mesh, bucket))


def _bucket_group(mesh: ParallelMesh, bucket: Any) -> Tuple[Any, int, int]:
    """A buffer bucket's data-parallel ``(group, size, rank)``: edp for routed experts, dp x cp otherwise."""
    name = "edp" if bucket.expert else "dp_cp"
    return mesh.group(name), mesh.size(name), mesh.rank(name)


def shard_fsdp(module: nn.Module, parallelized: ParallelizedModel, mesh: ParallelMesh, cfg: ParallelConfig,
               precision: str) -> FSDPModel:
    """FSDP2 over dp x cp (experts: edp) at ``cfg.data_parallel_sharding_strategy``
    (:func:`~lightning_megatron.parallel.fsdp.apply_fsdp`), mixed precision from the plugin's ``precision``;
    ``parallelized`` then refers to the sharded parameters."""
    stages = parallelized.pipeline
    fsdp = apply_fsdp(module, parallelized.models, mesh, cfg,
                      pipeline_modules=stages.modules if stages is not None else None,
                      mp_policy=mixed_precision_policy(precision, cfg))
    parallelized.refresh()
    return fsdp


def shard_optimizer_states(optimizers: List[Any], lr_scheduler_configs: List[Any], model: nn.Module,
                           parallelized: ParallelizedModel, mesh: ParallelMesh, cfg: ParallelConfig,
                           previous_gather: Optional[OverlappedParamGather]
                           ) -> Tuple[List[Any], Optional[OverlappedParamGather]]:
    """The distributed optimizer (``data_parallel_sharding_strategy="optim"``, dp x cp > 1): each optimizer's states
    sharded over dp x cp (experts' over edp), and with ``overlap_param_gather`` the gathers of the stepped parameters
    overlapped with the next forward (a previous fit's gather hooks are removed first). Other layouts: the optimizers
    as they are and ``previous_gather``."""
    if cfg.data_parallel_sharding_strategy != "optim" or mesh.size("dp_cp") == 1:
        return optimizers, previous_gather
    main = parallelized.main_params   # bf16 parameters: their buffers' shards (Megatron's distributed optimizer)
    if main is not None and all(elementwise(getattr(o, "_optimizer", o)) for o in optimizers):
        return shard_main_params(optimizers, lr_scheduler_configs, model, parallelized, mesh, cfg, previous_gather)
    if main is not None:
        names = [type(getattr(o, "_optimizer", o)).__name__ for o in optimizers]
        _warn_on_first_rank(f"use_distributed_optimizer with bf16 parameters and {names}: not elementwise optimizers "
                       f"(only {[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]} step shards of a parameter), so the "
                       "optimizer states are sharded per whole parameter (ZeroRedundancyOptimizer) and the fp32 main "
                       "parameters stay whole on every rank")
    experts = parallelized.expert_params if cfg.ep > 1 else []
    optimizers = shard_optimizers(optimizers, lr_scheduler_configs, mesh.group("dp_cp"), experts, mesh.group("edp"))
    if not cfg.overlap_param_gather:
        return optimizers, previous_gather
    if previous_gather is not None:
        previous_gather.remove()
    main = parallelized.main_params   # bf16 parameters: their copies follow the broadcast fp32 main values
    return optimizers, OverlappedParamGather(zero_optimizers(optimizers), model, tied_head_waits(parallelized.models),
                                             after_wait=main.adopt_broadcast if main is not None else None)


def shard_main_params(optimizers: List[Any], lr_scheduler_configs: List[Any], model: nn.Module,
                      parallelized: ParallelizedModel, mesh: ParallelMesh, cfg: ParallelConfig,
                      previous_gather: Optional[Any]) -> Tuple[List[Any], Optional[BucketParamGather]]:
    """bf16 parameters under the distributed optimizer: each optimizer a
    :class:`~lightning_megatron.parallel.param_buffer.optimizer.DistributedOptimizer` over this rank's shard of the
    main-parameter buffers (dense buckets over dp x cp, routed experts' over edp), the LR schedulers rebound, and with
    ``overlap_param_gather`` the bucket gathers overlapped with the next forward."""
    main = parallelized.main_params
    assert main is not None

    def group_of(bucket: Any) -> Tuple[Any, int, int]:
        return _bucket_group(mesh, bucket)

    grad_dtype = torch.bfloat16 if cfg.grad_reduce_in_bf16 else None   # Megatron's bf16 gradient buffers
    sharded: List[Any] = [DistributedOptimizer(getattr(o, "_optimizer", o), main, group_of, grad_dtype)
                          for o in optimizers]
    for old, new in zip(optimizers, sharded):
        for config in lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is old:
                rebind_lr_scheduler(config.scheduler, new)
    if previous_gather is not None:
        previous_gather.remove()
    if not cfg.overlap_param_gather:
        return sharded, None
    return sharded, BucketParamGather(sharded, main, model, tied_head_waits(parallelized.models))


def tied_head_waits(models: List[nn.Module]) -> Dict[Any, List[Any]]:
    """``{LM head: [word-embedding weight]}`` for tied heads (the head reads the embedding's weight, whose module may
    not run on this pipeline stage): what :class:`OverlappedParamGather` waits for besides own parameters."""
    waits: Dict[Any, List[Any]] = {}
    for model in models:
        if isinstance(model, TiedWeightsModel):
            waits.update(model.tied_weight_readers())
    return waits


def _warn_on_first_rank(message: str) -> None:
    """A warning on the world's first rank only (every rank reaches the same verdict)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)
