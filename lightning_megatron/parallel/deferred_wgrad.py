"""Delayed weight-gradient GEMMs (Megatron's ``--delay-wgrad-compute``): a layer's linears compute their input
gradient at once in backward and leave the weight-gradient GEMM behind, and a later backward node that has to
wait on communication (the a2a context-parallel exchanges) runs them while its transfers are in flight, then
hands the gradients to autograd as its own, so they reach ``.grad`` (and DDP's reduction hooks) as usual.

One :class:`DeferredWgrad` per layer per forward (so pipeline schedules with several micro-batches in flight
keep theirs apart). The node that runs the GEMMs takes :attr:`DeferredWgrad.weights` as extra inputs of its
autograd function and returns :meth:`DeferredWgrad.grads` for them. No communication happens here.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _deferrable(linear: nn.Module) -> bool:
    """A plain ``nn.Linear`` whose weight is an ordinary trainable tensor (tensor-parallel layers, DTensor or
    frozen weights keep their own backward)."""
    w = getattr(linear, "weight", None)
    return type(linear) is nn.Linear and w is not None and w.requires_grad and type(w.data) is Tensor


class DeferredWgrad:
    """The weight-gradient GEMMs of ``linears`` (``nn.Linear`` modules of one layer), delayed from their backward
    to whoever calls :meth:`run` / :meth:`grads`.

    Use ``deferred.linear(module, x)`` in place of ``module(x)`` in forward. In backward the module's node returns
    the input (and bias) gradient and appends ``(x, grad_out)`` here; :meth:`run` computes the pending
    ``grad_out^T @ x`` GEMMs; :meth:`grads` returns one gradient per entry of :attr:`weights` (in the weight's
    dtype, summed over uses; ``None`` where the weight got none). Linears :func:`_deferrable` rejects run as
    usual. Under autocast the GEMMs run in the autocast dtype, as ``nn.Linear``'s would.
    """

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        mods = [m for m in linears if _deferrable(m)]
        self.weights: List[Tensor] = [m.weight for m in mods]
        self._slot: Dict[int, int] = {id(m): i for i, m in enumerate(mods)}
        self._pending: List[Tuple[int, Tensor, Tensor]] = []
        self._grads: List[Optional[Tensor]] = [None] * len(mods)

    def linear(self, module: nn.Module, x: Tensor) -> Tensor:
        """``module(x)`` with the weight gradient delayed (``x [..., in] -> [..., out]``)."""
        slot = self._slot.get(id(module))
        if slot is None or not torch.is_grad_enabled():
            return module(x)
        w, b = module.weight.detach(), module.bias
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dtype = torch.get_autocast_dtype(dev)
            x, w = x.to(dtype), w.to(dtype)
            b = b.to(dtype) if b is not None else None
        with torch.autocast(dev, enabled=False):
            return _DelayedWgradLinear.apply(x, w, b, self, slot)

    def pending_flops(self) -> int:
        """Multiply-adds x 2 of the GEMMs not yet run."""
        return sum(2 * g.numel() * x.shape[-1] for _, x, g in self._pending)

    def run(self, max_gemms: Optional[int] = None) -> None:
        """Run pending GEMMs, smallest first (``max_gemms``: at most that many), accumulating per weight."""
        self._pending.sort(key=lambda p: p[2].numel() * p[1].shape[-1])
        todo = self._pending if max_gemms is None else self._pending[:max_gemms]
        self._pending = [] if max_gemms is None else self._pending[max_gemms:]
        for slot, x, g in todo:
            gw = g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])).to(self.weights[slot].dtype)
            prev = self._grads[slot]
            self._grads[slot] = gw if prev is None else prev + gw

    def grads(self) -> Tuple[Optional[Tensor], ...]:
        """Run what is left and return the weight gradients, one per :attr:`weights` entry (then forget them)."""
        self.run()
        out, self._grads = tuple(self._grads), [None] * len(self.weights)
        return out


class _DelayedWgradLinear(torch.autograd.Function):
    """``F.linear(x, w, b)`` whose backward returns the input and bias gradients and defers ``grad^T @ x``."""

    @staticmethod
    def forward(ctx, x, w, b, deferred: DeferredWgrad, slot: int):
        ctx.save_for_backward(x, w)
        ctx.deferred, ctx.slot = deferred, slot
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = grad.matmul(w) if ctx.needs_input_grad[0] else None
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        ctx.deferred._pending.append((ctx.slot, x, grad))
        return gx, None, gb, None, None
