"""Layout-independent (full, unsharded) model and optimizer state from tensor-parallel shards and back.

A checkpoint written from these functions holds every tensor in the layout of the plain tp=1 model (the
vocabulary padded as at tp=1), so it loads under any tp/dp layout, and into a plain ``GPTModel``.
Gathering is a collective over each layer's TP group: call on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.parallel.tensor_parallel.layers import TensorParallelModule

Owner = Tuple[TensorParallelModule, str]


def tensor_parallel_owners(module: nn.Module) -> Dict[str, Owner]:
    """``state-dict key -> (TP layer, parameter name)`` for every parameter of a TP layer in ``module``."""
    owners: Dict[str, Owner] = {}
    for mod_name, mod in module.named_modules():
        if isinstance(mod, TensorParallelModule):
            for pname, _ in mod.named_parameters(recurse=False):
                owners[f"{mod_name}.{pname}" if mod_name else pname] = (mod, pname)
    return owners


def full_model_state_dict(module: nn.Module) -> Dict[str, Any]:
    """``module.state_dict()`` with every TP shard replaced by its full tensor (collective over TP)."""
    owners = tensor_parallel_owners(module)
    state = module.state_dict()
    for key, (mod, pname) in owners.items():
        if key in state:
            state[key] = mod.gather_global(pname, state[key]).cpu()
    return state


def shard_model_state_dict(module: nn.Module, full: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's shards of the full state ``full`` (as written by :func:`full_model_state_dict`)."""
    owners = tensor_parallel_owners(module)
    state = dict(full)
    for key, (mod, pname) in owners.items():
        if key in state:
            state[key] = mod.shard_global(pname, _strip_canonical_padding(mod, pname, state[key]))
    return state


def _strip_canonical_padding(mod: TensorParallelModule, pname: str, t: Tensor) -> Tensor:
    rows = mod._vocab_rows
    dim, _ = mod._partition.get(pname, (None, None))
    return t[:rows] if rows is not None and dim == 0 else t


def _param_keys(module: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _optimizer_params(optimizer: Optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state_dict(optimizer: Optimizer, module: nn.Module) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with per-parameter state tensors of TP shards gathered (collective)."""
    owners = tensor_parallel_owners(module)
    keys = _param_keys(module)
    params = _optimizer_params(optimizer)
    state = optimizer.state_dict()
    for index, values in state["state"].items():
        owner = owners.get(keys.get(id(params[index]), ""))
        if owner is None:
            continue
        mod, pname = owner
        local_shape = params[index].shape
        state["state"][index] = {
            k: (mod.gather_global(pname, v).cpu() if isinstance(v, Tensor) and v.shape == local_shape else v)
            for k, v in values.items()
        }
    return state


def shard_optimizer_state_dict(full: Dict[str, Any], optimizer: Optimizer, module: nn.Module) -> Dict[str, Any]:
    """This rank's optimizer state from a full one written by :func:`full_optimizer_state_dict`."""
    owners = tensor_parallel_owners(module)
    keys = _param_keys(module)
    params = _optimizer_params(optimizer)
    state = {"state": {}, "param_groups": full["param_groups"]}
    for index, values in full["state"].items():
        index = int(index)
        owner = owners.get(keys.get(id(params[index]), ""))
        if owner is None:
            state["state"][index] = values
            continue
        mod, pname = owner
        global_shape = mod.global_shape(pname)
        shard = {}
        for k, v in values.items():
            if isinstance(v, Tensor) and v.dim() > 0:
                v = _strip_canonical_padding(mod, pname, v)
                if tuple(v.shape) == tuple(global_shape):
                    v = mod.shard_global(pname, v.to(params[index].device))
            shard[k] = v
        state["state"][index] = shard
    return state
