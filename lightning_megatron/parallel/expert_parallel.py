"""``apply_ep``: shard a mixture-of-experts model's experts over the expert-parallel groups."""
from __future__ import annotations

from typing import List

from torch import nn

from lightning_megatron.contract import ExpertParallelModel, RoutedExperts
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.mesh import ParallelMesh


def apply_ep(models: List[nn.Module], mesh: ParallelMesh, config: ParallelConfig) -> List[nn.Module]:
    """Expert parallelism for the MoE models among ``models`` (on the meta device, before initialisation).

    Each :class:`ExpertParallelModel` with MoE layers keeps its share of the experts (groups ``ep``, ``etp``,
    ``ep_etp``) and learns where the rest of each micro-batch's tokens are for its routers' statistics: the
    sequence groups (cp, and tp under sequence parallelism) and the batch group (dp). Returns the MoE models.

    Raises:
        ValueError: ep > 1 and no MoE model is found.
    """
    moe = [m for m in models if isinstance(m, ExpertParallelModel) and m.moe_layers()]
    if not moe:
        if config.ep > 1:
            raise ValueError(f"ep={config.ep} needs a mixture-of-experts model (e.g. GPTModel with num_moe_experts); "
                             "none was found")
        return []
    sequence = [mesh.group("cp")] + ([mesh.group("tp")] if config.sequence_parallel else [])
    for model in moe:
        model.set_expert_parallel(mesh.group("ep") if config.ep > 1 else None,
                                  mesh.group("etp") if config.etp > 1 else None,
                                  mesh.group("ep_etp") if config.ep * config.etp > 1 else None)
        model.set_moe_token_groups(sequence, [mesh.group("dp")])
    return moe


def expert_parameters(module: nn.Module) -> List[nn.Parameter]:
    """Parameters of the routed experts in ``module`` (marked ``allreduce = False``, Megatron's marker): they are
    reduced over expert data parallel instead of dp x cp."""
    params: List[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, RoutedExperts):
            for p in m.parameters():
                p.allreduce = False   # materialisation may have replaced the marked meta parameters
                params.append(p)
    return params
