"""Activation recompute (Megatron's ``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``,
``--recompute-modules``): keep fewer activations in forward and compute them again in backward.

:func:`apply_recompute` (a step of :func:`lightning_megatron.parallelize`) changes how a
:class:`~lightning_megatron.contract.RecomputeModel` runs, never what it computes:

* ``recompute_granularity="full"``: groups of consecutive transformer layers run under
  :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): only each group's input is kept and the group's
  forward runs again in backward. A *chunk* is the run of layers one ``run_layers`` call gets (the whole model,
  one pipeline stage, or one virtual-pipeline chunk). ``recompute_method="uniform"``: every layer of a chunk, in
  groups of ``recompute_num_layers`` layers checkpointed as one unit (a chunk's last group may be smaller);
  ``"block"``: the first ``recompute_num_layers`` layers of each chunk, each its own unit; the others keep
  everything (Megatron's semantics; a chunk with fewer layers recomputes all of them).
* ``recompute_granularity="selective"``: only the parts named in ``recompute_modules`` (Megatron's names, default
  ``["core_attn"]``). ``core_attn`` (softmax(QK^T)V with its dropout), ``mlp`` (the dense MLP), ``moe`` (the whole
  MoE layer) and ``shared_experts`` are checkpointed like the full layers. ``layernorm`` (both norms of a layer)
  and ``moe_act`` (the experts' activation) use *output-discarding* recompute, as Megatron does: the function runs
  normally, and where a later op keeps its output for backward (the next linear's input), the kept tensor is
  replaced by a recipe that recomputes it, once, when backward first needs it (torch saved-tensor hooks around the
  layers). Under autocast a discarded float32 output that feeds a single linear layer is handed on in the autocast
  dtype (what that layer casts it to anyway), so the kept copy is the output itself (a norm before an MoE layer
  feeds several consumers and stays float32, saving memory only without autocast); under sequence parallelism the
  column-parallel layers next to a recomputed norm then keep only their local input and all-gather it again in
  backward (``recompute_input_gather``, Megatron's behaviour), else they would keep the gathered copy.

Exact replay: torch's checkpoint restores the default CPU / CUDA generators for the recomputed forward
(``preserve_rng_state``); the tensor-parallel stream (:class:`TensorParallelRNG`, dropout inside TP regions and
everywhere under sequence parallelism) is a swapped-in generator state torch does not know about, so each
checkpointed call snapshots it on entry and the recomputed forward runs from that snapshot, after which the stream
continues where it was (Megatron's CUDA RNG tracker semantics). Modules that record state in forward
(:class:`~lightning_megatron.contract.ReplayAware`, e.g. the MoE routers' token counts and aux-loss records) are
told they are replaying and record nothing. Replays compute the same values in the same order, so losses and
gradients are bit-for-bit those of a run without recompute. Collectives inside a checkpointed part (TP, CP, EP)
run again in the recompute, on every rank of their group in the same order. Recompute is skipped where gradients
are off (evaluation).
"""
from __future__ import annotations

import functools
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_megatron.contract import RecomputeModel, ReplayAware
from lightning_megatron.parallel.layout_rules import OUTPUT_DISCARDING, check_recompute_layers
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG

if TYPE_CHECKING:
    from lightning_megatron.parallel.config import ParallelConfig

_WHAT = {"core_attn": "attention", "layernorm": "layer norms", "mlp": "dense MLP layer", "moe": "MoE layer",
         "shared_experts": "MoE layer with shared experts", "moe_act": "MoE layer"}


# ------------------------------------------------------------------------------------------------- replay
class _Replay:
    """State shared by the forward and recompute contexts of one checkpointed call."""

    def __init__(self, rng: Optional[TensorParallelRNG], aware: List[nn.Module]) -> None:
        self.rng, self.aware = rng, aware
        self.snapshot: Optional[Tensor] = None
        self.resume: Optional[Tensor] = None


class _ForwardContext:
    """Around the first forward: snapshot the tensor-parallel stream."""

    def __init__(self, replay: _Replay) -> None:
        self.replay = replay

    def __enter__(self) -> None:
        if self.replay.rng is not None:
            self.replay.snapshot = self.replay.rng.get_state()

    def __exit__(self, *exc: Any) -> bool:
        return False


class _RecomputeContext:
    """Around each recompute (a split backward recomputes twice, so this is re-entered): the tensor-parallel stream
    replays from the snapshot and then continues where it was; replay-aware modules record nothing."""

    def __init__(self, replay: _Replay) -> None:
        self.replay = replay

    def __enter__(self) -> None:
        r = self.replay
        if r.rng is not None:
            r.resume = r.rng.get_state()
            r.rng.set_state(r.snapshot)
        for m in r.aware:
            m.recomputing = True

    def __exit__(self, *exc: Any) -> bool:
        r = self.replay
        for m in r.aware:
            m.recomputing = False
        if r.rng is not None:
            r.rng.set_state(r.resume)
            r.resume = None
        return False


def _replay_aware(module: nn.Module) -> List[nn.Module]:
    return [m for m in module.modules() if isinstance(m, ReplayAware)]


@torch.compiler.disable
def checkpointed(fn: Callable[..., Any], *args: Any, tp_rng: Optional[TensorParallelRNG] = None,
                 aware: Sequence[nn.Module] = (), **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant :func:`torch.utils.checkpoint.checkpoint`: only the inputs are
    kept and ``fn`` runs again in backward, with the default generators restored (torch), the tensor-parallel
    stream ``tp_rng`` replayed from its state at this call, and the ``aware`` modules'
    :attr:`~lightning_megatron.contract.ReplayAware.recomputing` set during the replay. Without gradients, a plain
    call."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    replay = _Replay(tp_rng, list(aware))
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (_ForwardContext(replay), _RecomputeContext(replay)), **kwargs)


class _CheckpointedCall:
    """Replaces a module's method: the class's method under :func:`checkpointed`."""

    def __init__(self, function: Callable[..., Any], tp_rng: Optional[TensorParallelRNG]) -> None:
        self.function, self.tp_rng = function, tp_rng

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpointed(functools.partial(self.function, module), *args, tp_rng=self.tp_rng,
                            aware=_replay_aware(module), **kwargs)


def recompute_groups(keys: Sequence[str], method: str, num_layers: int) -> List[Tuple[List[str], bool]]:
    """How full recompute runs one chunk's layers ``keys``: ``[(consecutive keys, checkpointed as one unit)]``."""
    keys = list(keys)
    if method == "uniform":
        return [(keys[i:i + num_layers], True) for i in range(0, len(keys), num_layers)]
    head = [([k], True) for k in keys[:num_layers]]
    return head + ([(keys[num_layers:], False)] if len(keys) > num_layers else [])


class _LayerGroups:
    """Replaces ``model.run_layers`` under full recompute: each chunk's layers in :func:`recompute_groups`."""

    def __init__(self, function: Callable[..., Tensor], method: str, num_layers: int,
                 tp_rng: Optional[TensorParallelRNG]) -> None:
        self.function, self.method, self.num_layers, self.tp_rng = function, method, num_layers, tp_rng

    def __call__(self, model: nn.Module, keys: Sequence[str], x: Tensor, rotary: Any,
                 document_ids: Optional[Tensor] = None) -> Tensor:
        run = functools.partial(self.function, model)
        if not torch.is_grad_enabled():
            return run(keys, x, rotary, document_ids)
        aware = _replay_aware(model)
        for group, checkpoint_it in recompute_groups(keys, self.method, self.num_layers):
            if checkpoint_it:
                x = checkpointed(run, group, x, rotary, document_ids, tp_rng=self.tp_rng, aware=aware)
            else:
                x = run(group, x, rotary, document_ids)
        return x


# ------------------------------------------------------------------------------------------------- output discarding
class _Discarded:
    """One output-discarding call: its output (weakly), how to compute it again, and the value once recomputed."""

    def __init__(self, out: Tensor, fn: Callable[..., Tensor], args: tuple, cast: Optional[torch.dtype],
                 autocast: Tuple[str, bool, torch.dtype]) -> None:
        self.out = weakref.ref(out)
        self.fn, self.args, self.cast, self.autocast = fn, args, cast, autocast
        self.value: Optional[Tensor] = None

    def recompute(self) -> Tensor:
        if self.value is None:
            device_type, enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                value = self.fn(*self.args)
                if self.cast is not None:
                    value = value.to(self.cast)
            self.value = value.contiguous()
        return self.value


class _Recipe:
    """What autograd keeps instead of a discarded output (or a view of it): recomputed on unpack."""

    def __init__(self, record: _Discarded, t: Tensor) -> None:
        self.record = record
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> Tensor:
        return self.record.recompute().as_strided(self.size, self.stride, self.offset)


class _DiscardScope:
    """The output-discarding calls of one ``run_layers`` call, by storage (set while it runs)."""

    def __init__(self) -> None:
        self.records: Optional[Dict[int, _Discarded]] = None

    def add(self, record: _Discarded, out: Tensor) -> None:
        if self.records is not None:
            self.records[out.untyped_storage().data_ptr()] = record

    def pack(self, t: Tensor) -> Any:
        records = self.records
        if not records or t.device.type == "meta":
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        record = records.get(ptr)
        if record is None:
            return t
        out = record.out()
        if out is None:  # freed: the address may now belong to another tensor
            del records[ptr]
            return t
        if t.dtype != out.dtype or t.device != out.device:
            return t
        return _Recipe(record, t)

    @staticmethod
    def unpack(saved: Any) -> Any:
        return saved.unpack() if isinstance(saved, _Recipe) else saved


class _OutputDiscardingCall:
    """Replaces a module's method: the class's method, its output registered for discarding (see the module
    docstring)."""

    def __init__(self, function: Callable[..., Tensor], scope: _DiscardScope, single_consumer: bool) -> None:
        self.function, self.scope, self.single_consumer = function, scope, single_consumer

    @torch.compiler.disable
    def __call__(self, module: nn.Module, *args: Any) -> Tensor:
        out = self.function(module, *args)
        if self.scope.records is None or not torch.is_grad_enabled() or not isinstance(out, Tensor):
            return out
        device_type = out.device.type
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
        cast = (dtype if self.single_consumer and enabled and out.dtype == torch.float32 and dtype != out.dtype
                else None)
        if cast is not None:
            out = out.to(cast)
        whole = (out.numel() > 0 and out.is_contiguous() and out.storage_offset() == 0
                 and out.untyped_storage().nbytes() == out.numel() * out.element_size())
        if out.requires_grad and whole:
            record = _Discarded(out, functools.partial(self.function, module), args, cast,
                                (device_type, enabled, dtype))
            self.scope.add(record, out)
        return out


class _DiscardingRun:
    """Replaces ``model.run_layers`` under selective recompute with output-discarding names: the layers run under
    saved-tensor hooks that keep recipes instead of the discarded outputs."""

    def __init__(self, function: Callable[..., Tensor], scope: _DiscardScope) -> None:
        self.function, self.scope = function, scope

    def __call__(self, model: nn.Module, keys: Sequence[str], x: Tensor, rotary: Any,
                 document_ids: Optional[Tensor] = None) -> Tensor:
        run = functools.partial(self.function, model)
        if not torch.is_grad_enabled():
            return run(keys, x, rotary, document_ids)
        scope = self.scope
        outer, scope.records = scope.records, {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack):
                return run(keys, x, rotary, document_ids)
        finally:
            scope.records = outer


# ------------------------------------------------------------------------------------------------- apply
def _override(module: nn.Module, name: str, call: Any) -> None:
    """Bind ``call(module, ...)`` as ``module.<name>`` (an instance attribute: names, parameters and state dicts
    stay as they were; a deep copy rebinds it to the copy)."""
    if name in module.__dict__:
        raise RuntimeError(f"{type(module).__name__}.{name} is already replaced on this instance: apply_recompute was "
                           "applied to this model twice")
    setattr(module, name, types.MethodType(call, module))


def _regather_next_to(norms: List[nn.Module], root: nn.Module) -> None:
    """Column-parallel layers in the parent modules of ``norms`` keep only their local input under SP."""
    from lightning_megatron.parallel.tensor_parallel.layers import ColumnParallelLinear

    ids = {id(n) for n in norms}
    for parent in root.modules():
        if any(id(child) in ids for child in parent.children()):
            for m in parent.modules():
                if isinstance(m, ColumnParallelLinear):
                    m.recompute_input_gather = True


def apply_recompute(module: nn.Module, config: "ParallelConfig",
                    tp_rng: Optional[TensorParallelRNG] = None) -> List[nn.Module]:
    """Activation recompute (see the module docstring) for every
    :class:`~lightning_megatron.contract.RecomputeModel` in ``module``, as ``config``'s ``recompute_*`` fields
    ask; a no-op when ``config.recompute_granularity`` is None. Run it after TP / CP / EP and before the pipeline
    split (the strategy's :func:`~lightning_megatron.parallelize` does). No communication.

    Args:
        tp_rng: this rank's tensor-parallel stream (the one the model's ``tp_fork`` enters), replayed in recomputed
            forwards; None when the model has no such stream.

    Returns:
        the models recompute was applied to.

    Raises:
        ValueError: no model implements the contract; ``recompute_num_layers`` larger than the model's layers per
            chunk; a ``recompute_modules`` name the model has no part for.
    """
    granularity = config.recompute_granularity
    if granularity is None:
        return []
    models = [m for m in module.modules() if isinstance(m, RecomputeModel)]
    if not models:
        raise ValueError(
            f"recompute_granularity={granularity!r} but {type(module).__name__} contains no model implementing "
            "lightning_megatron.contract.RecomputeModel (layer_keys, run_layers, recompute_targets), as "
            "lightning_megatron.GPTModel does")
    for model in models:
        check_recompute_layers(config, len(model.layer_keys()))
        if granularity == "full":
            _override(model, "run_layers", _LayerGroups(type(model).run_layers, config.recompute_method,
                                                        config.recompute_num_layers, tp_rng))
            continue
        scope: Optional[_DiscardScope] = None
        for name in config.recompute_modules:
            targets = model.recompute_targets(name)
            if not targets:
                raise ValueError(f"recompute_modules contains {name!r} but {type(model).__name__} has no "
                                 f"{_WHAT.get(name, name)} to recompute")
            for target in targets:
                function = getattr(type(target.module), target.method)
                if name in OUTPUT_DISCARDING:
                    scope = scope or _DiscardScope()
                    call: Any = _OutputDiscardingCall(function, scope, target.single_consumer)
                else:
                    call = _CheckpointedCall(function, tp_rng)
                _override(target.module, target.method, call)
            if name == "layernorm":
                _regather_next_to([t.module for t in targets], model)
        if scope is not None:
            _override(model, "run_layers", _DiscardingRun(type(model).run_layers, scope))
    return models
