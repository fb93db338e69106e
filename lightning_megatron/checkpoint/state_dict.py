"""Layout-independent (full, unsharded) model and optimizer state from tensor/pipeline-parallel shards and back.

A checkpoint written from these functions holds every tensor in the layout of the plain tp=1, pp=1 model
(the vocabulary padded as at tp=1; layers under their global index; all experts, by global expert index, with
their full ffn dimension), so it loads under any tp/pp/dp/ep/etp layout,
and into a plain ``GPTModel``. Optimizer state is keyed by parameter *name*, not by position, for the same
reason. Gathering is collective over each layer's TP group (experts: ETP then EP group) and over the pipeline
group: call on every rank. Under FSDP (``data_parallel_sharding_strategy`` ``optim_grads`` / ``optim_grads_params``)
parameters and optimizer states are ``DTensor`` s over dp x cp (experts: edp): they are gathered into the
tensor-parallel shard first (collective over that group), and the loading side lays the shard out as the
parameter again (:func:`~lightning_megatron.parallel.fsdp.distribute_like`, no communication).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_megatron.parallel.tensor_parallel.layers import TensorParallelModule

Owner = Tuple[TensorParallelModule, str]


def _is_sharded_module(mod: nn.Module) -> bool:
    """A TP layer, or any module mapping its parameters onto global tensors the same way (``global_shape``,
    ``shard_global``, ``gather_global``; e.g. the experts of one EP/ETP rank)."""
    return isinstance(mod, TensorParallelModule) or all(
        hasattr(mod, a) for a in ("global_shape", "shard_global", "gather_global"))


def tensor_parallel_owners(module: nn.Module) -> Dict[str, Owner]:
    """``state-dict key -> (sharded module, parameter name)`` for every parameter of a TP layer (or of an expert
    module, sharded over EP/ETP) in ``module``."""
    owners: Dict[str, Owner] = {}
    for mod_name, mod in module.named_modules():
        if _is_sharded_module(mod):
            for pname, _ in mod.named_parameters(recurse=False):
                owners[f"{mod_name}.{pname}" if mod_name else pname] = (mod, pname)
    return owners


def _merge_over(group: Optional[dist.ProcessGroup], local: Dict[str, Any]) -> Dict[str, Any]:
    """Union of every rank's dict over ``group``; for keys several ranks hold, the lowest rank's value."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    gathered: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    merged: Dict[str, Any] = {}
    for part in gathered:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


def full_model_state_dict(module: nn.Module, pp_group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """``module.state_dict()`` with TP shards gathered and pipeline stages merged (collective)."""
    owners = tensor_parallel_owners(module)
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
    for key, (mod, pname) in owners.items():
        if key in state:
            state[key] = mod.gather_global(pname, state[key])
    state = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}
    return _merge_over(pp_group, state)


def _strip_canonical_padding(mod: TensorParallelModule, pname: str, t: Tensor) -> Tensor:
    rows = getattr(mod, "_vocab_rows", None)
    if rows is None:
        return t
    dim, _ = mod._partition.get(pname, (None, None))
    return t[:rows] if rows is not None and dim == 0 else t


def _full_shapes(mod: nn.Module, pname: str) -> List[Tuple[int, ...]]:
    """The shapes a full (checkpoint) tensor of sharded parameter ``pname`` may have: the global shape, with a
    vocabulary dim either as the true vocabulary or padded as at tp=1 (how :func:`full_model_state_dict` writes it)."""
    shape = tuple(mod.global_shape(pname))
    rows, canonical = getattr(mod, "_vocab_rows", None), getattr(mod, "_canonical_rows", None)
    dim = getattr(mod, "_partition", {}).get(pname, (None, None))[0]
    if rows is not None and canonical is not None and dim == 0:
        return [shape, (canonical,) + shape[1:]]
    return [shape]


def _quoted(keys: List[str]) -> str:
    return ", ".join(f'"{k}"' for k in keys)


def shard_model_state_dict(module: nn.Module, full: Dict[str, Any], strict: bool = True,
                           pp_group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """This rank's part of the full state ``full``: its pipeline stage's keys, TP-sharded.

    ``strict`` (Lightning's ``strict_loading``, as ``nn.Module.load_state_dict``): a key of the model missing from
    ``full``, or a key of ``full`` that no pipeline stage of the model has, raises RuntimeError naming them (torch's
    wording); without it missing keys are left out (load with ``strict=False``) and unexpected ones ignored. A
    full tensor whose shape is not the model's global shape (e.g. another vocabulary or hidden size) raises in
    either mode. Every rank of ``pp_group`` (the pipeline group, whose stages hold different keys) decides on the
    union of their keys and problems (one ``all_gather_object``), so all raise together.
    """
    owners = tensor_parallel_owners(module)
    local_keys = list(module.state_dict().keys())
    bad_shapes = []
    for key, (mod, pname) in owners.items():
        value = full.get(key)
        if isinstance(value, Tensor) and tuple(value.shape) not in _full_shapes(mod, pname):
            bad_shapes.append(f'size mismatch for "{key}": the checkpoint holds shape {tuple(value.shape)}, the '
                              f"model's full tensor has shape {_full_shapes(mod, pname)[-1]}")
    model_keys, problems = set(local_keys), bad_shapes
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        gathered: List[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, (local_keys, bad_shapes), group=pp_group)
        model_keys = {k for keys, _ in gathered for k in keys}
        problems = [p for _, shapes in gathered for p in shapes]
    errors = list(dict.fromkeys(problems))
    shapes_wrong = bool(errors)
    if strict:
        missing = sorted(k for k in model_keys if k not in full)
        unexpected = [k for k in full if k not in model_keys]
        if missing:
            errors.insert(0, f"Missing key(s) in state_dict: {_quoted(missing)}.")
        if unexpected:
            errors.insert(len(missing) > 0, f"Unexpected key(s) in state_dict: {_quoted(unexpected)}.")
    if errors:
        hint = ("The checkpoint is of a model of another shape (layers, vocabulary, sizes, MoE, tied embeddings); "
                "build the model it was saved from" + (", or load the common keys with strict_loading=False"
                                                        if not shapes_wrong else ""))
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
                           + "\n\t".join(errors) + f"\n{hint}")
    state = {k: full[k] for k in local_keys if k in full}
    for key, (mod, pname) in owners.items():
        if key in state:
            state[key] = mod.shard_global(pname, _strip_canonical_padding(mod, pname, state[key]))
    return state


def _param_names(module: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def full_optimizer_state_dict(optimizer: Optimizer, module: nn.Module,
                              pp_group: Optional[dist.ProcessGroup] = None,
                              raw: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Optimizer state keyed by parameter name, TP shards gathered, pipeline stages merged (collective).

    Format: ``{"state": {name: {key: value}}, "param_groups": [{hyper-parameters..., "params": [names]}]}``.
    Parameters not in ``module`` are not supported. ``raw``: the optimizer's whole state in ``state_dict()``
    form when ``optimizer.state_dict()`` does not give it (a sharded optimizer: see
    :func:`lightning_megatron.parallel.distributed_optimizer.gathered_state_dict`).
    """
    owners = tensor_parallel_owners(module)
    names = _param_names(module)
    raw = optimizer.state_dict() if raw is None else raw
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: Dict[str, Any] = {}
    for index, values in raw["state"].items():
        p = params[index]
        name = names[id(p)]
        owner = owners.get(name)
        entry = {}
        for k, v in values.items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if isinstance(v, Tensor) and owner is not None and v.shape == p.shape:
                v = owner[0].gather_global(owner[1], v)
            entry[k] = v.detach().cpu() if isinstance(v, Tensor) else v
        state[name] = entry
    groups = []
    for group, raw_group in zip(optimizer.param_groups, raw["param_groups"]):
        hyper = {k: v for k, v in raw_group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    merged_state = _merge_over(pp_group, state)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        gathered: List[Optional[List[List[str]]]] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, [g["params"] for g in groups], group=pp_group)
        for i, g in enumerate(groups):
            seen = []
            for part in gathered:
                for n in part[i]:
                    if n not in seen:
                        seen.append(n)
            g["params"] = seen
    return {"state": merged_state, "param_groups": groups}


def shard_optimizer_state_dict(full: Dict[str, Any], optimizer: Optimizer, module: nn.Module) -> Dict[str, Any]:
    """A ``optimizer.load_state_dict`` argument for this rank from a full, name-keyed optimizer state (per-parameter
    states of an FSDP-sharded parameter laid out as that parameter)."""
    from lightning_megatron.parallel.fsdp import distribute_like

    owners = tensor_parallel_owners(module)
    names = _param_names(module)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: Dict[int, Any] = {}
    for index, p in enumerate(params):
        name = names[id(p)]
        if name not in full["state"]:
            continue
        owner = owners.get(name)
        entry = {}
        for k, v in full["state"][name].items():
            if isinstance(v, Tensor) and v.dim() > 0 and owner is not None:
                v = _strip_canonical_padding(owner[0], owner[1], v)
                if tuple(v.shape) == tuple(owner[0].global_shape(owner[1])):
                    v = owner[0].shard_global(owner[1], v)
            if isinstance(v, Tensor) and isinstance(p, DTensor) and tuple(v.shape) == tuple(p.shape):
                v = distribute_like(p, v)
            entry[k] = v
        state[index] = entry
    groups, start = [], 0
    for group, saved in zip(optimizer.param_groups, full["param_groups"]):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": groups}
