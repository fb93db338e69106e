"""The parameter-and-gradient buffer (Megatron's ``ParamAndGradBuffer``): every floating-point parameter of a module,
its main parameter and its gradient are views of contiguous buckets, one buffer per (device, dtype) bucket.

:class:`MainParams` holds the parameters in one of two ways:

* ``params_dtype=None`` (:attr:`MainParams.keeps_dtype`): the parameters are their own main parameters (fp32,
  fp64). ``p.grad`` becomes the parameter's view of the bucket's gradient buffer at its first gradient of a step
  (torch DDP's ``gradient_as_bucket_view``); later micro-batches accumulate into it in place.
* ``params_dtype=torch.bfloat16`` (Megatron's bf16): bf16 compute copies, fp32 main parameters (or, with
  ``store_param_remainders``, the bf16 copy plus an int16 remainder: the same 32 bits in 2 bytes) and fp32 main
  gradients (Megatron's ``main_grad``; bf16 buffers with ``grad_reduce_in_bf16`` under the distributed optimizer).
  The ``nn.Parameter`` stays the one identity the optimizer, reductions, clipping and checkpoints refer to; only
  ``p.data`` switches view::

      compute view  (forward / backward)   p.data = bf16 copy   p.grad = None (each gradient moved out at once)
      main view     (reduce / clip / step)  p.data = fp32 main   p.grad = fp32 main gradient

  :meth:`~MainParams.to_main` (the start of ``GradientFinalizer.finalize``) and :meth:`~MainParams.to_compute` (an
  optimizer step post-hook) switch; :meth:`~MainParams.main_view` is the main view for checkpoints and imports.

Gradients reach the buffer by one post-accumulate-grad hook per parameter, and the zero-bubble schedules' separate
weight-gradient pass by :meth:`~MainParams.weight_grads`. A step's first gradients of a bucket are copied in together
(one multi-tensor copy). A step that nothing accumulates, reduces, clips or scales (``direct``) keeps the gradients
as the backward left them.

Data parallelism (:meth:`~MainParams.overlap_reduction`): each bucket is averaged over its group (dp x cp; routed
experts summed over edp and divided by dp x cp), by one all-reduce, or under the distributed optimizer
(:meth:`~MainParams.shard`) one reduce-scatter that leaves each rank its run; started inside the backward once the
bucket's last gradient of the step has arrived (``overlap_grad_reduce``), else after it. The replicas start equal
(:meth:`~MainParams.broadcast_replicas`).

Buckets hold about ``bucket_size`` elements (Megatron's default 40M): the matrices in the module's order, the
vectors (norms, biases) in a bucket of their own, routed experts' after the rest, a tied word embedding alone. A
bucket's gradient buffer is allocated at its first gradient of a step and freed at the step's end. Memory per bf16
parameter: 2 (bf16 copy) + 4 (fp32 main; 2 with remainders) + 4 (fp32 main gradient during a step), Megatron's;
the distributed optimizer keeps only this rank's run of the main parameters (:mod:`.optimizer`).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.optimizer import PrecisionAwareAdamW
from lightning_megatron.optimizer.param_remainders import join_fp32, split_fp32
from lightning_megatron.parallel.tensor_parallel.mappings import reduce_scatter_into

__all__ = ["MainParams", "BucketShard", "PARAMS_DTYPES", "DEFAULT_BUCKET_ELEMENTS"]

#: elements per bucket of the contiguous buffers when ``bucket_size`` is None (Megatron's default floor)
DEFAULT_BUCKET_ELEMENTS = 40_000_000

#: the parameter dtypes with fp32 main parameters (None: the parameters are the fp32 main parameters)
PARAMS_DTYPES = (None, torch.bfloat16)


@dataclass(eq=False)
class _Bucket:
    """One bucket of the contiguous buffers: ``numel`` elements on ``device``; the bf16 compute copies and fp32 main
    parameters of its parameters (flat, persistent; with remainders the main parameters only in the main view, the
    int16 ``remainder`` persistent instead) and their fp32 main gradients (flat, allocated at the step's first
    gradient into the bucket, None between steps). ``pending``: this step's first bf16 gradients not yet copied into
    their main-gradient views (``(view, gradient)``), copied together once ``expecting`` of them have arrived."""

    numel: int
    device: torch.device
    compute: Tensor
    main: Optional[Tensor]
    remainder: Optional[Tensor] = None
    grad: Optional[Tensor] = None
    expecting: int = 0
    pending: List[Tuple[Tensor, Tensor]] = field(default_factory=list)
    #: parameters in their own dtype whose first gradient waits in ``pending``: ``p.grad`` becomes the view once copied
    waiting: List[nn.Parameter] = field(default_factory=list)
    #: its parameters, in buffer order
    params: List[nn.Parameter] = field(default_factory=list)
    #: holds routed-expert parameters (reduced over expert data parallel by the caller, never here)
    expert: bool = False
    #: parameters whose last gradient of the step has arrived (overlapped reduction)
    ready: int = 0
    #: the bucket's reduction in flight: its work and the tensor reduced (the gradients or a bf16 copy)
    work: Any = None
    flat: Optional[Tensor] = None
    #: a sharded bucket's reduce-scatter output (its run of the sum) while the reduction is in flight
    scattered: Optional[Tensor] = None
    #: the distributed optimizer's shard of the bucket (:meth:`MainParams.shard`), else None
    shard: Optional["BucketShard"] = None
    #: with a shard: the fp32 main parameters of the shard's elements (``shard.length``; with remainders only while
    #: the step's main view lasts, the remainders of the shard's elements persistent in ``remainder`` instead)
    main_shard: Optional[Tensor] = None


@dataclass(frozen=True)
class BucketShard:
    """A bucket's elements cut into ``size`` equal runs of ``length`` (the bucket padded to ``size * length``); this
    rank (``rank`` of ``group``, the data-parallel group that reduces the bucket) keeps the fp32 main parameters and
    the optimizer states of run ``rank``: elements ``[start, start + length)`` (Megatron's distributed optimizer)."""

    group: Any
    size: int
    rank: int
    length: int

    @property
    def start(self) -> int:
        return self.rank * self.length


@dataclass
class _Reduction:
    """The data-parallel reduction of the buckets (:meth:`MainParams.overlap_reduction`): the dense buckets averaged
    over ``group`` (``size`` ranks, dp x cp), the expert buckets summed over ``expert_group`` (``expert_size`` ranks,
    edp) and divided by ``size`` as well (None: left to the caller)."""

    group: Any
    size: int
    uses: Dict[int, int]
    reduce_dtype: Optional[torch.dtype]
    expert_group: Any = None
    expert_size: int = 1
    reduces_experts: bool = False


def bucket_layout(params: List[nn.Parameter], bucket_size: int, apart: Optional[Set[int]] = None,
                  alone: Optional[Set[int]] = None) -> List[List[nn.Parameter]]:
    """``params`` cut into buckets: in their order, one device and dtype per bucket, a new bucket when the next
    parameter would take it past ``bucket_size`` elements (a larger parameter gets one of its own); matrices only, the vectors
    (``dim() < 2``) of a device in one bucket of their own after them. The parameters whose ``id`` is in ``alone``
    (a tied word embedding, summed with its twin on another pipeline stage) get a bucket each, first: the twins then
    sit at the same offsets of equal buckets, so that their gradients' shards line up. Those in ``apart`` (routed
    experts, reduced over another group) are laid out the same way in buckets of their own, after the others."""
    if alone:
        return ([[p] for p in params if id(p) in alone]
                + bucket_layout([p for p in params if id(p) not in alone], bucket_size, apart))
    if apart:
        return (bucket_layout([p for p in params if id(p) not in apart], bucket_size)
                + bucket_layout([p for p in params if id(p) in apart], bucket_size))
    buckets: List[List[nn.Parameter]] = []
    vectors: Dict[Tuple[torch.device, torch.dtype], List[nn.Parameter]] = {}
    open_: Dict[Tuple[torch.device, torch.dtype], List[nn.Parameter]] = {}
    filled: Dict[Tuple[torch.device, torch.dtype], int] = {}
    for p in params:
        key = (p.device, p.dtype)
        if p.dim() < 2:
            vectors.setdefault(key, []).append(p)
            continue
        current = open_.get(key)
        if current and filled[key] + p.numel() > bucket_size:
            buckets.append(open_.pop(key))
            current = None
        if current is None:
            open_[key], filled[key] = [], 0
        open_[key].append(p)
        filled[key] += p.numel()
    return buckets + list(open_.values()) + list(vectors.values())


def _slot(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """The view of ``flat`` (a bucket's 1-D buffer) that holds ``like``'s elements from ``offset``, in ``like``'s
    shape."""
    return flat[offset:offset + like.numel()].view(like.shape)


class MainParams:
    """bf16 parameters with fp32 main parameters and fp32 main gradients for the parameters of ``module``, all views
    into contiguous bucketed buffers (see the module docstring). Built once, after materialisation (the parameters
    then hold the fp32 values, which become the main parameters); starts in the compute view.

    Args:
        module: the (parallelised, materialised) module; its floating-point parameters get a main copy.
        params_dtype: the compute dtype of the parameters (``torch.bfloat16``).
        bucket_size: elements per bucket of the buffers (None: :data:`DEFAULT_BUCKET_ELEMENTS`).
        store_param_remainders: hold each fp32 main parameter as its bf16 copy plus an int16 remainder (see the
            module docstring): 2 bytes per parameter less.
        expert_params: routed-expert parameters: buckets of their own, reduced over expert data parallel
            (:meth:`overlap_reduction`).
        own_buckets: parameters that get a bucket each (a tied word embedding and its copy on the last pipeline
            stage: their gradients are summed across the stages, whose shards must line up).
    """

    def __init__(self, module: nn.Module, params_dtype: Optional[torch.dtype] = torch.bfloat16,
                 bucket_size: Optional[int] = None, store_param_remainders: bool = False,
                 expert_params: Optional[List[nn.Parameter]] = None,
                 own_buckets: Optional[List[nn.Parameter]] = None) -> None:
        if params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype={params_dtype!r}: MainParams stores parameters in torch.bfloat16 (with "
                             "fp32 main parameters) or, with None, in their own dtype (the parameters are the main "
                             "parameters); use params_dtype=torch.bfloat16 or None")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size={bucket_size!r}: the buffers' buckets hold at least one element")
        if store_param_remainders and params_dtype is None:
            raise ValueError("store_param_remainders=True completes bf16 parameters to fp32 main parameters; with "
                             "params_dtype=None the parameters are the main parameters: pass "
                             "params_dtype=torch.bfloat16 or drop store_param_remainders")
        self.params_dtype = params_dtype
        #: the parameters are their own main parameters (``params_dtype=None``): one buffer per bucket, no copies
        self.keeps_dtype = params_dtype is None
        self.store_param_remainders = bool(store_param_remainders)
        self.params: List[nn.Parameter] = []
        self.buckets: List[_Bucket] = []
        #: ``id(p)`` -> (bucket index, element offset in it)
        self._where: Dict[int, Tuple[int, int]] = {}
        #: ``id(p)`` -> its fp32 main parameter (a view of its bucket's; with remainders only in the main view)
        self._main: Dict[int, Tensor] = {}
        self._compute: Dict[int, Tensor] = {}
        self._remainder: Dict[int, Tensor] = {}
        #: ``id(p)`` -> its main gradient (a view of its bucket's gradient buffer) once this step has written it
        self._grads: Dict[int, Tensor] = {}
        self._hooks: List[Any] = []
        #: parameters whose gradients a separate weight-gradient pass is writing (:meth:`weight_grads`)
        self._weight_pass: Set[int] = set()
        self.in_main_view = False
        #: this step keeps its gradients as the backward left them (:meth:`start_step`)
        self.direct = False
        #: ``id(p)`` -> ``(p, its gradient)`` of a direct step, as the backward left them
        self._direct: Dict[int, Tuple[nn.Parameter, Tensor]] = {}
        #: an optimizer that steps the main parameters whatever the view (:meth:`attach`): direct steps need one
        self._optimizer_steps_main = False
        #: a zero per device, expanded to a parameter's shape in the sharded main view (:meth:`_placeholder`)
        self._zeros: Dict[torch.device, Tensor] = {}
        #: the main gradients' dtype: fp32, or with shards and ``grad_reduce_in_bf16`` bf16 (:meth:`shard`); None
        #: (parameters in their own dtype): each bucket's parameters' dtype
        self.grad_dtype: Optional[torch.dtype] = None if self.keeps_dtype else torch.float32
        seen = set()
        for p in module.parameters():
            if id(p) in seen or not p.is_floating_point() or p.is_meta:
                continue
            seen.add(id(p))
            self.params.append(p)
        experts = {id(p) for p in expert_params or []}
        #: the overlapped data-parallel reduction of the dense buckets (:meth:`overlap_reduction`), or None
        self._reduce: Optional[_Reduction] = None
        #: how a sharded bucket is reduced: True a reduce-scatter into this rank's run, False an all-reduce of which
        #: this rank keeps its run (the same numbers, twice the traffic); None (default): a reduce-scatter where the
        #: group's backend is NCCL, an all-reduce on gloo (CPU runs, where traffic matters little)
        self.reduce_scatter: Optional[bool] = None
        #: this step's backward passes per parameter (:meth:`arm_reduction`), None when not armed
        self._expected: Optional[int] = None
        self._arrivals: Dict[int, int] = {}
        #: per kind of bucket (dense: False, expert: True), the next one to start, counting down
        self._next_launch: Dict[bool, int] = {False: -1, True: -1}
        #: buckets whose reduction started inside a backward, over all steps (the rest in :meth:`finish_reduction`)
        self.started_in_backward = 0
        #: gradients found on parameters at the end of a backward, over all steps (:meth:`_fold_late_grads`)
        self.late_grads = 0
        self._warned_late = False
        for index, members in enumerate(bucket_layout(self.params, bucket_size or DEFAULT_BUCKET_ELEMENTS, experts,
                                                         {id(p) for p in own_buckets or []})):
            numel = sum(p.numel() for p in members)
            device = members[0].device
            remainders = self.store_param_remainders
            compute = torch.empty(numel, dtype=params_dtype or members[0].dtype, device=device)
            if self.keeps_dtype:   # the parameters are the main parameters: one buffer
                main: Optional[Tensor] = compute
            else:
                main = None if remainders else torch.empty(numel, dtype=torch.float32, device=device)
            bucket = _Bucket(numel, device, compute, main,
                             torch.empty(numel, dtype=torch.int16, device=device) if remainders else None)
            self.buckets.append(bucket)
            offset = 0
            for p in members:   # one bucket at a time: the parameters' own fp32 storage is freed as they move
                compute = _slot(bucket.compute, offset, p)
                with torch.no_grad():
                    if bucket.remainder is not None:
                        rest = _slot(bucket.remainder, offset, p)
                        high, low = split_fp32(p.data.float().contiguous())
                        compute.copy_(high)
                        rest.copy_(low)
                        self._remainder[id(p)] = rest
                    else:
                        assert bucket.main is not None
                        view = _slot(bucket.main, offset, p)
                        view.copy_(p.data)
                        if not self.keeps_dtype:   # else the view is the compute copy itself
                            compute.copy_(view)
                        self._main[id(p)] = view
                self._where[id(p)] = (index, offset)
                self._compute[id(p)] = compute
                p.data = compute
                offset += p.numel()
            bucket.params = list(members)
            bucket.expecting = sum(1 for p in members if p.requires_grad)
            bucket.expert = id(members[0]) in experts
        for p in self.params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))
        mine = {id(p) for p in self.params}
        for owner in module.modules():   # weights loaded in the compute view become the main parameters
            if any(id(p) in mine for p in owner.parameters(recurse=False)):
                self._hooks.append(owner.register_load_state_dict_post_hook(self._loaded))

    # ------------------------------------------------------------------ weights written from outside
    def _loaded(self, owner: nn.Module, _incompatible: Any) -> None:
        """``load_state_dict`` post-hook of a module owning parameters: in the compute view the load wrote the bf16
        copies, so they become the main parameters (remainders zero), or the next optimizer step would write the
        old main parameters back over them. In the main view the load wrote the main parameters themselves."""
        if not self.in_main_view and not self.keeps_dtype:
            self.adopt_compute_copies([p for p in owner.parameters(recurse=False) if id(p) in self._where])

    @torch.no_grad()
    def adopt_compute_copies(self, params: Optional[List[nn.Parameter]] = None) -> None:
        """Make the bf16 compute copies of ``params`` (default: all) their main parameters, after something wrote the
        copies in the compute view (``p.copy_(...)``, ``load_state_dict``): fp32 main parameter = the bf16 value
        (with remainders: remainder 0). Writing in :meth:`main_view` instead keeps the written fp32 values whole."""
        if self.in_main_view:
            raise RuntimeError("adopt_compute_copies() in the main view: the parameters hold their fp32 main values "
                               "there already; call it after writing the bf16 copies in the compute view")
        if self.keeps_dtype:   # the parameters are the main parameters
            return
        if self.sharded:
            for p in self.params if params is None else params:
                placed = self._in_shard(p)
                if placed is None:
                    continue
                bucket, lo, hi = placed
                shard = bucket.shard
                assert shard is not None
                if bucket.remainder is not None:
                    bucket.remainder[lo - shard.start:hi - shard.start].zero_()
                else:
                    assert bucket.main_shard is not None
                    bucket.main_shard[lo - shard.start:hi - shard.start].copy_(bucket.compute[lo:hi])
            return
        for p in self.params if params is None else params:
            if id(p) in self._remainder:
                self._remainder[id(p)].zero_()
            else:
                self._main[id(p)].copy_(self._compute[id(p)])

    # ------------------------------------------------------------------ gradients
    def _grad_view(self, p: Tensor) -> Tensor:
        """A view of ``p``'s slice of its bucket's gradient buffer (allocated here at the bucket's first gradient of
        the step)."""
        index, offset = self._where[id(p)]
        bucket = self.buckets[index]
        if bucket.grad is None:   # with shards padded to whole runs (the padding zero), to reduce-scatter in place
            numel = bucket.shard.size * bucket.shard.length if bucket.shard is not None else bucket.numel
            bucket.grad = torch.empty(numel, dtype=self.grad_dtype or bucket.compute.dtype, device=bucket.device)
            bucket.grad[bucket.numel:].zero_()
        return _slot(bucket.grad, offset, p)

    @torch.no_grad()
    def adopt_broadcast(self, p: nn.Parameter, main_value: Tensor) -> None:
        """``p``'s fp32 main value ``main_value`` arrived from the rank whose optimizer shard stepped it (the
        distributed optimizer's broadcast, overlapped with the next forward: :class:`~lightning_megatron.parallel.
        param_gather.OverlappedParamGather`): its bf16 copy (with remainders: and its remainder) follows, as
        :meth:`to_compute` would have made it had the value been there at the step's end."""
        key = id(p)
        if key not in self._compute:
            return
        if key in self._remainder:
            high, low = split_fp32(main_value.float().contiguous())
            self._compute[key].copy_(high)
            self._remainder[key].copy_(low)
            main = self._main.get(key) if self.in_main_view else None
            if main is not None and main.data_ptr() != main_value.data_ptr():
                main.copy_(main_value)
        else:
            if self._main[key].data_ptr() != main_value.data_ptr():
                self._main[key].copy_(main_value)
            self._compute[key].copy_(self._main[key])

    @contextmanager
    def weight_grads(self, params: List[nn.Parameter]) -> Generator[None, None, None]:
        """Around a backward route that writes ``p.grad`` of ``params`` without the post-accumulate hook (the
        zero-bubble pipeline schedules' separate weight-gradient pass assigns or adds ``weight.grad`` itself): the
        gradients it writes reach the buffer as the hook would have taken them, once per micro-batch. bf16
        parameters: :meth:`take_weight_grads` after it. Parameters in their own dtype keep their gradient on
        ``p.grad``, so it is set aside during the pass (each gradient the pass writes is then a new tensor) and the
        new one added to it after."""
        if not self.keeps_dtype or self.in_main_view:
            yield
            self.take_weight_grads(params)
            return
        held = {id(p): p.grad for p in params if id(p) in self._where}
        for p in params:
            if id(p) in held:
                p.grad = None
        self._weight_pass = set(held)   # the hook leaves them to this context (the pass may accumulate by autograd)
        try:
            yield
        finally:
            self._weight_pass = set()
            for p in params:
                if id(p) not in held:
                    continue
                new, old = p.grad, held[id(p)]
                if new is not None and old is not None:
                    with torch.no_grad():   # into the waiting gradient or the buffer's view, in place
                        old.add_(new)
                p.grad = new if old is None else old
                if new is not None:   # as the hook takes a gradient (the first is copied in, each one counted)
                    self._accumulate_in_place(p)

    def take_weight_grads(self, params: List[nn.Parameter]) -> None:
        """The gradients a backward route wrote into ``p.grad`` without the post-accumulate hook (the zero-bubble
        pipeline schedules' separate weight-gradient pass assigns or adds ``weight.grad`` itself): moved into the
        main gradients as the hook would have (:meth:`_accumulate`), once per micro-batch, so they accumulate in
        fp32. Parameters without a waiting gradient are left alone."""
        if self.in_main_view:
            return
        for p in params:
            if p.grad is not None and id(p) in self._where:
                self._accumulate(p)

    def _fold_late_grads(self) -> None:
        """At the end of the backward: gradients still on parameters in the compute view came by a route that
        bypassed :meth:`_accumulate` (and :meth:`take_weight_grads`); they are folded into the main gradients now,
        rather than dropped by :meth:`to_main`, counted in :attr:`late_grads` and warned about once (they were
        summed in bf16 across the micro-batches). Rank-local, so no rank stops where the others go on."""
        if self.keeps_dtype:   # the buffer's own gradients stay on their parameters: only untracked ones are late
            late = [p for p in self.params if p.grad is not None and id(p) not in self._grads]
        else:
            late = [p for p in self.params if p.grad is not None]
        if not late:
            return
        self.late_grads += len(late)
        if not self._warned_late and not self.keeps_dtype:   # in their own dtype nothing was lost
            self._warned_late = True
            warnings.warn(
                f"{len(late)} bf16 parameter(s) (first of shape {tuple(late[0].shape)}) held a gradient the fp32 "
                "main-gradient hook never saw (a backward route wrote p.grad directly); it was folded into the main "
                "gradients at the end of the backward, after summing in bf16. Hand such gradients to "
                "MainParams.take_weight_grads after each micro-batch", RuntimeWarning, stacklevel=2)
        for p in late:
            self._accumulate(p)

    def start_step(self, direct: bool) -> None:
        """Before a step's first backward: whether its gradients stay as the backward leaves them (``direct``: the
        caller knows nothing will accumulate, reduce or scale them; taken only with an optimizer that steps the main
        parameters, see :meth:`attach`) or go into fp32 main gradients."""
        # a step whose buckets this object reduces over data parallel never keeps its bf16 gradients
        self.direct = direct and self._optimizer_steps_main and self._reduce is None
        self._direct = {}

    def _accumulate(self, p: Tensor) -> None:
        """Post-accumulate-grad hook: ``main_grad += p.grad`` in fp32, then drop ``p.grad``. The first gradient of the
        step is copied in (the buffer needs no zeroing), together with the rest of its bucket's once they are all
        there (:meth:`_copy_pending`). In a direct step the first gradient is kept as it is instead. Parameters in
        their own dtype: :meth:`_accumulate_in_place`."""
        if self.in_main_view or p.grad is None:
            return
        if self.keeps_dtype:
            self._accumulate_in_place(p)
            return
        key = id(p)
        if self.direct:
            if key not in self._direct:
                self._direct[key] = (p, p.grad)
                p.grad = None
                return
            second = p.grad   # a second gradient after all: this step accumulates in fp32
            self._leave_direct()
            p.grad = second
        index = self._where[key][0]
        with torch.no_grad():
            view = self._grads.get(key)
            if view is not None:
                self._copy_pending(index)   # its first gradient may still wait for the bucket
                view.add_(p.grad)
            else:
                self._grads[key] = view = self._grad_view(p)
                bucket = self.buckets[index]
                bucket.pending.append((view, p.grad))
                if len(bucket.pending) >= bucket.expecting:
                    self._copy_pending(index)
        p.grad = None
        if self._expected is not None:
            self._arrived(p, index)

    def _accumulate_in_place(self, p: Tensor) -> None:
        """The post-accumulate-grad hook of parameters in their own dtype (torch DDP's ``gradient_as_bucket_view``):
        ``p.grad`` stays the gradient. The step's first one is copied into the buffer with the rest of its bucket's
        (:meth:`_copy_pending`), after which ``p.grad`` is its view of the buffer, into which autograd adds the later
        micro-batches in place; until then autograd adds them into the waiting gradient itself. A direct step
        leaves the gradients as autograd made them."""
        key = id(p)
        if self.direct or key in self._weight_pass:
            return
        index = self._where[key][0]
        view = self._grads.get(key)
        if view is None:
            self._grads[key] = self._grad_view(p)
            bucket = self.buckets[index]
            bucket.pending.append((self._grads[key], p.grad))
            bucket.waiting.append(p)
            if len(bucket.pending) >= bucket.expecting:
                self._copy_pending(index)
        elif p.grad is not view and not any(g is p.grad for _, g in self.buckets[index].pending):
            with torch.no_grad():   # a gradient put on the parameter anew (not added in place): into the buffer
                self._copy_pending(index)
                view.add_(p.grad)
            p.grad = view
        if self._expected is not None:
            self._arrived(p, index)

    # ------------------------------------------------------------------ data-parallel reduction
    def overlap_reduction(self, group: Any, size: int, uses: Optional[Dict[int, int]] = None,
                          reduce_dtype: Optional[torch.dtype] = None, expert_group: Any = None,
                          expert_size: Optional[int] = None) -> None:
        """Reduce the buckets' main gradients by this object: the dense buckets averaged over ``group`` (``size``
        ranks: dp x cp), and with ``expert_size`` given the routed experts' buckets summed over ``expert_group``
        (``expert_size`` ranks: expert data parallel) and divided by ``size`` (Megatron's expert gradient scaling;
        otherwise they are left to the caller). Each bucket's collective starts as soon as the step's last gradient of
        its every parameter has arrived (Megatron's ``overlap_grad_reduce``, once :meth:`arm_reduction` announced the
        step), from the last bucket of a kind to the first (the order the backward completes them, the same on every
        rank of the group); :meth:`finish_reduction` starts the rest and waits. A sharded bucket (:meth:`shard`: the
        distributed optimizer) is reduce-scattered (:attr:`reduce_scatter`): each rank receives only its run of the
        average, the only part its optimizer reads, for half an all-reduce's traffic; elsewhere its gradients are zero
        then. ``uses``:
        backward passes per micro-batch of a parameter used by more than one pipeline stage on this rank (default
        1); ``reduce_dtype``: communicate in that dtype (``grad_reduce_in_bf16``: a bf16 copy, divided before the
        sum)."""
        experts = expert_size is not None
        if size > 1:
            self._reduce = _Reduction(group, size, dict(uses or {}), reduce_dtype, expert_group,
                                      int(expert_size or 1), experts)
        else:
            self._reduce = None

    @property
    def reduces_data_parallel(self) -> bool:
        """Whether :meth:`finish_reduction` owns the dense buckets' data-parallel average."""
        return self._reduce is not None

    @property
    def reduces_experts(self) -> bool:
        """Whether :meth:`finish_reduction` owns the routed experts' reduction over expert data parallel."""
        return self._reduce is not None and self._reduce.reduces_experts

    @property
    def scatters(self) -> bool:
        """Whether the reduction leaves each rank only its shard's run of a bucket's average (zeros elsewhere): the
        gradient norm then sums the ranks' squares over each bucket's group."""
        return self._reduce is not None and self.sharded and any(b.shard.size > 1 for b in self.buckets)

    def _reduces(self, bucket: "_Bucket") -> bool:
        reduce = self._reduce
        return reduce is not None and (not bucket.expert or reduce.reduces_experts)

    def _restart_launches(self) -> None:
        self._next_launch = {False: len(self.buckets) - 1, True: len(self.buckets) - 1}
        for bucket in self.buckets:
            bucket.ready, bucket.work, bucket.flat = 0, None, None

    def arm_reduction(self, microbatches: int) -> None:
        """Before a step's first backward: each parameter's gradient arrives ``microbatches`` times (times its
        ``uses``); a bucket's reduction starts at its parameters' last arrival."""
        if self._reduce is None:
            return
        self._expected, self._arrivals = microbatches, {}
        self._restart_launches()

    def _arrived(self, p: Tensor, index: int) -> None:
        assert self._reduce is not None and self._expected is not None
        bucket = self.buckets[index]
        if bucket.flat is not None:
            raise RuntimeError(
                f"a gradient of a parameter of shape {tuple(p.shape)} arrived after its bucket's data-parallel "
                f"reduction started (expected {self._expected * self._reduce.uses.get(id(p), 1)} backward passes per "
                "step): pass the step's micro-batch count to arm_reduction and each parameter's pipeline uses")
        n = self._arrivals.get(id(p), 0) + 1
        self._arrivals[id(p)] = n
        if n == self._expected * self._reduce.uses.get(id(p), 1):
            bucket.ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Inside the backward: per kind (dense, expert), start the complete buckets from the kind's next one down,
        in order."""
        for expert in (False, True):
            index = self._next_launch[expert]
            while index >= 0:
                bucket = self.buckets[index]
                if bucket.expert == expert and self._reduces(bucket):
                    if bucket.ready < bucket.expecting:
                        break
                    self._launch(index)
                    self.started_in_backward += 1
                index -= 1
            self._next_launch[expert] = index

    @torch.no_grad()
    def _launch(self, index: int) -> None:
        reduce = self._reduce
        assert reduce is not None
        bucket = self.buckets[index]
        if bucket.expecting == 0:
            return
        self._copy_pending(index)
        for p in bucket.params:   # a parameter without a gradient this step takes part with zeros
            if id(p) not in self._grads and p.requires_grad:
                self._grads[id(p)] = self._grad_view(p).zero_()
                if self.in_main_view:
                    p.grad = self._grads[id(p)]
        flat = bucket.grad
        assert flat is not None
        if reduce.reduce_dtype is not None:   # a copy in that dtype, or the bf16 buffer itself, divided first
            flat = (flat.to(reduce.reduce_dtype) if flat.dtype != reduce.reduce_dtype else flat).div_(reduce.size)
        bucket.flat = flat
        group, size = (reduce.expert_group, reduce.expert_size) if bucket.expert else (reduce.group, reduce.size)
        shard = bucket.shard
        if size == 1:   # expert data parallel of one: the scaling only (finish_reduction)
            return
        if shard is not None and shard.size != size:
            raise RuntimeError(f"a bucket sharded over {shard.size} ranks is reduced over {size}: shard each bucket "
                               "over the group that reduces it (dp x cp; routed experts: edp)")
        scatter = self.reduce_scatter
        if scatter is None:
            scatter = dist.get_backend(group) == dist.Backend.NCCL
        if shard is not None and shard.size > 1 and scatter:
            # into a run of its own, copied into the bucket by finish_reduction
            bucket.scattered = torch.empty(shard.length, dtype=flat.dtype, device=flat.device)
            bucket.work = reduce_scatter_into(bucket.scattered, flat, group=group, async_op=True)
        else:   # whole: a shard keeps its run (finish_reduction)
            bucket.work = dist.all_reduce(flat, group=group, async_op=True)

    @torch.no_grad()
    def finish_reduction(self) -> None:
        """Start the buckets the backward did not (same order), wait for every one and leave the averages in the
        main gradients (sharded buckets: this rank's run of them, zeros elsewhere). Collective over the reduction's
        groups; disarms until the next :meth:`arm_reduction`. In the main view (after :meth:`finish_backward`)."""
        reduce = self._reduce
        if reduce is None:
            return
        if self._expected is None:   # not armed (a loop that does not announce its micro-batches): all at once
            self._restart_launches()
        self._expected = None
        for expert in (False, True):
            for index in range(self._next_launch[expert], -1, -1):
                bucket = self.buckets[index]
                if bucket.expert == expert and self._reduces(bucket):
                    self._launch(index)
            self._next_launch[expert] = -1
        for bucket in self.buckets:
            if bucket.flat is None:
                continue
            if bucket.work is not None:
                bucket.work.wait()
            grad, flat, shard = bucket.grad, bucket.flat, bucket.shard
            assert grad is not None
            scattered = shard is not None and shard.size > 1
            lo, hi = (shard.start, shard.start + shard.length) if scattered else (0, grad.numel())
            if bucket.scattered is not None:   # this rank's run of the sum, beside the bucket
                flat[lo:hi].copy_(bucket.scattered)
                bucket.scattered = None
            if flat is not grad:
                grad[lo:hi].copy_(flat[lo:hi])
            elif reduce.reduce_dtype is None:   # else divided before the sum (_launch)
                grad[lo:hi].div_(reduce.size)
            if scattered:   # the other runs hold this rank's own sums: none of this rank's business
                grad[:lo].zero_()
                grad[hi:].zero_()
            bucket.work, bucket.flat = None, None

    def _leave_direct(self) -> None:
        """End direct mode for this step: the gradients kept so far go the way of a step's first gradients
        (:meth:`_accumulate`: into fp32 main gradients, copied in per bucket)."""
        kept, self._direct, self.direct = self._direct, {}, False
        for p, grad in kept.values():
            p.grad = grad
            self._accumulate(p)

    def finish_backward(self) -> None:
        """After the step's last backward (the first thing of ``GradientFinalizer.finalize``): a direct step puts its
        bf16 gradients back on the parameters (``p.grad``, compute view); otherwise :meth:`to_main`."""
        if self.direct:
            for p, grad in self._direct.values():
                p.grad = grad
            return
        if not self.in_main_view:
            self._fold_late_grads()
        self.to_main()

    def _copy_pending(self, index: int) -> None:
        """Copy bucket ``index``'s waiting first gradients into their main-gradient views (one multi-tensor copy)."""
        bucket = self.buckets[index]
        if bucket.pending:
            views, grads = zip(*bucket.pending)
            bucket.pending = []
            with torch.no_grad():
                torch._foreach_copy_(list(views), list(grads))
            waiting, bucket.waiting = bucket.waiting, []
            for p, grad in zip(waiting, grads):   # parameters in their own dtype: the gradient is the view now
                if p.grad is grad:
                    p.grad = self._grads[id(p)]

    def main_grad(self, p: nn.Parameter) -> Optional[Tensor]:
        """The fp32 gradient of ``p`` accumulated over this step's micro-batches (None before its first one):
        the tensor a data-parallel reduction works on (in the main view it is also ``p.grad``)."""
        where = self._where.get(id(p))
        if where is not None:
            self._copy_pending(where[0])
        return self._grads.get(id(p))

    def main_param(self, p: nn.Parameter) -> Tensor:
        """The fp32 main parameter of ``p`` (what the optimizer steps and checkpoints hold). With remainders outside
        the main view a new tensor holding its value (writing to it changes nothing)."""
        main = self._main.get(id(p))
        if main is None and self.sharded:
            raise RuntimeError("main_param(): the fp32 main parameters are sharded over data parallel (the distributed "
                               "optimizer keeps each rank's shard); read them inside main_view()")
        if main is None and id(p) in self._remainder:
            return join_fp32(self._compute[id(p)], self._remainder[id(p)])
        return self._main[id(p)]

    def remainder(self, p: nn.Parameter) -> Tensor:
        """The int16 remainder of ``p`` (``store_param_remainders``): with its bf16 copy, its fp32 main parameter."""
        return self._remainder[id(p)]

    def _join_main(self) -> None:
        """With remainders: each bucket's fp32 main parameters joined from its two halves (the main view's)."""
        for bucket in self.buckets:
            assert bucket.remainder is not None
            bucket.main = join_fp32(bucket.compute, bucket.remainder)
        for p in self.params:
            index, offset = self._where[id(p)]
            self._main[id(p)] = _slot(self.buckets[index].main, offset, p)

    @torch.no_grad()
    def broadcast_replicas(self, group_of: Callable[["_Bucket"], Tuple[Any, int, int]]) -> None:
        """Make the data-parallel replicas equal (what torch DDP does when it wraps a module): each bucket's
        parameters (the compute buffer; with bf16 parameters also the fp32 main parameters or the remainders) from the
        first rank of its group, ``group_of(bucket)`` giving ``(group, size, rank)`` (dp x cp; expert buckets: edp).
        One broadcast per buffer; collective over those groups. In the compute view. Once sharded (a later fit) the
        replicas are equal already: every step all-gathers the buffers from the shards."""
        if self.in_main_view:
            raise RuntimeError("MainParams.broadcast_replicas() in the main view: broadcast in the compute view")
        if self.sharded:
            return
        for bucket in self.buckets:
            group, size, _ = group_of(bucket)
            if size == 1:
                continue
            source = dist.get_global_rank(group, 0)
            for tensor in {id(t): t for t in (bucket.compute, bucket.main, bucket.remainder) if t is not None}.values():
                # the int16 remainders travel as 16-bit floats (gloo broadcasts no int16; the bits are kept)
                dist.broadcast(tensor.view(torch.bfloat16) if tensor.dtype == torch.int16 else tensor, source,
                               group=group)

    # ------------------------------------------------------------------ shards (the distributed optimizer)
    @property
    def sharded(self) -> bool:
        """Whether each rank keeps only its shard of the fp32 main parameters (:meth:`shard`)."""
        return bool(self.buckets) and self.buckets[0].shard is not None

    @torch.no_grad()
    def shard(self, group_of: Callable[["_Bucket"], Tuple[Any, int, int]],
              grad_dtype: Optional[torch.dtype] = None) -> None:
        """Keep only this rank's shard of each bucket's fp32 main parameters (Megatron's distributed optimizer):
        ``group_of(bucket)`` gives the bucket's data-parallel ``(group, size, rank)`` (dp x cp; expert buckets: edp).
        Each bucket's compute buffer is padded to ``size * length`` elements (``length = ceil(numel / size)``) so
        that it can be all-gathered in place; the main parameters (or with remainders the remainders) of elements
        ``[rank * length, (rank + 1) * length)`` stay, the rest are freed: per parameter 2 bytes (bf16 copy) + 4 / size
        (fp32 main shard; with remainders 2 / size). ``grad_dtype``: the main gradients' dtype from now on (bf16:
        Megatron's ``--grad-reduce-in-bf16`` buffers, accumulated and reduced in bf16, 2 bytes per parameter instead
        of 4; default fp32). No communication here. In the compute view, before the first step; once."""
        if grad_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"MainParams.shard(grad_dtype={grad_dtype!r}): the main gradients are torch.float32 or "
                             "torch.bfloat16 (grad_reduce_in_bf16)")
        if self.sharded:
            raise RuntimeError("MainParams.shard(): the main parameters are sharded already")
        if self.in_main_view:
            raise RuntimeError("MainParams.shard() in the main view: shard between steps, in the compute view")
        for bucket in self.buckets:
            group, size, rank = group_of(bucket)
            if not (size >= 1 and 0 <= rank < size):
                raise ValueError(f"MainParams.shard(): rank {rank} of a group of {size}")
            length = -(-bucket.numel // size)
            shard = BucketShard(group, size, rank, length)
            n = max(0, min(bucket.numel, shard.start + length) - shard.start)
            whole = join_fp32(bucket.compute, bucket.remainder) if bucket.remainder is not None else bucket.main
            assert whole is not None
            compute = torch.zeros(size * length, dtype=bucket.compute.dtype, device=bucket.device)
            compute[:bucket.numel] = bucket.compute
            if self.keeps_dtype:   # the shard of the parameters themselves
                main = compute[shard.start:shard.start + length]
            else:
                main = torch.zeros(length, dtype=torch.float32, device=bucket.device)
                main[:n] = whole[shard.start:shard.start + n]
            if bucket.remainder is not None:
                bucket.remainder = split_fp32(main)[1]
                bucket.main_shard = None
            else:
                bucket.main_shard = main
            bucket.main, bucket.compute, bucket.shard = None, compute, shard
            for p in bucket.params:
                view = _slot(compute, self._where[id(p)][1], p)
                self._compute[id(p)] = view
                p.data = view
        self._main, self._remainder = {}, {}
        if not self.keeps_dtype:   # in their own dtype p.grad is the gradient's view: the parameters' dtype
            self.grad_dtype = grad_dtype or torch.float32

    def _in_shard(self, p: nn.Parameter) -> Optional[Tuple["_Bucket", int, int]]:
        """``(bucket, lo, hi)``: the elements ``[lo, hi)`` of ``p``'s bucket that are both ``p``'s and this rank's
        shard's, or None when they are none."""
        index, offset = self._where[id(p)]
        bucket = self.buckets[index]
        shard = bucket.shard
        assert shard is not None
        lo, hi = max(offset, shard.start), min(offset + p.numel(), shard.start + shard.length)
        return (bucket, lo, hi) if lo < hi else None

    def shard_fragments(self, p: nn.Parameter) -> Optional[Tuple["_Bucket", int, int, int]]:
        """``(bucket, lo, hi, offset)``: ``p``'s elements ``[lo - offset, hi - offset)`` (flat) are this rank's, the
        bucket's elements ``[lo, hi)``; None when none of ``p`` is this rank's."""
        placed = self._in_shard(p)
        if placed is None:
            return None
        return placed + (self._where[id(p)][1],)

    def _placeholder(self, p: nn.Parameter) -> Tensor:
        """What a parameter holds in the step's main view with shards: a tensor of its shape and its main gradient's
        dtype without storage (one zero, expanded), so that its main gradient can be its ``grad``; nothing reads its
        values there."""
        zero = self._zeros.get(p.device)
        if zero is None:
            zero = self._zeros[p.device] = torch.zeros((), dtype=self.grad_dtype, device=p.device)
        return zero.expand(p.shape)

    def shard_main(self, bucket: "_Bucket") -> Tensor:
        """The fp32 main parameters of ``bucket``'s shard (``shard.length``): the persistent ones, or with remainders
        those joined for the step's main view (else joined now: a new tensor)."""
        shard = bucket.shard
        assert shard is not None
        if bucket.main_shard is not None:
            return bucket.main_shard
        assert bucket.remainder is not None
        return join_fp32(bucket.compute[shard.start:shard.start + shard.length], bucket.remainder)

    @torch.no_grad()
    def write_shard(self, bucket: "_Bucket") -> None:
        """After the optimizer stepped ``bucket``'s shard of main parameters: its bf16 copies (with remainders: and
        the remainders) from them, in the compute buffer's shard (gathered by the caller)."""
        shard = bucket.shard
        assert shard is not None and bucket.main_shard is not None
        compute = bucket.compute[shard.start:shard.start + shard.length]
        if bucket.remainder is not None:
            high, low = split_fp32(bucket.main_shard)
            compute.copy_(high)
            bucket.remainder.copy_(low)
        elif not self.keeps_dtype:   # parameters in their own dtype: the shard was stepped in place
            compute.copy_(bucket.main_shard)

    @contextmanager
    def _whole_main(self) -> Generator[None, None, None]:
        """With shards: the whole fp32 main parameters gathered (collective over each bucket's group) and held by the
        parameters for the context's duration; on exit each rank takes its shard of them (and the bf16 copies,
        whole) from what they then hold, and the parameters hold what they held before."""
        held = [p.data for p in self.params]
        wholes: List[Tensor] = []
        with torch.no_grad():
            for bucket in self.buckets:
                shard = bucket.shard
                assert shard is not None
                mine = self.shard_main(bucket).contiguous()
                if shard.size == 1:
                    whole = mine.clone()
                else:
                    whole = torch.empty(shard.size * shard.length, dtype=mine.dtype, device=bucket.device)
                    dist.all_gather_into_tensor(whole, mine, group=shard.group)
                wholes.append(whole)
        for p in self.params:
            index, offset = self._where[id(p)]
            self._main[id(p)] = _slot(wholes[index], offset, p)
            p.data = self._main[id(p)]
        try:
            yield
        finally:
            with torch.no_grad():
                for bucket, whole in zip(self.buckets, wholes):
                    shard = bucket.shard
                    assert shard is not None
                    mine = whole[shard.start:shard.start + shard.length]
                    if bucket.remainder is not None:
                        high, low = split_fp32(whole)
                        bucket.compute.copy_(high)
                        bucket.remainder.copy_(low[shard.start:shard.start + shard.length])
                        if bucket.main_shard is not None:
                            bucket.main_shard.copy_(mine)
                    else:
                        assert bucket.main_shard is not None
                        bucket.compute.copy_(whole)
                        bucket.main_shard.copy_(mine)
            self._main = {}
            for p, data in zip(self.params, held):
                p.data = data

    # ------------------------------------------------------------------ views
    def to_main(self) -> None:
        """Switch to the main view: ``p.data`` the fp32 main parameter, ``p.grad`` the fp32 main gradient (None
        for a parameter without gradient this step). Idempotent."""
        if self.in_main_view:
            return
        self.in_main_view = True
        if self.sharded:   # the distributed optimizer steps the shards; the parameters hold no fp32 values here
            for bucket in self.buckets:
                if bucket.remainder is not None:
                    shard = bucket.shard
                    assert shard is not None
                    bucket.main_shard = join_fp32(bucket.compute[shard.start:shard.start + shard.length],
                                                  bucket.remainder)
            for p in self.params:
                p.grad = None
                if not self.keeps_dtype:   # parameters in their own dtype hold their (whole) values still
                    p.data = self._placeholder(p)
                p.grad = self.main_grad(p)
            return
        if self.store_param_remainders:
            self._join_main()
        for p in self.params:   # main_grad copies the bucket's waiting gradients (also for a parameter without one)
            p.grad = None
            p.data = self._main[id(p)]
            p.grad = self.main_grad(p)

    @torch.no_grad()
    def to_compute(self, copy: bool = True) -> None:
        """Copy the fp32 main parameters into the bf16 copies (one operation over the buckets; with remainders split
        into both halves, and the joined main parameters freed; ``copy=False``: the optimizer wrote them, see
        :meth:`attach`) and switch to the compute view (gradients and main gradients dropped: the step is over).
        Idempotent. A direct step's gradients are dropped too."""
        if not self.in_main_view:
            if self._direct:
                for p, _ in self._direct.values():
                    p.grad = None
                self._direct = {}
            return
        if self.sharded:   # the distributed optimizer wrote and gathered the compute copies itself
            for bucket in self.buckets:
                if bucket.remainder is not None:
                    bucket.main_shard = None
        elif self.store_param_remainders:
            for bucket in self.buckets:
                if copy:
                    high, low = split_fp32(bucket.main)
                    bucket.compute.copy_(high)
                    bucket.remainder.copy_(low)
                bucket.main = None
            self._main = {}
        elif self.buckets and copy and not self.keeps_dtype:
            torch._foreach_copy_([b.compute for b in self.buckets], [b.main for b in self.buckets])
        for p in self.params:
            p.grad = None
            p.data = self._compute[id(p)]
        self._drop_grads()
        self.in_main_view = False

    def _drop_grads(self) -> None:
        for bucket in self.buckets:
            bucket.grad, bucket.pending, bucket.waiting = None, [], []
        self._grads = {}

    @contextmanager
    def main_view(self) -> Generator[None, None, None]:
        """The main view for the duration of the context (checkpoint saving and loading); on exit the bf16 copies
        are refreshed from the (possibly loaded) main parameters and the compute view restored (when it was the
        view on entry). Gradients are left as they are. With shards (:meth:`shard`) the whole fp32 main parameters
        are gathered for the context's duration (collective over each bucket's group: every rank enters it) and
        each rank keeps its shard of them on exit."""
        if self.sharded:
            with self._whole_main():
                yield
            return
        if self.in_main_view or self.keeps_dtype:   # parameters in their own dtype: one view
            yield
            return
        buffers, grads, direct = [b.grad for b in self.buckets], dict(self._grads), dict(self._direct)
        held = [(p, p.grad) for p, _ in direct.values()]   # a direct step's gradients, on their parameters or not
        self.to_main()
        try:
            yield
        finally:
            self.to_compute()
            for bucket, buffer in zip(self.buckets, buffers):
                bucket.grad = buffer
            self._grads, self._direct = grads, direct
            for p, grad in held:
                p.grad = grad

    def optimizer_hook(self, *_: Any) -> None:
        """Optimizer step post-hook ``(optimizer, args, kwargs)``: back to the compute view."""
        self.to_compute()

    def compute_copy(self, p: nn.Parameter) -> Tensor:
        """The bf16 compute copy of ``p`` (a view of its bucket's compute buffer)."""
        return self._compute[id(p)]

    def attach(self, optimizer: Any) -> None:
        """Back to the compute view after every step of ``optimizer``. A :class:`PrecisionAwareAdamW` of its own (not
        wrapped by the distributed optimizer, whose broadcasts write main parameters the local update did not)
        writes the bf16 copies in its update's pass (:meth:`PrecisionAwareAdamW.write_param_copies`) and steps the
        main parameters in either view (:meth:`PrecisionAwareAdamW.step_main_params`, or with remainders the two
        halves: :meth:`PrecisionAwareAdamW.step_param_remainders`), which direct steps need; any other optimizer is
        followed by one copy over the buckets (with remainders: one split)."""
        if self.sharded:   # the distributed optimizer wrote and gathered the bf16 copies
            optimizer.register_step_post_hook(lambda *_: self.to_compute(copy=False))
        elif self.keeps_dtype:   # the parameters are the main parameters: any optimizer steps them in either view
            optimizer.register_step_post_hook(lambda *_: self.to_compute(copy=False))
            self._optimizer_steps_main = True
        elif isinstance(optimizer, PrecisionAwareAdamW):
            optimizer.write_param_copies(self.compute_copy)
            if self.store_param_remainders:
                optimizer.step_param_remainders(self.remainder)
            else:
                optimizer.step_main_params(self.main_param)
            optimizer.register_step_post_hook(lambda *_: self.to_compute(copy=False))
            self._optimizer_steps_main = True
        else:
            optimizer.register_step_post_hook(self.optimizer_hook)

    def remove(self) -> None:
        """Remove the hooks and leave the parameters holding their fp32 main values."""
        self.to_main()
        for p in self.params:
            p.grad = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
