"""Megatron's precision-aware optimizer (``--use-precision-aware-optimizer``): AdamW whose moment estimates are
stored in a narrower dtype than the fp32 main parameters they update.

:class:`PrecisionAwareAdamW` keeps ``exp_avg`` (Megatron's ``--exp-avg-dtype``) and ``exp_avg_sq``
(``--exp-avg-sq-dtype``) in ``torch.float32`` or ``torch.bfloat16`` and does the update itself in fp32: each step
reads a moment, updates it in fp32, steps the parameter with that fp32 value and stores it rounded to its dtype (as
Megatron's fused precision-aware Adam). With both moments in bf16 an fp32 parameter costs 4 bytes of optimizer state
instead of 8 (1.26B parameters: 4.71 GiB less). The parameters (the fp32 main parameters under
``MegatronPrecision(params_dtype=torch.bfloat16)``) and gradients stay as they are.

Flat buffers: the update runs over runs of adjacent views (:func:`~lightning_megatron.utils.tensors.adjacent_runs`).
Where the parameters (and their gradients) are views laid end to end in one buffer, as
:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`' bucketed main parameters and gradients are, the moments
are allocated the same way (one buffer per run of adjacent parameters, each parameter's moments a view into it), and
the update sees one flat tensor per run: a handful of tensors for a 1.3B model instead of one per parameter, so a
handful of kernels. The lists are built once (an update plan per parameter group and device) and kept while what
they were built from holds: the same parameters with gradients, the same parameter data, moment and step tensors,
and gradients laid out as before; a step then costs the host a pass of identity checks and one flat view of the
gradients per run, not the planning per parameter. Weight decay is the group's, so each
group's runs are updated together. Parameters that are separate allocations are runs of one: the arithmetic is the
same element by element. State dicts stay per parameter (each moment a view with the parameter's shape); loading
copies the loaded moments into the flat layout at the next step.

On CUDA the update of a parameter group is one compiled call (``torch.compile`` of :func:`adamw_multi_update_` with
:data:`UPDATE_COMPILE_OPTIONS`, compiled for the shapes of the group's lists, which do not change during a run, so
Inductor writes kernels for those sizes; the learning rate is a 0-d tensor on the device, so a schedule changes no
compiled code), after the group's step counts are advanced by one multi-tensor operation (:func:`count_steps_`); on
the CPU the same functions run eagerly with Python numbers. Like torch's fused optimizers it skips its update on the
device when ``found_inf`` is set (the non-finite guard's device flag, fp16's loss scaler) and divides the gradients by
``grad_scale`` when that is set, so it never waits for the GPU. No communication: it steps what it is given (a shard,
under the distributed optimizer or FSDP, where it updates the local part of each ``DTensor``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lightning_megatron.optimizer.param_remainders import join_fp32, split_fp32
from lightning_megatron.utils.tensors import (adjacent_runs, flat_run, local_tensor, span_bounds, span_starts,
                                              storage_order)

__all__ = ["PrecisionAwareAdamW", "OPTIMIZER_STATE_DTYPES", "optimizer_state_dtype", "optimizer_state_dtype_name"]

#: Inductor options of the compiled update: each pointwise kernel takes Inductor's default block instead of the
#: faster of the blocks timed at compile time. Timed alone, a kernel can pick a block that moves fewer bytes per
#: second once it runs inside a training step beside the other kernels, and the update is bound by memory traffic
#: (the choice was measured in benchmarks/RESULTS.md); the arithmetic per element is the same either way
UPDATE_COMPILE_OPTIONS: Dict[str, Any] = {"triton.autotune_pointwise": False}

#: Megatron's names for the moment dtypes this optimizer stores (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``)
OPTIMIZER_STATE_DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def optimizer_state_dtype(value: Union[str, torch.dtype], name: str = "exp_avg_dtype") -> torch.dtype:
    """``value`` (``"fp32"`` / ``"bf16"`` or the torch dtype) as a torch dtype; ValueError naming ``name``
    otherwise (fp16 and fp8 moments need scaling factors that are not built)."""
    if isinstance(value, str) and value in OPTIMIZER_STATE_DTYPES:
        return OPTIMIZER_STATE_DTYPES[value]
    if isinstance(value, torch.dtype) and value in OPTIMIZER_STATE_DTYPES.values():
        return value
    raise ValueError(f"{name}={value!r}: the moments are stored in 'fp32' (torch.float32) or 'bf16' "
                     "(torch.bfloat16); Megatron's fp16 / fp8 moments (scaled by per-tensor factors) are not built")


def optimizer_state_dtype_name(value: Union[str, torch.dtype], name: str = "exp_avg_dtype") -> str:
    """Megatron's name (``"fp32"`` / ``"bf16"``) of the moment dtype ``value`` (validated as
    :func:`optimizer_state_dtype`)."""
    dtype = optimizer_state_dtype(value, name)
    return next(k for k, v in OPTIMIZER_STATE_DTYPES.items() if v == dtype)


def adamw_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor,
                  lr: Union[float, Tensor],
                  beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: Optional[Tensor] = None,
                  found_inf: Optional[Tensor] = None, param_copy: Optional[Tensor] = None,
                  remainder: Optional[Tensor] = None) -> None:
    """One AdamW step of one tensor, in place, computed in fp32 whatever the dtypes the tensors are stored in.

    Args:
        param, grad, exp_avg, exp_avg_sq: tensors of one shape (any dtypes; the moments are rounded to theirs).
        step: 0-d fp32 tensor, the step count including this step (bias corrections ``1 - beta ** step``).
        lr, beta1, beta2, eps, weight_decay: AdamW's (decoupled weight decay ``param *= 1 - lr * weight_decay``);
            ``lr`` may be a 0-d fp32 tensor on the tensors' device (the compiled update's, see the module docstring).
        grad_scale: 0-d tensor the gradient is divided by, or None.
        found_inf: 0-d tensor; where it is > 0 nothing changes (the update is computed and discarded), or None.
        param_copy: a tensor of ``param``'s shape (the bf16 compute copy of an fp32 main parameter) that receives
            the new parameter rounded to its dtype in the same pass, or None.
        remainder: int16 of ``param``'s shape, or None. Given, the fp32 parameter is held as bf16 ``param`` plus this
            remainder (:mod:`~lightning_megatron.optimizer.param_remainders`): both are read as the fp32 value and
            both written with the new one (``param_copy`` is then None).
    """
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale
    m_old, v_old = exp_avg.float(), exp_avg_sq.float()
    p_old = join_fp32(param, remainder) if remainder is not None else param.float()
    m = m_old.lerp(g, 1 - beta1)
    v = v_old * beta2 + (1 - beta2) * g * g
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
    denom = v.sqrt() / bias_correction2_sqrt + eps
    p = p_old * (1 - lr * weight_decay) - (lr / bias_correction1) * (m / denom)
    if found_inf is not None:
        skip = found_inf > 0
        p, m, v = torch.where(skip, p_old, p), torch.where(skip, m_old, m), torch.where(skip, v_old, v)
    if remainder is not None:
        high, low = split_fp32(p)
        param.copy_(high)
        remainder.copy_(low)
    else:
        param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if param_copy is not None:
        param_copy.copy_(p)


def count_steps_(steps: List[Tensor], found_inf: Optional[Tensor] = None) -> None:
    """Add one to every step count of ``steps`` (0-d fp32 tensors on one device), or nothing where ``found_inf`` is
    > 0: one multi-tensor operation (on CUDA one fused launch per list chunk, not one kernel per parameter)."""
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        # ``alpha`` selects the Tensor overload: without it Python's argument parsing turns the 0-d tensor into a
        # Scalar with ``.item()``, a host read that waits for the GPU
        torch._foreach_add_(steps, 1.0 - (found_inf > 0).float(), alpha=1.0)


def adamw_multi_update_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                        steps: List[Tensor], lr: Union[float, Tensor], beta1: float, beta2: float, eps: float,
                        weight_decay: float,
                        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                        count_steps: bool = True, param_copies: Optional[List[Tensor]] = None,
                        remainders: Optional[List[Tensor]] = None) -> None:
    """:func:`adamw_update_` of every tensor of the lists (one entry per parameter, all on one device), after adding
    one to each ``steps`` entry (:func:`count_steps_`) unless ``count_steps`` is False (the caller counted them);
    ``param_copies``: each parameter's compute copy, written in the same pass, or None; ``remainders``: each bf16
    parameter's remainder (the two hold its fp32 value), or None."""
    if count_steps:
        count_steps_(steps, found_inf)
    copies = param_copies if param_copies is not None else [None] * len(params)
    rests = remainders if remainders is not None else [None] * len(params)
    for param, grad, exp_avg, exp_avg_sq, step, copy, rest in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies,
                                                                  rests):
        adamw_update_(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                      found_inf, copy, rest)


def _conform_state(state: Dict[str, Any], group: Dict[str, Any], device: torch.device) -> None:
    """``state`` in the optimizer's layout, in place: ``step`` a 0-dim fp32 tensor on ``device`` and the moments in
    ``group``'s dtypes. States from elsewhere need it: torch's loading casts the moments to the parameter's dtype,
    ``ZeroRedundancyOptimizer.load_state_dict`` writes the checkpoint's states directly (its moment dtypes, ``step``
    on the CPU), a torch AdamW checkpoint may hold ``step`` as a number."""
    step = state["step"]
    if not (torch.is_tensor(step) and step.device == device and step.dtype == torch.float32):
        state["step"] = torch.as_tensor(step, dtype=torch.float32).to(device)
    for key, dtype in (("exp_avg", group["exp_avg_dtype"]), ("exp_avg_sq", group["exp_avg_sq_dtype"])):
        if key in state and state[key].dtype != dtype:
            state[key] = state[key].to(dtype)


def _held(members: List[Tensor], state: Dict[Any, Dict[str, Any]],
          stepped: Callable[[Tensor], Tensor]) -> Tuple[List[Tensor], Tuple[int, ...]]:
    """What an update plan of ``members`` is built from: per parameter its moment and step tensors, and the address
    of the tensor the update writes for it, ``stepped(p)`` (``p.data`` may be swapped for another tensor)."""
    tensors: List[Tensor] = []
    for p in members:
        s = state[p]
        tensors += [s.get("exp_avg"), s.get("exp_avg_sq"), s.get("step")]
    return tensors, tuple(stepped(p).data_ptr() for p in members)


@dataclass(eq=False)
class _UpdatePlan:
    """The flat update lists of one parameter group's parameters on one device (:meth:`PrecisionAwareAdamW._plan`):
    ``members`` in storage order; the ``runs`` ``(start, stop)`` of adjacent views over them; ``grad_starts``, where
    the gradients' spans started (:func:`span_starts`); one flat tensor per run of the parameters, moments and
    compute copies (None where not written) and remainders (None where the parameters are not held as bf16 copy plus
    remainder: ``params`` are then the bf16 copies); each run's step count (its first parameter's) and every
    parameter's. ``held``: what it was built from (:func:`_held`)."""

    members: List[Tensor]
    held: Tuple[List[Tensor], Tuple[int, ...]]
    runs: List[Tuple[int, int]]
    grad_starts: List[int]
    params: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    copies: Optional[List[Tensor]]
    remainders: Optional[List[Tensor]]
    run_steps: List[Tensor]
    steps: List[Tensor]

    def holds(self, members: List[Tensor], state: Dict[Any, Dict[str, Any]],
              stepped: Callable[[Tensor], Tensor]) -> bool:
        """Whether the plan still serves ``members`` (this step's parameters with gradients, any order): the same
        parameters, their stepped tensors (``stepped(p)``) holding the same data, with the same moment and step
        tensors."""
        ids = {id(p) for p in members}
        if len(ids) != len(self.members) or any(id(p) not in ids for p in self.members):
            return False
        tensors, addresses = _held(self.members, state, stepped)
        return addresses == self.held[1] and all(a is b for a, b in zip(tensors, self.held[0]))

    def grads(self) -> List[Tensor]:
        """The members' gradients (their local tensors), in plan order."""
        return [local_tensor(p.grad) for p in self.members]

    def fits(self, grads: List[Tensor]) -> bool:
        """Whether ``grads`` (the members' gradients, in plan order) lie as those the plan was built with did: adjacent
        views over the same spans (so over every run, and merging no more than then)."""
        return span_starts(grads) == self.grad_starts


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's and Megatron's formula) with its moments stored in
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` and the update computed in fp32 (see the module docstring).

    Args:
        params: parameters or parameter groups (fp32 parameters: the main parameters).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        exp_avg_dtype, exp_avg_sq_dtype: ``torch.float32`` / ``"fp32"`` or ``torch.bfloat16`` / ``"bf16"``
            (Megatron's ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``); also per parameter group.

    State per parameter: ``step`` (0-d fp32 on the parameter's device, as torch's fused AdamW), ``exp_avg`` and
    ``exp_avg_sq`` (the parameter's shape, in their dtypes), so its state dicts load into ``torch.optim.AdamW`` and
    back (loading casts the moments to this optimizer's dtypes).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 exp_avg_dtype: Union[str, torch.dtype] = torch.float32,
                 exp_avg_sq_dtype: Union[str, torch.dtype] = torch.float32) -> None:
        if isinstance(lr, Tensor) or not lr >= 0:
            raise ValueError(f"PrecisionAwareAdamW(lr={lr!r}) must be a float >= 0")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"PrecisionAwareAdamW(betas={betas!r}) must be two floats in [0, 1)")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"PrecisionAwareAdamW(eps={eps!r}, weight_decay={weight_decay!r}) must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        exp_avg_dtype=optimizer_state_dtype(exp_avg_dtype, "exp_avg_dtype"),
                        exp_avg_sq_dtype=optimizer_state_dtype(exp_avg_sq_dtype, "exp_avg_sq_dtype"))
        super().__init__(params, defaults)
        for group in self.param_groups:
            group["exp_avg_dtype"] = optimizer_state_dtype(group["exp_avg_dtype"], "exp_avg_dtype")
            group["exp_avg_sq_dtype"] = optimizer_state_dtype(group["exp_avg_sq_dtype"], "exp_avg_sq_dtype")
            for p in group["params"]:
                if not p.is_floating_point():
                    raise ValueError(f"PrecisionAwareAdamW: a parameter of dtype {p.dtype} is not floating point")
        # it reads ``grad_scale`` / ``found_inf`` itself (torch.amp.GradScaler and the non-finite guard hand them over)
        self._step_supports_amp_scaling = True
        self._compiled: Optional[Callable[..., None]] = None
        #: ``id(p)`` -> the steps taken of ``p`` (host-side, known without reading the device: set when its state is
        #: created or loaded): parameters whose counts differ are not updated as one run (a run has one bias correction)
        self._counts: Dict[int, int] = {}
        self._param_copy: Optional[Callable[[Tensor], Tensor]] = None
        self._main_param: Optional[Callable[[Tensor], Tensor]] = None
        self._remainder: Optional[Callable[[Tensor], Tensor]] = None
        #: (group index, device) -> (the learning rate it holds, 0-d fp32 tensor on the device): the compiled update's
        #: learning rate, refilled (one small kernel, no host wait) when the group's changes
        self._lr_tensors: Dict[Tuple[int, torch.device], Tuple[float, Tensor]] = {}
        #: (group index, device) -> the plan of its last update (:meth:`_runs`)
        self._plans: Dict[Tuple[int, torch.device], _UpdatePlan] = {}

    def write_param_copies(self, param_copy: Optional[Callable[[Tensor], Tensor]]) -> None:
        """From the next step on, also write each stepped parameter, rounded, into ``param_copy(p)`` (a tensor of
        its shape: the bf16 compute copy of an fp32 main parameter, :class:`~lightning_megatron.parallel.param_buffer.buffer.
        MainParams`) in the same pass as the update, instead of a copy over all parameters after the step. None:
        stop. Parameters without a gradient in a step are not written (they did not change)."""
        self._param_copy = param_copy
        self._plans.clear()

    def step_main_params(self, main_param: Optional[Callable[[Tensor], Tensor]]) -> None:
        """From the next step on, update ``main_param(p)`` (a tensor of ``p``'s shape: the fp32 main parameter of a
        bf16 parameter, :class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`) instead of the tensor ``p``
        holds, with ``p.grad`` as the gradient: the step is then the same whether ``p`` holds its main parameter
        (and ``p.grad`` the fp32 main gradient) or its bf16 compute copy (and ``p.grad`` the bf16 gradient as the
        backward left it). None: update what ``p`` holds."""
        self._main_param = main_param
        self._plans.clear()

    def step_param_remainders(self, remainder: Optional[Callable[[Tensor], Tensor]]) -> None:
        """From the next step on, step the fp32 main parameter of ``p`` held as its bf16 compute copy (the tensor
        :meth:`write_param_copies` names) plus ``remainder(p)`` (int16 of ``p``'s shape; Megatron's
        ``--store-param-remainders``, :mod:`~lightning_megatron.optimizer.param_remainders`), with ``p.grad`` as
        the gradient, in either view, writing both halves in the update's pass. Takes precedence over
        :meth:`step_main_params`. None: stop."""
        self._remainder = remainder
        self._plans.clear()

    def _stepped(self, p: Tensor) -> Tensor:
        """The tensor the update writes for parameter ``p`` (its local part): its remainder
        (:meth:`step_param_remainders`), its main parameter (:meth:`step_main_params`) or ``p``."""
        if self._remainder is not None:
            return local_tensor(self._remainder(p))
        return local_tensor(self._main_param(p) if self._main_param is not None else p)

    def _update_fn(self, device: torch.device) -> Callable[..., None]:
        """The update of a list of tensors: for CUDA compiled for the lists' shapes (a group's flat runs keep theirs
        for the whole run; another set of shapes compiles once more, up to torch's recompile limit per process,
        after which it runs eagerly), eager elsewhere."""
        if device.type != "cuda":
            return adamw_multi_update_
        if self._compiled is None:
            self._compiled = torch.compile(adamw_multi_update_, dynamic=False, fullgraph=True,
                                           options=UPDATE_COMPILE_OPTIONS)
        return self._compiled

    def _lr(self, index: int, group: Dict[str, Any], device: torch.device) -> Union[float, Tensor]:
        """Group ``index``'s learning rate as the update on ``device`` takes it: a Python float off CUDA, else a 0-d
        fp32 tensor on the device that is refilled only when the value changed (a compiled constant would compile
        the update again for every value a schedule produces)."""
        lr = float(group["lr"])
        if device.type != "cuda":
            return lr
        held = self._lr_tensors.get((index, device))
        if held is not None and held[0] == lr:
            return held[1]
        value = held[1].fill_(lr) if held is not None else torch.full((), lr, dtype=torch.float32, device=device)
        self._lr_tensors[(index, device)] = (lr, value)
        return value

    def _init_state(self, p: Tensor, group: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
        """The state of ``p`` (its local part on ``device``): what is missing created (at its first step; moments as
        zeros of its own unless :meth:`_home_moments` gave it views), all of it brought to this optimizer's layout
        (:func:`_conform_state`)."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            self._counts[id(p)] = 0
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=group[key + "_dtype"], memory_format=torch.preserve_format)
        _conform_state(state, group, device)
        if id(p) not in self._counts:   # a state written by another loader (ZeroRedundancyOptimizer): read it once
            self._counts[id(p)] = int(state["step"].item())
        return state

    def _home_moments(self, params: List[Tensor], members: List[Tensor], group: Dict[str, Any],
                      device: torch.device) -> None:
        """Give the moments of ``members`` (parameters in storage order; ``params`` their local tensors) the
        parameters' layout: for each run of adjacent parameters one buffer per moment, each parameter's moment a view
        into it (created as zeros, or holding the moment it had: e.g. loaded from a checkpoint). Separate parameters
        keep moments of their own (``zeros_like``, a ``DTensor`` for a ``DTensor`` parameter)."""
        for start, stop in span_bounds(params):
            ps = members[start:stop]
            if stop - start == 1 or any(local_tensor(p) is not p for p in ps):
                for p in ps:
                    self._init_state(p, group, device)
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                current = [self.state[p].get(key) for p in ps]
                if all(t is not None for t in current) and len(span_bounds(current)) == 1:
                    continue
                chunk = torch.zeros(sum(p.numel() for p in ps), dtype=group[key + "_dtype"], device=device)
                offset = 0
                for p, t in zip(ps, current):
                    n = p.numel()
                    view = chunk[offset:offset + n].view(p.shape)
                    if t is not None:
                        view.copy_(t)
                    self.state[p][key] = view
                    offset += n
            for p in ps:
                self._init_state(p, group, device)

    def _plan(self, members: List[Tensor], device: torch.device, group: Dict[str, Any]) -> _UpdatePlan:
        """The update plan of ``members`` (parameters with gradients, on ``device``; moments created or homed here):
        one run wherever parameters, gradients, moments (and compute copies) are all adjacent views and the step
        counts are equal (the count of a run is its first parameter's)."""
        members = [members[i] for i in storage_order([self._stepped(p) for p in members])]
        stepped = [self._stepped(p) for p in members]
        self._home_moments(stepped, members, group, device)
        grads = [local_tensor(p.grad) for p in members]
        states = [self.state[p] for p in members]
        exp_avgs = [local_tensor(s["exp_avg"]) for s in states]
        exp_avg_sqs = [local_tensor(s["exp_avg_sq"]) for s in states]
        held_in_halves = self._remainder is not None
        if held_in_halves and self._param_copy is None:
            raise RuntimeError("PrecisionAwareAdamW.step_param_remainders needs write_param_copies: the bf16 copies "
                               "hold the high half of each fp32 main parameter")
        copies = [self._param_copy(p) for p in members] if self._param_copy is not None else None
        # the column the update writes as parameters first; with remainders the bf16 copies hold the high halves
        # and the stepped tensors the low ones, otherwise the stepped tensors are the parameters (copies optional)
        params, extra = (copies, stepped) if held_in_halves else (stepped, copies)
        columns = [params, grads, exp_avgs, exp_avg_sqs] + ([extra] if extra is not None else [])
        counts = [self._counts[id(p)] for p in members]
        cuts = [i for i in range(1, len(members)) if counts[i] != counts[i - 1]]
        runs = adjacent_runs(columns, cuts)
        flat = [[flat_run(column, a, b) for a, b in runs] for column in columns]
        flat_extra = flat[4] if extra is not None else None
        return _UpdatePlan(members=members, held=_held(members, self.state, self._stepped), runs=runs,
                           grad_starts=span_starts(grads), params=flat[0], exp_avgs=flat[2],
                           exp_avg_sqs=flat[3], copies=None if held_in_halves else flat_extra,
                           remainders=flat_extra if held_in_halves else None,
                           run_steps=[states[a]["step"] for a, _ in runs], steps=[s["step"] for s in states])

    def _runs(self, members: List[Tensor], device: torch.device, group: Dict[str, Any],
              index: int) -> Tuple[Any, ...]:
        """The flat update lists of ``members`` (parameters with gradients of group ``index``, on ``device``):
        ``(params, grads, exp_avgs, exp_avg_sqs, run_steps, steps, copies, remainders)``, one entry per run (``steps``:
        one per parameter). The plan of the previous step is used again when it still holds (the same parameters with
        gradients, the same parameter and state tensors, the gradients adjacent over its runs): then the host work
        is a few checks and one flat view of the gradients per run, not the planning per parameter."""
        plan = self._plans.get((index, device))
        grads: Optional[List[Tensor]] = None
        if plan is not None and plan.holds(members, self.state, self._stepped):
            grads = plan.grads()
            if not plan.fits(grads):
                grads = None
        if grads is None:
            plan = self._plans[(index, device)] = self._plan(members, device, group)
            grads = plan.grads()
        for p in plan.members:
            self._counts[id(p)] += 1
        return (plan.params, [flat_run(grads, a, b) for a, b in plan.runs], plan.exp_avgs, plan.exp_avg_sqs,
                plan.run_steps, plan.steps, plan.copies, plan.remainders)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW step of every parameter with a gradient (see :func:`adamw_update_`): one call of the update per
        parameter group and device, over the group's runs of adjacent views (the module docstring). Returns the
        closure's value. Reads ``self.grad_scale`` and ``self.found_inf`` when set (one-element tensors:
        ``torch.amp.GradScaler`` hands over ``[1]``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Optional[Tensor] = getattr(self, "grad_scale", None)
        found_inf: Optional[Tensor] = getattr(self, "found_inf", None)
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            by_device: Dict[torch.device, List[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("PrecisionAwareAdamW does not support sparse gradients")
                by_device.setdefault(local_tensor(p).device, []).append(p)
            for device, members in by_device.items():
                (params, grads, exp_avgs, exp_avg_sqs, run_steps, steps, copies,
                 remainders) = self._runs(members, device, group, index)
                scale = grad_scale.to(device).reshape(()) if grad_scale is not None else None
                inf = found_inf.to(device).reshape(()) if found_inf is not None else None
                count_steps_(steps, inf)   # eager: one fused launch, where the compiled update would launch one each
                self._update_fn(device)(
                    params, grads, exp_avgs, exp_avg_sqs, run_steps, self._lr(index, group, device), float(beta1),
                    float(beta2),
                    float(group["eps"]), float(group["weight_decay"]), scale, inf, count_steps=False,
                    param_copies=copies, remainders=remainders)
        return loss

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's loading (which casts the moments to the parameters' dtype), then the moments to this optimizer's
        dtypes (its own, whatever the state dict's optimizer kept: e.g. torch's AdamW with fp32 moments) and ``step``
        to an fp32 tensor on the parameter's device."""
        dtypes = [(g["exp_avg_dtype"], g["exp_avg_sq_dtype"]) for g in self.param_groups]
        super().load_state_dict(state_dict)
        self._plans.clear()
        for group, (exp_avg_dtype, exp_avg_sq_dtype) in zip(self.param_groups, dtypes):
            group["exp_avg_dtype"], group["exp_avg_sq_dtype"] = exp_avg_dtype, exp_avg_sq_dtype
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    _conform_state(state, group, local_tensor(p).device)
                    self._counts.pop(id(p), None)   # read from the loaded state at the next step
