"""Megatron's bf16 semantics: parameters stored in bf16, fp32 main parameters stepped by the optimizer and fp32
gradient accumulation (``main_grad``, Megatron's ``--accumulate-allreduce-grads-in-fp32``).

:class:`MainParams` keeps, for every floating-point parameter ``p`` of a module, two persistent tensors: the
compute copy (``params_dtype``, bf16) and the fp32 main parameter. The ``nn.Parameter`` object itself stays the
one identity that the optimizer, the gradient reductions, clipping and checkpoints refer to; only what it holds
(``p.data``) switches between two views::

    compute view  (forward / backward)   p.data = bf16 copy   p.grad = None (bf16 grads are moved out at once)
    main view     (reduce / clip / step)  p.data = fp32 main   p.grad = fp32 main_grad

* Forward and backward run on the bf16 copy: no per-forward fp32 -> bf16 cast under autocast (for a bf16 weight
  autocast's cast is a no-op), activations and GEMMs as in Megatron's ``Float16Module``.
* A post-accumulate-grad hook on every parameter adds its bf16 gradient into the fp32 ``main_grad`` (created at
  the first micro-batch of a step) and frees it, so micro-batches accumulate in fp32.
* :meth:`to_main` (the first thing of ``GradientFinalizer.finalize``) switches to the main view: everything after it
  (data / sequence / expert parallel reductions, the tied-embedding sum, the global-norm clip, the non-finite
  guard, the optimizer and the distributed optimizer's states and broadcasts) sees fp32 parameters and fp32
  gradients; the tensor to reduce is ``p.grad`` there (equal to :meth:`main_grad` of ``p``).
* :meth:`to_compute` (an optimizer step post-hook, and the start of every training step) copies the stepped fp32
  main parameters into the bf16 copies and switches back.
* :meth:`main_view` (a context) is the main view without gradients, for checkpoints: a checkpoint holds the fp32
  main parameters as the parameters (resume is exact; it loads into the default fp32 path), and loading writes
  them (the bf16 copies follow when the context exits). Optimizer states are loaded in that view too (torch
  casts loaded states to the parameter's dtype).

Memory per parameter: 2 bytes (bf16 copy) + 4 (fp32 main) + 4 (fp32 main grad during a step), Megatron's.
No communication here; the gradients are reduced by the caller over its groups (the step path does not wrap
torch DDP around a module with main parameters: its reducer would own the bf16 gradients).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Generator, List, Optional

import torch
from torch import Tensor, nn

__all__ = ["MainParams", "PARAMS_DTYPES"]

#: the parameter dtypes with fp32 main parameters (None: the parameters are the fp32 main parameters)
PARAMS_DTYPES = (None, torch.bfloat16)


def check_bf16_params_options(config: Any, fitting: bool) -> None:
    """Raise ValueError for the :class:`ParallelConfig` options that bf16 parameters (``MegatronPrecision(
    params_dtype=torch.bfloat16)``) do not combine with: the overlapped gradient reduction and parameter gather,
    and (when ``fitting``) FSDP's sharding levels."""
    if config.overlap_grad_reduce or config.overlap_param_gather:
        raise ValueError(
            f"overlap_grad_reduce={config.overlap_grad_reduce}, overlap_param_gather={config.overlap_param_gather} "
            "with MegatronPrecision(params_dtype=torch.bfloat16): the fp32 main gradients are reduced after the "
            "backward and the main parameters copied back to bf16 right after the optimizer step, so neither "
            "overlap is built for bf16 parameters; leave both options unset (or use the default fp32 parameters)")
    if fitting and config.fsdp:
        raise ValueError(
            f"data_parallel_sharding_strategy={config.data_parallel_sharding_strategy!r} with "
            "MegatronPrecision(params_dtype=torch.bfloat16): FSDP keeps its own bf16 compute copies and fp32 "
            "sharded parameters (its mixed-precision policy follows the precision plugin); drop params_dtype, "
            "or use data_parallel_sharding_strategy='optim' (the distributed optimizer) with bf16 parameters")


class MainParams:
    """bf16 parameters with fp32 main parameters and fp32 main gradients for the parameters of ``module``
    (see the module docstring). Built once, after materialisation (the parameters then hold the fp32 values,
    which become the main parameters); starts in the compute view.

    Args:
        module: the (parallelised, materialised) module; its floating-point parameters get a main copy.
        params_dtype: the compute dtype of the parameters (``torch.bfloat16``).
    """

    def __init__(self, module: nn.Module, params_dtype: torch.dtype = torch.bfloat16) -> None:
        if params_dtype not in PARAMS_DTYPES or params_dtype is None:
            raise ValueError(f"params_dtype={params_dtype!r}: MainParams stores parameters in torch.bfloat16 "
                             "(with fp32 main parameters); use params_dtype=torch.bfloat16 or None (fp32)")
        self.params_dtype = params_dtype
        self.params: List[nn.Parameter] = []
        self._main: Dict[int, Tensor] = {}
        self._compute: Dict[int, Tensor] = {}
        self._main_grad: Dict[int, Optional[Tensor]] = {}
        self._hooks: List[Any] = []
        self.in_main_view = False
        seen = set()
        for p in module.parameters():
            if id(p) in seen or not p.is_floating_point() or p.is_meta:
                continue
            seen.add(id(p))
            main = p.data if p.dtype == torch.float32 else p.data.float()
            self.params.append(p)
            self._main[id(p)] = main
            self._compute[id(p)] = main.to(params_dtype)
            self._main_grad[id(p)] = None
            p.data = self._compute[id(p)]
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    # ------------------------------------------------------------------ gradients
    def _accumulate(self, p: Tensor) -> None:
        """Post-accumulate-grad hook: ``main_grad += p.grad`` in fp32, then free ``p.grad``."""
        if self.in_main_view or p.grad is None:
            return
        key = id(p)
        with torch.no_grad():
            acc = self._main_grad[key]
            if acc is None:
                self._main_grad[key] = p.grad.to(torch.float32)
            else:
                acc.add_(p.grad)
        p.grad = None

    def main_grad(self, p: nn.Parameter) -> Optional[Tensor]:
        """The fp32 gradient of ``p`` accumulated over this step's micro-batches (None before its first one):
        the tensor a data-parallel reduction works on (in the main view it is also ``p.grad``)."""
        return self._main_grad[id(p)]

    def main_param(self, p: nn.Parameter) -> Tensor:
        """The fp32 main parameter of ``p`` (what the optimizer steps and checkpoints hold)."""
        return self._main[id(p)]

    # ------------------------------------------------------------------ views
    def to_main(self) -> None:
        """Switch to the main view: ``p.data`` the fp32 main parameter, ``p.grad`` the fp32 main gradient (None
        for a parameter without gradient this step). Idempotent."""
        if self.in_main_view:
            return
        self.in_main_view = True
        for p in self.params:
            p.grad = None
            p.data = self._main[id(p)]
            p.grad = self._main_grad[id(p)]

    @torch.no_grad()
    def to_compute(self) -> None:
        """Copy the fp32 main parameters into the bf16 copies and switch to the compute view (gradients and main
        gradients dropped: the step is over). Idempotent."""
        if not self.in_main_view:
            return
        computes = [self._compute[id(p)] for p in self.params]
        if computes:
            torch._foreach_copy_(computes, [self._main[id(p)] for p in self.params])
        for p, compute in zip(self.params, computes):
            p.grad = None
            self._main_grad[id(p)] = None
            p.data = compute
        self.in_main_view = False

    @contextmanager
    def main_view(self) -> Generator[None, None, None]:
        """The main view for the duration of the context (checkpoint saving and loading); on exit the bf16 copies
        are refreshed from the (possibly loaded) main parameters and the compute view restored (when it was the
        view on entry). Gradients are left as they are."""
        if self.in_main_view:
            yield
            return
        grads = {id(p): self._main_grad[id(p)] for p in self.params}
        self.to_main()
        try:
            yield
        finally:
            self.to_compute()
            self._main_grad.update(grads)

    def optimizer_hook(self, *_: Any) -> None:
        """Optimizer step post-hook ``(optimizer, args, kwargs)``: back to the compute view."""
        self.to_compute()

    def remove(self) -> None:
        """Remove the hooks and leave the parameters holding their fp32 main values."""
        self.to_main()
        for p in self.params:
            p.grad = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
