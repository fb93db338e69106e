"""Per-step MoE bookkeeping over a whole model: aux-loss gradient scale, aux-loss values for logging, and the
aux-loss-free expert-bias update. Each function walks ``module`` for :class:`TopKRouter` s, so it works on a
full model, a pipeline stage's part of it, or a LightningModule holding either."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.moe.router import TopKRouter
from lightning_megatron.parallel.tensor_parallel.mappings import group_size


def routers(module: nn.Module) -> List[TopKRouter]:
    """Every router in ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def set_aux_loss_scale_of(module: nn.Module, scale: Optional[float]) -> None:
    """Gradient the aux / z losses of every router in ``module`` get in backward (``None``: process-wide value).

    Scale them like the main loss: with a loss that is ``dp_cp`` times this rank's share of the global
    token-mean (data-parallel gradients averaged over ``dp_cp``) and ``M`` micro-batches per step, ``dp_cp / M``
    (or ``dp_cp`` where the pipeline schedule divides gradients by ``M`` itself).
    """
    for r in routers(module):
        r.aux_loss_scale = scale


def pop_aux_loss_sums(module: nn.Module, last: Optional[int] = None) -> Dict[str, Tensor]:
    """This rank's share of each aux loss (``aux_loss``/``seq_aux_loss``/``z_loss``), summed over the routers of
    ``module`` and the training forwards since the last call (the ``last`` most recent ones if given); resets
    the routers' records. Sum the result over the token groups (and pipeline stages) for the global values."""
    out: Dict[str, Tensor] = {}
    for r in routers(module):
        for name, value in r.pop_aux_loss_sums(last).items():
            out[name] = out[name] + value if name in out else value
    return out


@torch.no_grad()
def update_expert_biases(module: nn.Module, groups: Sequence = (), last: Optional[int] = None) -> None:
    """Aux-loss-free balancing step for every router of ``module`` with ``moe_router_enable_expert_bias``: the
    token counts each router accumulated since the last update are summed over ``groups`` (the ranks holding
    the rest of the step's tokens: data x context parallel, and TP under sequence parallelism; one all-reduce
    of ``[n_routers, E]`` per group), then ``bias += rate * sign(mean(n) - n)``. Call once per optimizer step.
    ``last``: count only the ``last`` most recent training forwards (the step's micro-batches, skipping a
    pipeline schedule's extra metadata-inference forward)."""
    biased = [r for r in routers(module) if r.expert_bias is not None]
    if not biased:
        return
    counts = torch.stack([r.tokens_per_expert_since_update(last) for r in biased])
    for g in groups:
        if group_size(g) > 1:
            dist.all_reduce(counts, group=g)
    for r, n in zip(biased, counts.unbind(0)):
        r.update_expert_bias(n)
