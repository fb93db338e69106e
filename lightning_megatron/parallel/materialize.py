"""The ``materialize`` step of :func:`lightning_megatron.parallelize`: a module built on the meta device gets this
rank's parameters, initialised so that every layout holds the same global weights."""
from __future__ import annotations

from typing import List, Set

import torch
from torch import nn

from lightning_megatron.contract import InitialisableModel


def materialize(module: nn.Module, models: List[nn.Module], device: torch.device, seed: int) -> None:
    """Allocate meta-device parameters of ``module`` on ``device`` and initialise them: models implementing
    :class:`~lightning_megatron.contract.InitialisableModel` with ``init_weights(seed)`` (the same global
    weights under every layout), every other submodule with its ``reset_parameters()``. No-op without meta
    parameters. No communication (each rank initialises its own shards from ``seed``)."""
    if not any(p.is_meta for p in module.parameters()):
        return
    module.to_empty(device=device)
    initialised: Set[int] = set()
    for model in models:
        if isinstance(model, InitialisableModel):
            model.init_weights(seed)
            initialised.update(id(m) for m in model.modules())
    with torch.no_grad():
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if id(m) not in initialised and callable(reset):
                reset()
