"""``apply_fsdp``: Megatron's sharding levels ``optim_grads`` (ZeRO-2) and ``optim_grads_params`` (ZeRO-3) on torch
FSDP2 (``torch.distributed.fsdp.fully_shard``), in the ``apply_dp`` slot of ``parallelize``.

Units: every transformer layer is one FSDP unit over the dp x cp mesh; inside it, the routed experts of a MoE layer
are a unit of their own over the expert-data-parallel mesh (edp: the ranks holding the same experts), whose
reduction sums over edp and divides by dp x cp (Megatron's expert gradient scaling, as
:func:`~lightning_megatron.parallel.grad_sync.allreduce_expert_parallel_grads`; with edp = 1 the experts stay out of
FSDP and that function reduces them); the rest of each model (embedding,
final norm, output layer) is the root unit: the model itself (its ``forward`` and ``logits`` trigger FSDP), or under
pipeline parallelism each pipeline stage module (torch's pipelining schedules drive FSDP's gradient reduction
themselves: once per step, after the last micro-batch).

FSDP shards whatever tensors the modules hold: the tensor-parallel layers hold plain local shards, so FSDP splits
those further along dim 0 over dp x cp. Parameters become ``DTensor`` s over a 1-D mesh of the dp x cp (or edp)
group; their gradients are ``DTensor`` shards, reduce-scattered (averaged) over it. ``optim_grads`` keeps each
layer's parameters gathered from its forward to its backward (``reshard_after_forward=False``); ``optim_grads_params``
frees them after the forward and gathers them again for the backward. Both shard the gradients and, since the
optimizer steps the sharded parameters, its states.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_megatron.contract import RoutedExperts
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.mesh import ParallelMesh

__all__ = ["FSDPModel", "apply_fsdp", "mixed_precision_policy", "distribute_like"]


def distribute_like(like: Tensor, value: Tensor) -> Tensor:
    """``value`` (the whole tensor FSDP sees: this rank's tensor-parallel shard) laid out as ``like``: a ``DTensor``
    of the same mesh and placements when ``like`` is one (each rank keeps its slice; no communication), else
    ``value`` itself."""
    if not isinstance(like, DTensor):
        return value
    value = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def mixed_precision_policy(precision: Optional[str], config: ParallelConfig) -> Optional[MixedPrecisionPolicy]:
    """FSDP's mixed precision from the precision plugin's setting: ``"bf16-mixed"`` gathers bfloat16 parameters for
    compute and reduces gradients in float32 (bfloat16 with ``grad_reduce_in_bf16``), as Lightning's
    ``ModelParallelStrategy`` users configure FSDP2; ``"16-mixed"`` the same with float16 parameters. Any other
    setting (``"32-true"``, ``"bf16-true"``, ...): parameters are used in their own dtype (None; with
    ``grad_reduce_in_bf16`` a policy reducing in bfloat16)."""
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    if precision not in dtypes:
        return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if config.grad_reduce_in_bf16 else None
    reduce = torch.bfloat16 if config.grad_reduce_in_bf16 else torch.float32
    return MixedPrecisionPolicy(param_dtype=dtypes[precision], reduce_dtype=reduce)


@dataclass
class FSDPModel:
    """What :func:`apply_fsdp` did: the root FSDP modules (the models, or the pipeline stage modules), and every FSDP
    unit. :meth:`no_sync` is the ``no_sync`` of DDP for the step path (pp == 1)."""

    roots: List[FSDPModule]
    units: List[FSDPModule] = field(default_factory=list)
    #: whether FSDP reduces the routed experts' gradients (over edp > 1); with edp = 1 they are left out of FSDP
    #: and reduced by the gradient finalisation as under DDP
    experts_sharded: bool = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients without reducing them (a non-final micro-batch);
        the next backward outside reduces the sum once."""
        for root in self.roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True)


def _expert_modules(layer: nn.Module) -> List[nn.Module]:
    return [m for m in layer.modules() if isinstance(m, RoutedExperts)]


def _layers(model: nn.Module) -> List[nn.Module]:
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            f"data_parallel_sharding_strategy shards transformer layers of GPT-layout models (decoder.layers, as "
            f"lightning_megatron.GPTModel); {type(model).__name__} has none")
    return list(layers.values())


def apply_fsdp(module: nn.Module, models: List[nn.Module], mesh: ParallelMesh, config: ParallelConfig, *,
               pipeline_modules: Optional[List[nn.Module]] = None,
               mp_policy: Optional[MixedPrecisionPolicy] = None) -> FSDPModel:
    """Shard ``module``'s parameters with FSDP2 (see the module docstring), in place: each transformer layer of
    ``models`` (the GPT-layout models ``parallelize`` found) over dp x cp, their routed experts over edp, and the
    rest under the root units: ``pipeline_modules`` (this rank's pipeline stages, pp > 1) or the models themselves.

    Call after materialisation and before the optimizers are built (they must hold the sharded parameters).
    Collective at the first forward (FSDP's lazy initialisation), not here.

    Raises:
        ValueError: ``module`` holds parameters outside the models (nothing would shard or reduce them), naming
            the first few.
    """
    reshard = config.data_parallel_sharding_strategy == "optim_grads_params"
    dense_mesh, expert_mesh = mesh.dp_cp_mesh, mesh.expert["edp"]
    force_sum = dist.get_backend(mesh.group("dp_cp")) != dist.Backend.NCCL   # gloo has no AVG / PREMUL_SUM
    kwargs: Dict[str, Any] = {"mp_policy": mp_policy} if mp_policy is not None else {}
    covered = {id(p) for m in (pipeline_modules or models) for p in m.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in covered]
    if outside:
        raise ValueError(
            f"data_parallel_sharding_strategy={config.data_parallel_sharding_strategy!r} shards the GPT-layout "
            f"models' parameters; {type(module).__name__} also holds {outside[:5]} outside them: move them into the "
            "model or use 'no_shard' / 'optim'")
    units: List[FSDPModule] = []
    experts = [e for model in models for layer in _layers(model) for e in _expert_modules(layer)]
    experts_sharded = mesh.size("edp") > 1
    if experts and not experts_sharded:   # nothing to shard them over: left to the gradient finalisation
        kwargs["ignored_params"] = {p for e in experts for p in e.parameters()}

    def shard(m: nn.Module, on: Any, reshard_after_forward: bool, divide: Optional[float] = None) -> FSDPModule:
        unit = fully_shard(m, mesh=on, reshard_after_forward=reshard_after_forward, **kwargs)
        if force_sum:
            unit.set_force_sum_reduction_for_comms(True)
        if divide is not None:
            unit.set_gradient_divide_factor(divide)
        units.append(unit)
        return unit

    for model in models:
        for layer in _layers(model):
            for unit in _expert_modules(layer) if experts_sharded else []:
                shard(unit, expert_mesh, reshard, divide=float(mesh.size("dp_cp")))
            shard(layer, dense_mesh, reshard)
    roots: List[FSDPModule] = []
    if pipeline_modules:
        for stage in pipeline_modules:
            roots.append(shard(stage, dense_mesh, False))
    else:
        for model in models:
            roots.append(shard(model, dense_mesh, False))
            if callable(getattr(type(model), "logits", None)):
                register_fsdp_forward_method(model, "logits")   # the step path's forward (forward_step)
    return FSDPModel(roots=roots, units=units, experts_sharded=bool(experts) and experts_sharded)
