"""Megatron's distributed optimizer over the contiguous buffers of bf16 parameters (``--bf16
--use-distributed-optimizer``): the fp32 main parameters and the optimizer states sharded over data parallel, the bf16
parameters all-gathered after each step.

:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams` keeps bf16 parameters, their fp32 main parameters and their
fp32 main gradients as views into buckets of flat buffers. :class:`DistributedOptimizer` cuts every bucket into
``size`` equal runs (the bucket's data-parallel group: dp x cp, routed experts' buckets expert data parallel) and
keeps, on each rank, only its run of the fp32 main parameters (:meth:`MainParams.shard`). The user's optimizer is
rebuilt over *fragments*: for every parameter, the part of it that lies in this rank's run, a 1-D view of the
bucket's main-parameter shard, in the parameter's group. A step:

1. each bucket's main gradients were reduce-scattered over its group (:meth:`MainParams.overlap_reduction`, inside
   the backward with ``overlap_grad_reduce``): this rank holds the average of its run, zeros elsewhere, so the
   clipping norm and the non-finite checks sum the ranks' parts over the group; each fragment's gradient is the
   matching view of the run;
2. the rebuilt optimizer steps the fragments (this rank's run: ``1 / size`` of the elements);
3. each bucket's run of bf16 copies (with remainders: and of remainders) is written from the stepped run;
4. each bucket's bf16 buffer is all-gathered over its group, in place, blocking or (``overlap_param_gather``)
   asynchronously, a forward pre-hook of each module waiting for its parameters' buckets
   (:class:`BucketParamGather`).

Communication per step and bucket: one reduce-scatter of the gradients and one all-gather of the bf16 parameters
(together an all-reduce's traffic). Static memory per parameter: 2 bytes (bf16 parameter) + 4 (fp32 main gradient, during a step) + 4 / size (fp32 main
parameter; with remainders 2 / size) + the optimizer states / size (Adam: 8, bf16 moments 4): Megatron's
``2 + 4 + 12 / dp``.

The update must be elementwise (``torch.optim.SGD``, ``Adam``, ``AdamW``,
:class:`~lightning_megatron.optimizer.PrecisionAwareAdamW`): a fragment's update then equals the whole parameter's
on those elements, bit for bit. Checkpoints hold the whole, layout-independent state (:meth:`gathered_state_dict`,
collective) and load into any layout (:meth:`load_state_dict` keeps this rank's fragments).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_megatron.optimizer import PrecisionAwareAdamW
from lightning_megatron.optimizer.param_groups import constructor_kwargs, indexed_param_groups
from lightning_megatron.parallel.param_buffer.buffer import MainParams

__all__ = ["DistributedOptimizer", "BucketParamGather", "WholeStateView", "ELEMENTWISE_OPTIMIZERS", "elementwise"]

#: optimizer classes whose update of an element depends on that element's gradient and states alone (a fragment's
#: update equals the whole parameter's there)
ELEMENTWISE_OPTIMIZERS: Tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, PrecisionAwareAdamW)


def elementwise(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` (exactly one of :data:`ELEMENTWISE_OPTIMIZERS`, not a subclass, whose update could read
    other elements) can step fragments of its parameters."""
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS


@dataclass(eq=False)
class _Fragment:
    """This rank's part of parameter ``param``: its flat elements ``[first, first + numel)``, the bucket's
    ``[lo, hi)``, stepped as ``tensor`` (a leaf over the bucket's main-parameter shard)."""

    param: nn.Parameter
    bucket: Any
    lo: int
    hi: int
    first: int
    tensor: nn.Parameter


class DistributedOptimizer(Optimizer):
    """``optimizer`` (not yet stepped, of an elementwise class: :func:`elementwise`) with its fp32 main parameters
    and states sharded over data parallel, for a model whose bf16 parameters ``main_params`` holds.

    Args:
        optimizer: the user's optimizer over the model's parameters; its class, defaults and parameter groups are
            kept (``param_groups`` are its group dicts: an LR scheduler's writes reach the rebuilt optimizer, whose
            hyper-parameters follow before every step).
        main_params: the model's :class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`, sharded here
            (:meth:`MainParams.shard`).
        group_of: a bucket's data-parallel ``(group, size, rank)`` (dp x cp; expert buckets: expert data parallel).
        grad_dtype: the main gradients' dtype (``torch.bfloat16`` with ``grad_reduce_in_bf16``: Megatron's bf16
            buffers, ``2 + 2 + 12 / dp`` bytes per parameter; each fragment's gradient is its fp32 copy in the step).

    ``state`` stays empty (the rebuilt optimizer, :attr:`inner`, holds the fragments' states). Communication: one
    all-gather of each bucket's bf16 buffer over its group per step (:meth:`gather_params`); checkpoints gather the
    states over the same groups.
    """

    def __init__(self, optimizer: Optimizer, main_params: MainParams,
                 group_of: Callable[[Any], Tuple[Any, int, int]], grad_dtype: Optional[torch.dtype] = None) -> None:
        if not elementwise(optimizer):
            raise ValueError(f"DistributedOptimizer: {type(optimizer).__name__} is not one of the elementwise "
                             f"optimizers {[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}, whose update of a shard of a "
                             "parameter equals the whole parameter's there")
        if optimizer.state:
            raise RuntimeError(f"DistributedOptimizer: {type(optimizer).__name__} already has state; shard it before "
                               "the first step")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        #: the user's optimizer (stateless; its class and options decide what the rebuilt one does)
        self.original = optimizer
        self.main_params = main_params
        if not main_params.sharded:
            main_params.shard(group_of, grad_dtype)
        self.fragments: List[_Fragment] = []
        #: per group of ``param_groups``: its parameters' fragments
        self._group_fragments: List[List[_Fragment]] = []
        owned = {id(p) for p in main_params.params}
        for group in self.param_groups:
            frags = []
            for p in group["params"]:
                if id(p) not in owned:
                    raise ValueError(f"DistributedOptimizer: a parameter of shape {tuple(p.shape)} is not one of the "
                                     "model's bf16 parameters (MainParams)")
                placed = main_params.shard_fragments(p)
                if placed is None:
                    continue
                bucket, lo, hi, offset = placed
                frag = _Fragment(p, bucket, lo, hi, lo - offset, nn.Parameter(self._main_view(bucket, lo, hi)))
                frags.append(frag)
            self._group_fragments.append(frags)
            self.fragments += frags
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [f.tensor for f in frags]}
                        for g, frags in zip(self.param_groups, self._group_fragments)]
        #: the user's optimizer class over this rank's fragments (None when this rank holds no element)
        self.inner: Optional[Optimizer] = (type(optimizer)(inner_groups, **constructor_kwargs(optimizer))
                                           if self.fragments else None)
        self._step_supports_amp_scaling = bool(getattr(self.inner, "_step_supports_amp_scaling", False))
        #: the asynchronous parameter gather (``overlap_param_gather``), or None: blocking
        self.param_gather: Optional["BucketParamGather"] = None

    def _main_view(self, bucket: Any, lo: int, hi: int) -> Tensor:
        start = bucket.shard.start
        return self.main_params.shard_main(bucket)[lo - start:hi - start]

    def _sync_hyperparameters(self) -> None:
        if self.inner is None:
            return
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (with gradients on), step this rank's fragments, write the bf16 copies of every bucket's
        shard and all-gather the buckets (over each bucket's group; with :attr:`param_gather` started, not waited
        for)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.inner is not None:
            for frag in self.fragments:   # the main view's main-parameter shard (joined afresh with remainders)
                frag.tensor.data = self._main_view(frag.bucket, frag.lo, frag.hi)
                grad = frag.bucket.grad   # bf16 buffers (grad_reduce_in_bf16): this run's part in the main dtype
                frag.tensor.grad = None if grad is None else grad[frag.lo:frag.hi].to(frag.tensor.dtype)
            self._sync_hyperparameters()
            found = getattr(self, "found_inf", None)
            if found is not None:
                self.inner.found_inf = found
            elif hasattr(self.inner, "found_inf"):
                del self.inner.found_inf
            self.inner.step()
            for frag in self.fragments:
                frag.tensor.grad = None
        for bucket in self.main_params.buckets:
            if bucket.main_shard is not None:
                self.main_params.write_shard(bucket)
        self.gather_params()
        return loss

    def gather_params(self) -> None:
        """All-gather each bucket's bf16 buffer over its group in place (from the first bucket: the next forward needs
        them first; the same order on every rank); blocking, or started and handed to :attr:`param_gather`."""
        works = []
        for index in range(len(self.main_params.buckets)):
            bucket = self.main_params.buckets[index]
            shard = bucket.shard
            if shard.size == 1:
                continue
            mine = bucket.compute[shard.start:shard.start + shard.length]
            async_op = self.param_gather is not None
            work = dist.all_gather_into_tensor(bucket.compute, mine, group=shard.group, async_op=async_op)
            if async_op:
                works.append((index, work))
        if self.param_gather is not None:
            self.param_gather.started(works)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model parameters' gradients (the fragments hold none between steps)."""
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints
    def _state_keys(self) -> Tuple[Dict[str, torch.dtype], Dict[str, Any]]:
        """The per-element states' names and dtypes (over every rank: a rank may hold no fragment) and the scalar
        states (``step``) of the fragments, agreed over the world (collective)."""
        inner_state = self.inner.state if self.inner is not None else {}
        mine_keys: Dict[str, torch.dtype] = {}
        scalars: Dict[str, Any] = {}
        for frag in self.fragments:
            for k, v in inner_state.get(frag.tensor, {}).items():
                if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == frag.tensor.numel() and v.numel() > 0:
                    mine_keys[k] = v.dtype
                else:
                    scalars.setdefault(k, v.detach().cpu().clone() if isinstance(v, Tensor) else v)
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine_keys, scalars))
        keys = {k: dtype for ks, _ in gathered for k, dtype in sorted(ks.items())}
        merged: Dict[str, Any] = {}
        for _, sc in gathered:
            for k, v in sc.items():
                merged.setdefault(k, v)
        return keys, merged

    def gathered_state_dict(self) -> Dict[str, Any]:
        """The whole optimizer state in ``torch.optim.Optimizer.state_dict()`` form, indexed over ``param_groups``'
        parameters, states of each parameter's shape (on CPU), on every rank: each bucket's state runs all-gathered
        over its group (collective over the world: every rank calls it)."""
        keys, scalars = self._state_keys()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: Dict[int, Dict[str, Any]] = {}
        if keys:
            inner_state = self.inner.state if self.inner is not None else {}
            by_bucket: Dict[int, List[_Fragment]] = {}
            for frag in self.fragments:
                by_bucket.setdefault(id(frag.bucket), []).append(frag)
            for bucket in self.main_params.buckets:
                shard = bucket.shard
                wholes: Dict[str, Tensor] = {}
                for k, dtype in keys.items():
                    run = torch.zeros(shard.length, dtype=dtype, device=bucket.device)
                    for frag in by_bucket.get(id(bucket), []):
                        value = inner_state.get(frag.tensor, {}).get(k)
                        if value is not None:
                            run[frag.lo - shard.start:frag.hi - shard.start] = value
                    if shard.size > 1:
                        whole = torch.empty(shard.size * shard.length, dtype=dtype, device=bucket.device)
                        dist.all_gather_into_tensor(whole, run, group=shard.group)
                    else:
                        whole = run
                    wholes[k] = whole.cpu()
                for p in bucket.params:
                    if not p.requires_grad or id(p) not in index:
                        continue
                    offset = self.main_params._where[id(p)][1]
                    entry: Dict[str, Any] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in scalars.items()}
                    for k, whole in wholes.items():
                        entry[k] = whole[offset:offset + p.numel()].view(p.shape).clone()
                    state[index[id(p)]] = entry
        return {"state": dict(sorted(state.items())), "param_groups": indexed_param_groups(self.param_groups)}

    def state_dict(self) -> Dict[str, Any]:
        """The whole state (:meth:`gathered_state_dict`; collective)."""
        return self.gathered_state_dict()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Nothing to do (``ZeroRedundancyOptimizer``'s protocol): :meth:`gathered_state_dict` gathers."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a whole state indexed over ``param_groups`` (any layout's: states of each parameter's shape, or of
        the flattened fragments' sizes): each rank keeps its fragments' parts. No communication."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.inner is None:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        inner_index = {id(f.tensor): i for i, f in enumerate(f for frags in self._group_fragments for f in frags)}
        state: Dict[int, Dict[str, Any]] = {}
        for frag in self.fragments:
            saved = state_dict["state"].get(index[id(frag.param)])
            if saved is None:
                continue
            entry: Dict[str, Any] = {}
            for k, v in saved.items():
                if isinstance(v, Tensor) and v.numel() == frag.param.numel() and v.dim() > 0:
                    entry[k] = v.reshape(-1)[frag.first:frag.first + frag.tensor.numel()].clone()
                else:
                    entry[k] = v
            state[inner_index[id(frag.tensor)]] = entry
        groups = indexed_param_groups(self.param_groups, [len(frags) for frags in self._group_fragments])
        self.inner.load_state_dict({"state": state, "param_groups": groups})


class BucketParamGather:
    """``overlap_param_gather`` for :class:`DistributedOptimizer`: the bucket all-gathers of ``main_params`` are
    started after an optimizer step and waited for by a forward pre-hook of each of ``module``'s submodules that
    holds (or, via ``also_waits``, reads) parameters of those buckets, so that later buckets arrive under the forward
    of earlier layers. :meth:`wait_all` waits for the rest (before anything reads whole weights outside a forward)."""

    def __init__(self, optimizers: Sequence[DistributedOptimizer], main_params: MainParams, module: nn.Module,
                 also_waits: Optional[Dict[nn.Module, List[nn.Parameter]]] = None) -> None:
        #: bucket index -> the work of its gather in flight
        self.pending: Dict[int, Any] = {}
        #: gathers waited for by a forward pre-hook, over all steps (the rest by :meth:`wait_all`)
        self.waited_in_forward = 0
        self.optimizers = list(optimizers)
        for opt in self.optimizers:
            opt.param_gather = self
        where = {id(p): index for index, bucket in enumerate(main_params.buckets) for p in bucket.params}
        extra = also_waits or {}
        self._hooks = []
        for m in module.modules():
            own = list(m.parameters(recurse=False)) + list(extra.get(m, []))
            indices = sorted({where[id(p)] for p in own if id(p) in where})
            if indices:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(indices)))

    def started(self, works: List[Tuple[int, Any]]) -> None:
        """An optimizer's step started the gathers ``(bucket index, work)`` (a bucket's gather still in flight from
        another optimizer's step is waited for first)."""
        for index, work in works:
            previous = self.pending.pop(index, None)
            if previous is not None:
                previous.wait()
            self.pending[index] = work

    def _waiter(self, indices: List[int]):
        @torch.compiler.disable
        def wait_own(module: nn.Module, args: Any) -> None:
            if self.pending:
                for index in indices:
                    work = self.pending.pop(index, None)
                    if work is not None:
                        work.wait()
                        self.waited_in_forward += 1
        return wait_own

    def wait_all(self) -> None:
        """Wait for every gather still in flight."""
        works, self.pending = list(self.pending.values()), {}
        for work in works:
            work.wait()

    def remove(self) -> None:
        """Wait, then make the optimizers' gathers blocking again and remove the hooks."""
        self.wait_all()
        for opt in self.optimizers:
            opt.param_gather = None
        for h in self._hooks:
            h.remove()
        self._hooks = []


class WholeStateView:
    """A :class:`DistributedOptimizer` seen as an optimizer over whole parameters, for sharded (``torch_dist``)
    checkpoints: ``param_groups`` its groups, ``state`` the whole state per parameter (gathered on first access:
    collective over the world, so every rank reads it, in the same order), ``load_state_dict`` its own."""

    def __init__(self, optimizer: DistributedOptimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self._state: Optional[Dict[nn.Parameter, Dict[str, Any]]] = None

    @property
    def state(self) -> Dict[nn.Parameter, Dict[str, Any]]:
        if self._state is None:
            params = [p for g in self.param_groups for p in g["params"]]
            whole = self.optimizer.gathered_state_dict()["state"]
            self._state = {params[i]: values for i, values in whole.items()}
        return self._state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
