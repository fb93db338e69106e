"""Each rank's shards of the model and optimizer state, described by their place in the full tp=1, pp=1 tensors,
for ``torch.distributed.checkpoint`` (DCP): a sharded checkpoint that no rank gathers.

The names are those of the full, layout-independent checkpoint (:mod:`lightning_megatron.checkpoint.state_dict`):
``state_dict.<key>`` for the LightningModule's state (layers under their global index) and
``optimizer_states.<i>.state.<parameter name>.<state key>`` for optimizer ``i``. A tensor-parallel (or expert)
parameter becomes a :class:`ShardedEntry`: its local tensor cut into the blocks that are contiguous in the global
tensor, each with its global offsets, found by sharding an index grid with the layer's own ``shard_global`` (so
strided splits, such as SwiGLU's ``[gate; up]`` halves, and a padded vocabulary map correctly). Replicated tensors
are plain tensors (DCP writes them once, whichever ranks hold them). Loading asks DCP for the blocks of the
*current* layout, which reads the overlapping parts of what any other layout wrote: resharding across tp, pp, cp,
ep, dp and the distributed optimizer on/off. A ``DTensor`` (FSDP2) is passed to DCP as it is.

Nothing here communicates; :mod:`lightning_megatron.checkpoint.distributed` does the I/O.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.optim import Optimizer

from lightning_megatron.checkpoint.state_dict import _full_shapes, tensor_parallel_owners

MODEL_PREFIX = "state_dict."
OPTIMIZER_PREFIX = "optimizer_states."

#: one block of a local tensor: (slices into the local tensor, offsets into the global tensor)
Block = Tuple[Tuple[slice, ...], Tuple[int, ...]]


@dataclass
class ShardedEntry:
    """This rank's blocks of one global tensor, in DCP's checkpointable protocol (the one ``DTensor`` implements).

    Attributes:
        global_shape: shape of the full tp=1 tensor.
        blocks: ``(tensor, offsets)`` per block: a view (or copy) of part of the local tensor and where it starts in
            the global tensor. Blocks never overlap.
    """

    global_shape: Tuple[int, ...]
    blocks: List[Tuple[Tensor, Tuple[int, ...]]]

    def size(self) -> torch.Size:
        """The global shape (DCP compares it with the saved one)."""
        return torch.Size(self.global_shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.size()))
                for t, off in self.blocks]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()) for t, off in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for t, off in self.blocks:
            if torch.Size(off) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no local block at global offset {tuple(index.offset)}")


def _runs(line: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Maximal runs of consecutive global indices in ``line`` (1-based; 0 = a padding row that maps nowhere):
    ``(local start, global start, length)``."""
    runs: List[Tuple[int, int, int]] = []
    for i, g in enumerate(line):
        if g == 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == g - 1:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, g - 1, 1))
    return runs


@dataclass
class ShardBlocks:
    """Where a local tensor's parts lie in the full tensor.

    Attributes:
        global_shape: the full tensor's shape (a vocabulary dim padded as at tp=1, as in a full checkpoint).
        blocks: slices of the local tensor and their global offsets.
        zero_pad: ``(offsets, shape)`` of the vocabulary padding rows of the tp=1 layout beyond the true vocabulary,
            zeros in every checkpoint (as in a full one), written by this rank (TP rank 0), else None.
    """

    global_shape: Tuple[int, ...]
    blocks: List[Block]
    zero_pad: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None


def local_blocks(mod: nn.Module, pname: str, local_shape: Sequence[int]) -> ShardBlocks:
    """The :class:`ShardBlocks` of the local tensor (shape ``local_shape``) of sharded parameter ``pname`` of ``mod``
    (a TP layer or expert module): the blocks that are contiguous in the global tensor.

    Each dimension whose local size differs from the global one is probed on its own: an index grid ``1..n``
    along it (size 1 along the other dimensions that differ, sizes of the unsharded ones irrelevant) is passed
    through ``mod.shard_global``; the local positions then name their global index (0 for vocabulary padding).
    """
    true_shape = tuple(int(s) for s in mod.global_shape(pname))
    full_shape = tuple(int(s) for s in _full_shapes(mod, pname)[-1])
    layout = _blocks(mod, pname, true_shape, local_shape)
    layout.global_shape = full_shape
    if full_shape[0] > true_shape[0] and getattr(mod, "tp_rank", 0) == 0:
        layout.zero_pad = ((true_shape[0],) + (0,) * (len(full_shape) - 1),
                           (full_shape[0] - true_shape[0],) + full_shape[1:])
    return layout


def _blocks(mod: nn.Module, pname: str, gshape: Tuple[int, ...], local_shape: Sequence[int]) -> ShardBlocks:
    lshape = tuple(int(s) for s in local_shape)
    dims = [d for d in range(len(gshape)) if gshape[d] != lshape[d]]
    per_dim: Dict[int, List[Tuple[int, int, int]]] = {}
    for d in dims:
        probe = [gshape[i] if i in dims else 1 for i in range(len(gshape))]
        view = [-1 if i == d else 1 for i in range(len(gshape))]
        grid = torch.arange(1, gshape[d] + 1).view(view).expand(probe).contiguous()
        local = mod.shard_global(pname, grid)
        line = local[tuple(slice(None) if i == d else 0 for i in range(local.dim()))]
        if line.numel() != lshape[d]:
            raise RuntimeError(f"{type(mod).__name__}.{pname}: shard_global gives {line.numel()} entries along dim "
                               f"{d}, the local tensor has {lshape[d]}")
        per_dim[d] = _runs(line.tolist())
    blocks: List[Block] = []
    for combo in itertools.product(*(per_dim[d] for d in dims)):
        slices, offsets = [slice(None)] * len(gshape), [0] * len(gshape)
        for d, (lo, go, n) in zip(dims, combo):
            slices[d], offsets[d] = slice(lo, lo + n), go
        blocks.append((tuple(slices), tuple(offsets)))
    return ShardBlocks(gshape, blocks)


class ShardLayout:
    """The block layout of every sharded parameter of ``module`` (computed once, by state-dict key)."""

    def __init__(self, module: nn.Module) -> None:
        self.owners = tensor_parallel_owners(module)
        self.names = {id(p): name for name, p in module.named_parameters()}
        self._cache: Dict[Tuple[str, Tuple[int, ...]], ShardBlocks] = {}

    def blocks(self, key: str, local_shape: Sequence[int]) -> Optional[ShardBlocks]:
        """The :class:`ShardBlocks` of sharded key ``key``, or None for a replicated tensor."""
        owner = self.owners.get(key)
        if owner is None:
            return None
        cache_key = (key, tuple(local_shape))
        if cache_key not in self._cache:
            self._cache[cache_key] = local_blocks(owner[0], owner[1], local_shape)
        return self._cache[cache_key]

    def entry(self, key: str, tensor: Tensor, copy: bool) -> Any:
        """What DCP gets for local tensor ``tensor`` of key ``key``: a :class:`ShardedEntry`, or the tensor itself
        (replicated; a ``DTensor`` too). ``copy``: snapshot the data (asynchronous saves; CPU)."""
        def take(t: Tensor) -> Tensor:
            t = t.detach()
            return t.to("cpu", copy=True).contiguous() if copy else t.contiguous()

        layout = self.blocks(key, tensor.shape) if not _is_dtensor(tensor) else None
        if layout is None:
            return tensor.detach().clone() if copy and _is_dtensor(tensor) else take(tensor)
        blocks = [(take(tensor[s]), off) for s, off in layout.blocks]
        if layout.zero_pad is not None:
            offsets, shape = layout.zero_pad
            blocks.append((torch.zeros(shape, dtype=tensor.dtype, device="cpu" if copy else tensor.device), offsets))
        return ShardedEntry(layout.global_shape, blocks)

    def target(self, key: str, tensor: Tensor) -> Any:
        """Load target for local tensor ``tensor`` (filled in place by DCP; blocks are views into it)."""
        layout = self.blocks(key, tensor.shape) if not _is_dtensor(tensor) else None
        if layout is None:
            return tensor
        return ShardedEntry(layout.global_shape, [(tensor[s], off) for s, off in layout.blocks])


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# ---------------------------------------------------------------------------------------------- model
def model_entries(module: nn.Module, state: Dict[str, Any], layout: ShardLayout, copy: bool) -> Dict[str, Any]:
    """``state`` (``module.state_dict()``: this rank's stage and shards) as DCP entries under ``state_dict.``."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        out[MODEL_PREFIX + key] = layout.entry(key, value, copy) if isinstance(value, Tensor) else value
    return out


def model_targets(state: Dict[str, Any], layout: ShardLayout, saved: Metadata) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Load targets for the keys of ``state`` present in the checkpoint: ``(DCP state, local tensors)``; local
    tensors start at zero (vocabulary padding rows stay zero, as a full checkpoint loads them)."""
    dcp_state, local = {}, {}
    for key, value in state.items():
        fqn = MODEL_PREFIX + key
        if fqn not in saved.state_dict_metadata:
            continue
        if isinstance(value, Tensor) and not _is_dtensor(value):
            local[key] = torch.zeros_like(value, device="cpu")
            dcp_state[fqn] = layout.target(key, local[key])
        elif isinstance(value, Tensor):
            local[key] = value
            dcp_state[fqn] = value
        else:
            dcp_state[fqn] = None
    return dcp_state, local


def saved_model_keys(saved: Metadata) -> List[str]:
    """The model keys a DCP checkpoint holds."""
    return [k[len(MODEL_PREFIX):] for k in saved.state_dict_metadata if k.startswith(MODEL_PREFIX)]


# ---------------------------------------------------------------------------------------------- optimizer
def inner_optimizers(optimizer: Any) -> List[Optimizer]:
    """The torch optimizers that hold ``optimizer``'s states on this rank: itself, or the local optimizer of a
    ``ZeroRedundancyOptimizer`` (its share of the parameters), or those of an ``ExpertShardedOptimizer``'s parts."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_megatron.parallel.distributed_optimizer import ExpertShardedOptimizer

    from lightning_megatron.parallel.param_buffer.optimizer import DistributedOptimizer, WholeStateView

    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(optimizer, DistributedOptimizer):   # the whole states, gathered (every rank writes the same)
        return [WholeStateView(optimizer)]   # type: ignore[list-item]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return [optimizer.optim]
    if isinstance(optimizer, ExpertShardedOptimizer):
        return [zero.optim for zero, _ in optimizer.parts]
    return [optimizer]


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def optimizer_entries(index: int, optimizer: Any, layout: ShardLayout, copy: bool) -> Tuple[Dict[str, Any], Any]:
    """This rank's optimizer states as DCP entries (``optimizer_states.<index>.state.<name>.<key>``), and the
    hyper-parameters of the parameter groups (the same on every rank; saved with the loop state). Under the
    distributed optimizer a rank holds, and writes, the states of its share of the parameters only."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    out: Dict[str, Any] = {}
    for inner in inner_optimizers(optimizer):
        for p, values in inner.state.items():
            name = layout.names[id(p)]
            for k, v in values.items():
                fqn = f"{OPTIMIZER_PREFIX}{index}.state.{name}.{k}"
                if isinstance(v, Tensor) and v.shape == p.shape:
                    out[fqn] = layout.entry(name, v, copy)
                elif isinstance(v, Tensor):
                    out[fqn] = v.detach().to("cpu", copy=True) if copy else v.detach()
                else:
                    out[fqn] = v
    return out, [_hyper(g) for g in optimizer.param_groups]


@dataclass
class LoadedOptimizerState:
    """Optimizer states read from a sharded checkpoint for this rank, applied by :func:`apply_optimizer_state`."""

    per_inner: List[Dict[int, Dict[str, Any]]]
    hyper: List[Dict[str, Any]]


def optimizer_targets(index: int, optimizer: Any, layout: ShardLayout, saved: Metadata,
                      hyper: List[Dict[str, Any]]) -> Tuple[Dict[str, Any], LoadedOptimizerState]:
    """Load targets for the states of the parameters whose states this rank keeps (allocated from the saved
    metadata: the state of a parameter holding the parameter's local shape, others their saved shape)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    by_name: Dict[str, List[Tuple[str, str]]] = {}
    prefix = f"{OPTIMIZER_PREFIX}{index}.state."
    dcp_state: Dict[str, Any] = {}
    per_inner: List[Dict[int, Dict[str, Any]]] = []
    names = set(layout.names.values())
    for fqn in saved.state_dict_metadata:
        if fqn.startswith(prefix):
            rest = fqn[len(prefix):]
            name, _, key = rest.rpartition(".")
            if name in names:
                by_name.setdefault(name, []).append((key, fqn))
    for inner in inner_optimizers(optimizer):
        states: Dict[int, Dict[str, Any]] = {}
        params = [p for g in inner.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            name = layout.names[id(p)]
            entry: Dict[str, Any] = {}
            for key, fqn in by_name.get(name, []):
                md = saved.state_dict_metadata[fqn]
                if isinstance(md, BytesStorageMetadata):
                    dcp_state[fqn] = None
                    entry[key] = (fqn, None)
                    continue
                assert isinstance(md, TensorStorageMetadata)
                sharded = layout.blocks(name, p.shape)
                if sharded is not None and tuple(md.size) == sharded.global_shape:
                    t = torch.zeros(p.shape, dtype=md.properties.dtype)
                    dcp_state[fqn] = layout.target(name, t)
                elif tuple(md.size) == tuple(p.shape):
                    t = torch.zeros(p.shape, dtype=md.properties.dtype)
                    dcp_state[fqn] = t
                else:
                    t = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                    dcp_state[fqn] = t
                entry[key] = (fqn, t)
            if entry:
                states[i] = entry
        per_inner.append(states)
    return dcp_state, LoadedOptimizerState(per_inner, hyper)


def apply_optimizer_state(optimizer: Any, loaded: LoadedOptimizerState, dcp_state: Dict[str, Any]) -> None:
    """Set the saved hyper-parameters on ``optimizer``'s groups and load the read states into the optimizers that
    keep them (``Optimizer.load_state_dict`` casts them to each parameter's device and dtype)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if len(loaded.hyper) != len(optimizer.param_groups):
        raise RuntimeError(f"the checkpoint's optimizer has {len(loaded.hyper)} parameter groups, this one "
                           f"{len(optimizer.param_groups)}: configure_optimizers must build the same groups")
    for group, hyper in zip(optimizer.param_groups, loaded.hyper):
        group.update(hyper)
    for inner, states in zip(inner_optimizers(optimizer), loaded.per_inner):
        state = {i: {k: (dcp_state[fqn] if t is None else t) for k, (fqn, t) in entry.items()}
                 for i, entry in states.items()}
        groups, start = [], 0
        for g in inner.param_groups:
            groups.append({**_hyper(g), "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        inner.load_state_dict({"state": state, "param_groups": groups})
