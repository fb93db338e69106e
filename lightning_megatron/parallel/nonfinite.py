"""Non-finite guard (Megatron's ``--check-for-nan-in-loss-and-grad``, on by default).

A NaN or inf in the step's loss, in the global gradient norm or in the weights about to be checkpointed stops the
run with a :class:`NonFiniteError` naming the step, the ranks and the first offending parameter on each, instead
of training on and writing NaN checkpoints over good ones. Every check decides on a value that is the same on
every rank (the step loss and the global norm are reduced already; the local checks are summed over the world
first), so all ranks raise together and none is left waiting in a collective. Finding the parameter names costs a
pass over the local tensors and one ``all_gather_object``, on the failure path only.

:class:`NonFiniteGuard` holds the module (for parameter names) and the step; the strategy calls
:meth:`~NonFiniteGuard.check_loss` after the step's forward and backward,
:meth:`~NonFiniteGuard.check_grad_norm` on the norm that clipping computed (before it scales anything) or
:meth:`~NonFiniteGuard.check_grads` without clipping, and :meth:`~NonFiniteGuard.check_weights` before a
checkpoint is written.

Decided on the device (no host synchronisation): when the optimizer can skip its own update on the device (a fused
torch optimizer, which reads ``optimizer.found_inf``), :meth:`~NonFiniteGuard.start_step` arms a device flag that the
step's checks raise and the optimizer reads, so a non-finite step changes no weight and no optimizer state without
the host waiting for the GPU. The verdict travels to the host behind the step (:meth:`~NonFiniteGuard.end_step`), with
each parameter's local gradient norm (the per-tensor norms the checks compute anyway, so the failing parameter is
still named once its gradient is gone), and is read by :meth:`~NonFiniteGuard.settle` after the next optimizer step's
forward and backward are queued (before its gradients are reduced, checked or applied), at the end of training and
before a checkpoint is written: the same error (naming the step it happened at) or the same skip, one step later in
host time. By then the GPU has long finished that step's checks, so the host does not wait and the GPU always has a
step's work queued. A check that waits for the GPU at every step costs the step the time the host then needs to
queue work again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.optimizer import PrecisionAwareAdamW
from lightning_megatron.utils.max_abs import MaxAbsPerTensor
from lightning_megatron.utils.tensors import coalesce, local_tensor

#: what the error tells the user to do
_FIX = ("lower the learning rate (or warm it up), clip gradients (gradient_clip_val), check the data, or use a "
        "wider precision; check_for_nan_in_loss_and_grad=False (--no-check-for-nan-in-loss-and-grad) turns this "
        "check off")


class NonFiniteError(RuntimeError):
    """A NaN or inf loss, gradient norm or weight; raised on every rank together."""


class NonFiniteStepSkipped(NonFiniteError):
    """In ``skip`` mode: a NaN or inf loss or gradient; raised on every rank together from inside the optimizer
    step's closure, before the optimizer updates anything. The strategy catches it, drops the step and goes on."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_max_abs(tensors: Iterable[Tensor]) -> Tensor:
    """Sum over ``tensors`` of their largest absolute value, in float32 (NaN and inf propagate; an empty list
    gives 0): finite exactly when every element of every tensor is finite. One fused pass, over the tensors' flat
    spans (adjacent views of a contiguous buffer count as one)."""
    tensors = [local_tensor(t.detach()) for t in tensors if t is not None and t.is_floating_point()]
    tensors = [t for t in tensors if t.numel() > 0]   # FSDP shards: this rank's part (the check sums over ranks)
    if not tensors:
        return torch.zeros(())
    flats = coalesce(tensors)
    return _float_vector(flats, torch._foreach_norm(flats, float("inf")))[1].sum()


def per_tensor_max_abs(params: List[nn.Parameter],
                       max_abs: Optional[MaxAbsPerTensor] = None) -> Tuple[List[nn.Parameter], Tensor]:
    """``(order, values)``: each gradient's largest absolute value (its local part, float32 ``[n]``; NaN and inf
    propagate) for the parameters of ``params`` that hold a floating-point gradient, in the order ``order`` of
    ``values``. One pass over the gradients (:class:`~lightning_megatron.utils.max_abs.MaxAbsPerTensor`: on CUDA one
    kernel per dtype; ``max_abs``: one that keeps its tables between calls). No communication."""
    pairs = [(p, local_tensor(p.grad.detach())) for p in params if p.grad is not None]
    pairs = [(p, g) for p, g in pairs if g.is_floating_point() and g.numel() > 0]
    if not pairs:
        return [], torch.zeros(0)
    return [p for p, _ in pairs], (max_abs or MaxAbsPerTensor())([g for _, g in pairs])


def _float_vector(keys: List[Any], values: List[Tensor]) -> Tuple[List[Any], Tensor]:
    """``values`` (0-d tensors, one per entry of ``keys``: parameters, or the tensors they were computed from) as one
    float32 vector: one stack and one cast per dtype (not a cast kernel per tensor), so the keys come back reordered
    by dtype."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(i)
    order = [i for group in by_dtype.values() for i in group]
    vector = torch.cat([torch.stack([values[i] for i in group]).float() for group in by_dtype.values()])
    return [keys[i] for i in order], vector


def first_non_finite(named: Iterable[Tuple[str, Optional[Tensor]]]) -> Optional[Tuple[str, str]]:
    """``(name, "nan" or "inf")`` of the first tensor holding a non-finite value, or None."""
    for name, t in named:
        t = local_tensor(t)
        if t is None or not t.is_floating_point():
            continue
        if torch.isnan(t).any():
            return name, "nan"
        if torch.isinf(t).any():
            return name, "inf"
    return None


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` skips its update on the device when ``optimizer.found_inf`` (a float tensor) is 1: torch's
    fused optimizers (``fused=True``, e.g. ``AdamW``) and :class:`~lightning_megatron.optimizer.PrecisionAwareAdamW`,
    which also leave their step counts unchanged then, over plain (not DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    original = getattr(optimizer, "original", None)   # the distributed optimizer of bf16 parameters: as the user's
    if isinstance(original, torch.optim.Optimizer) and getattr(optimizer, "main_params", None) is not None:
        return skips_on_device(original)
    if not (isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, "_step_supports_amp_scaling", False)
            and (optimizer.defaults.get("fused") or isinstance(optimizer, PrecisionAwareAdamW))):
        return False
    # FSDP's DTensor parameters would meet a plain flag tensor inside the fused kernel's dispatch
    return not any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


@dataclass
class _Verdict:
    """A step's checked values on their way to the host, readable once ``ready`` has passed: ``values[i]`` of check
    ``names[i]``, then the local gradient norm of each parameter of ``params`` (in that order)."""

    step: Optional[int]
    names: List[str]
    params: List[nn.Parameter]
    values: Tensor
    ready: Any


#: what each check's non-finite value says, in the order the synchronous checks decide
_WHAT = {"loss": "the loss is {}", "norm": "the global gradient norm is {}", "grads": "a gradient is {}"}


def _kind(value: float) -> str:
    return "nan" if math.isnan(value) else "inf"


class NonFiniteGuard:
    """Stops a run at the first non-finite loss, gradient norm or checkpointed weight (see the module docstring).

    Args:
        module: the (parallelised) module whose parameters are named in errors.
        enabled: False turns every check into a no-op.
        grads: False turns the gradient checks off only (fp16 with a loss scaler: an overflow there is the
            scaler's business, it skips the step).
        skip: a non-finite loss or gradient raises :class:`NonFiniteStepSkipped` (the step is dropped) instead of
            :class:`NonFiniteError`; non-finite weights before a checkpoint still raise ``NonFiniteError``.

    Attributes:
        step: the optimizer step being run (``trainer.global_step``: steps done before it), named in errors.
    """

    def __init__(self, module: nn.Module, enabled: bool = True, grads: bool = True, skip: bool = False) -> None:
        self.module, self.enabled, self.grads, self.skip = module, enabled, grads, skip
        self.step: Optional[int] = None
        #: this step's checks are decided on the device (see the module docstring); set by :meth:`start_step`
        self.on_device = False
        self._found: Optional[Tensor] = None     # the device flag the optimizer reads
        self._values: Dict[str, Tensor] = {}    # this step's checked values, by check
        self._per_param: Tuple[List[nn.Parameter], Optional[Tensor]] = ([], None)   # this step's gradient norms
        self._pending: Optional[_Verdict] = None
        self._sent: Optional[_Verdict] = None     # this step's checked values, on their way to the host
        # pinned landing places of the values, used in turn: the last step's stay readable while this one's land
        self._host: List[Optional[Tensor]] = [None, None]
        self._turn = 0
        self._max_abs = MaxAbsPerTensor()   # the gradients' per-tensor pass, its device tables kept

    # ------------------------------------------------------------------ the device-side verdict
    def start_step(self, optimizer: Any) -> None:
        """At an optimizer step's start (the previous step's verdict is settled later, behind this step's backward):
        decide this step's checks on the device when
        ``optimizer`` can skip its update there (:func:`skips_on_device`; None: it cannot, e.g. fp16's loss scaler
        owns ``found_inf``). The flag is handed to the optimizer as ``found_inf``."""
        self._values, self._sent, self._per_param = {}, None, ([], None)
        self._turn = 1 - self._turn
        self.on_device = self.enabled and optimizer is not None and skips_on_device(optimizer)
        if not self.on_device:
            if optimizer is not None and self._found is not None and getattr(optimizer, "found_inf", None) is self._found:
                del optimizer.found_inf
            return
        device = next(iter(optimizer.param_groups[0]["params"])).device
        if self._found is None or self._found.device != device:
            self._found = torch.zeros((), dtype=torch.float32, device=device)
        else:
            self._found.zero_()
        optimizer.found_inf = self._found

    def _note(self, name: str, value: Tensor,
              per_param: Optional[Tuple[List[nn.Parameter], Tensor]] = None) -> None:
        """Record a checked value (and ``per_param``: the parameters and their local gradient norms ``[n]`` it was
        computed from), raise the device flag when it is not finite and send the values so far to the host (no host
        synchronisation). The last check's copy is the one :meth:`settle` waits for: it is queued before the
        optimizer's kernels, so settling waits for the checks only, not for the optimizer step behind them."""
        assert self._found is not None
        value = value.detach().to(self._found.device, torch.float32).reshape(())
        self._values[name] = value
        torch.maximum(self._found, (~torch.isfinite(value)).float(), out=self._found)
        if per_param is not None:
            self._per_param = (per_param[0], per_param[1].detach().to(self._found.device, torch.float32))
        names = [n for n in _WHAT if n in self._values]
        params, norms = self._per_param
        values = torch.stack([self._values[n] for n in names])
        if norms is not None:
            values = torch.cat([values, norms])
        if values.is_cuda:
            host = self._host[self._turn]
            if host is None or host.numel() < values.numel():
                host = self._host[self._turn] = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
            host = host[:values.numel()]
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = values, None
        self._sent = _Verdict(self.step, names, list(params), host, ready)

    def end_step(self) -> None:
        """After the optimizer step: this step's verdict (sent to the host by its last check) is the one
        :meth:`settle` reads next."""
        if self.on_device and self._sent is not None:
            self._pending = self._sent
        self._sent, self._values = None, {}

    def settle(self) -> None:
        """Read the last device-decided step's verdict (waits for that step's checks only, not for the work queued
        after them): a non-finite value raises as the synchronous checks do, naming that step and the parameter whose
        gradient norm sent with the verdict is not finite (the optimizer has already skipped its update; the
        gradients themselves may be the next step's by now). Collective on the failure path: every rank calls it at
        the same point."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None:
            pending.ready.synchronize()
        values = pending.values.tolist()
        checks, norms = values[:len(pending.names)], values[len(pending.names):]
        bad = [(n, v) for n, v in zip(pending.names, checks) if not math.isfinite(v)]
        if bad:
            name, value = bad[0]
            self.step = pending.step
            self._raise(_WHAT[name].format(_kind(value)), grads=True,
                        grad_norms={id(p): v for p, v in zip(pending.params, norms)} if pending.params else None)

    # ------------------------------------------------------------------ checks
    def check_loss(self, loss: Tensor) -> None:
        """``loss``: the step's loss, the same on every rank. Raises :class:`NonFiniteError` when it is not finite
        (one host sync); decided on the device after :meth:`start_step` armed it (raised by :meth:`settle`)."""
        if self.enabled and self.on_device:
            self._note("loss", loss)
        elif self.enabled and not bool(torch.isfinite(loss.detach()).all()):
            self._raise(f"the loss is {_kind(float(loss))}", grads=True)

    @property
    def sends_grad_norms(self) -> bool:
        """Whether :meth:`check_grad_norm` uses the per-parameter norms (the device-decided check, which sends them
        with its verdict): callers compute them only then."""
        return self.enabled and self.grads and self.on_device

    def check_grad_norm(self, norm: Tensor, local_norms: Optional[List[Tuple[nn.Parameter, Tensor]]] = None) -> None:
        """``norm``: the global gradient norm, the same on every rank (before clipping scales anything); on the device
        as :meth:`check_loss`, where ``local_norms`` (``(parameter, its local gradient's norm)`` pairs, from
        :func:`~lightning_megatron.parallel.grad_norm.global_grad_norm`) go with the verdict to name the parameter."""
        if self.sends_grad_norms:
            per_param = _float_vector([p for p, _ in local_norms], [n for _, n in local_norms]) if local_norms else None
            self._note("norm", norm, per_param)
        elif self.enabled and self.grads and not bool(torch.isfinite(norm.detach()).all()):
            self._raise(f"the global gradient norm is {_kind(float(norm))}", grads=True)

    def check_grads(self, params: Optional[List[nn.Parameter]] = None) -> None:
        """Check every gradient of ``params`` (default: the module's) without computing the norm: the largest
        absolute values summed over the world (one all-reduce of a scalar, one host sync; on the device as
        :meth:`check_loss`)."""
        if not (self.enabled and self.grads):
            return
        params = list(self.module.parameters()) if params is None else params
        if self.on_device:
            order, values = per_tensor_max_abs(params, self._max_abs)
            local = values.sum() if order else torch.zeros(())
            self._note("grads", self._world_sum_tensor(local), (order, values) if order else None)
            return
        value = float(self._world_sum_tensor(local_max_abs(p.grad for p in params)))
        if not math.isfinite(value):
            self._raise(f"a gradient is {_kind(value)}", grads=True)

    def check_weights(self) -> None:
        """Check every floating-point parameter and buffer of the module (collective over the world); raises
        :class:`NonFiniteError` before a checkpoint holding them is written."""
        if not self.enabled:
            return
        value = float(self._world_sum_tensor(local_max_abs(self.module.state_dict().values())))
        if not math.isfinite(value):
            self._raise("a weight is non-finite; no checkpoint was written", grads=False)

    # ------------------------------------------------------------------ helpers
    def _world_sum_tensor(self, value: Tensor) -> Tensor:
        device = next((p.device for p in self.module.parameters()), value.device)
        value = value.to(device)
        if _distributed():
            dist.all_reduce(value)
        return value

    def _raise(self, what: str, grads: bool, grad_norms: Optional[Dict[int, float]] = None) -> None:
        """Name the first non-finite weight (and gradient) on every rank, then raise (collective over the world:
        every rank gets here together). ``grad_norms``: the step's local gradient norms by parameter ``id`` (a
        device-decided step, whose gradients are gone by now); None: the gradients are read."""
        named = list(self.module.named_parameters())
        found = first_non_finite(named)
        weight = f"weight {found[0]} ({found[1]})" if found else None
        grad = None
        if grads:
            if grad_norms is not None:
                found = next(((name, _kind(grad_norms[id(p)])) for name, p in named
                              if id(p) in grad_norms and not math.isfinite(grad_norms[id(p)])), None)
            else:
                found = first_non_finite((name, p.grad) for name, p in named)
            grad = f"gradient of {found[0]} ({found[1]})" if found else None
        if weight is None and grads:
            buffers = first_non_finite(self.module.named_buffers())
            weight = f"buffer {buffers[0]} ({buffers[1]})" if buffers else None
        local = "; ".join(x for x in (grad, weight) if x) or None
        if _distributed():
            gathered: List[Optional[str]] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        where = [f"rank {r}: {text}" for r, text in enumerate(gathered) if text]
        first = ("first non-finite values: " + ", ".join(where)) if where else (
            "no single gradient or weight is non-finite: the sum of squares overflowed (gradients are huge)")
        step = f"at step {self.step} (trainer.global_step)" if self.step is not None else "in this step"
        if grads and self.skip:
            raise NonFiniteStepSkipped(f"non-finite value {step}: {what}; {first}. The step was skipped on every "
                                       "rank (check_for_nan_in_loss_and_grad='skip')")
        stopped = ("the optimizer step was not taken, so the weights and the checkpoints written so far are the "
                   "last finite ones" if grads else "the last checkpoint written is the last finite one")
        raise NonFiniteError(f"non-finite value {step}: {what}; {first}. {stopped.capitalize()}. To go on: {_FIX}")
