"""SwiGLU, ``silu(gate) * up`` over ``linear_fc1``'s packed output ``[..., 2f]`` = ``[gate; up]`` (Megatron's layout),
with a backward that writes both halves of the gradient in one pass.

Autograd's backward of ``chunk`` + ``silu`` + ``mul`` yields the two halves' gradients and concatenates them; compiled,
Inductor writes that as one kernel over the ``[..., 2f]`` gradient that computes each half separately, reading the
inputs twice. :func:`swiglu`'s backward instead computes, for each ``(row, column)`` of the ``[..., f]`` halves, both
``d gate = g * up * s * (1 + gate * (1 - s))`` and ``d up = g * silu(gate)`` (``s = sigmoid(gate)``, fp32) from one
read of ``gate``, ``up`` and ``g``: on CUDA a Triton kernel (:func:`swiglu_backward`, a ``torch.library`` Triton op,
so ``torch.compile`` and CUDA graphs take it as it is), elsewhere the same formula in torch operations (in fp32 for
half-precision inputs, rounded once). The forward is left to torch (and Inductor's fusion); what autograd keeps for
the backward is ``h`` alone (eagerly, ``silu(gate) * up`` also keeps ``silu(gate)``). No communication: under tensor
parallelism each rank's ``[gate; up]`` is its own shard's.

``swiglu(h, grad_amax)`` also hands ``grad_amax`` the largest absolute value of the gradient it returns (``|d h|``,
of the values as rounded to ``h``'s dtype), taken in the same pass (each program of the kernel keeps its block's
largest; one small reduction over those): FP8's delayed recipe records it for ``linear_fc1``'s output gradient
instead of reading that gradient once more.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["swiglu", "swiglu_backward", "swiglu_backward_with_amax", "swiglu_backward_reference"]

try:   # the CUDA kernel; CPU-only installations run the torch formula
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the installation
    triton = None


def swiglu_backward_reference(h: Tensor, grad: Tensor) -> Tensor:
    """The gradient of ``silu(gate) * up`` with respect to ``h`` ``[..., 2f]`` for the output gradient ``grad``
    ``[..., f]``: ``[d gate; d up]`` in ``h``'s dtype, computed in fp32 (or ``h``'s dtype if wider) and rounded once."""
    compute = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(compute).chunk(2, dim=-1)
    g = grad.to(compute)
    s = torch.sigmoid(gate)
    return torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=-1).to(h.dtype)


if triton is not None:
    @triton.jit
    def _swiglu_backward_kernel(h_ptr, g_ptr, out_ptr, amax_ptr, f, BLOCK: tl.constexpr, AMAX: tl.constexpr):
        """One row of ``h`` ``[rows, 2f]`` and ``g`` ``[rows, f]`` (contiguous), ``BLOCK`` columns of each half;
        with ``AMAX`` the block's largest ``|out|`` (as stored; NaN if any is NaN) at ``amax_ptr[program]``."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        h_row = h_ptr + row * 2 * f
        gate = tl.load(h_row + cols, mask=mask).to(tl.float32)
        up = tl.load(h_row + f + cols, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + row * f + cols, mask=mask).to(tl.float32)
        s = tl.sigmoid(gate)
        d_gate = (g * up * s * (1 + gate * (1 - s))).to(out_ptr.dtype.element_ty)
        d_up = (g * gate * s).to(out_ptr.dtype.element_ty)
        out_row = out_ptr + row * 2 * f
        tl.store(out_row + cols, d_gate, mask=mask)
        tl.store(out_row + f + cols, d_up, mask=mask)
        if AMAX:
            both = tl.maximum(tl.abs(d_gate.to(tl.float32)), tl.abs(d_up.to(tl.float32)))
            both = tl.where(mask, both, 0.0)
            nan = tl.sum(tl.where(both != both, 1, 0), axis=0)   # tl.max would drop a NaN
            largest = tl.where(nan > 0, float("nan"), tl.max(both, axis=0))
            tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), largest)

    def _launch(h: Tensor, grad: Tensor, amax: bool) -> Tuple[Tensor, Tensor]:
        f = grad.shape[-1]
        rows = grad.numel() // f if f else 0
        block = 1024
        blocks = triton.cdiv(f, block) if f else 0
        out = torch.empty_like(h)
        partial = torch.empty(rows * blocks if amax else 0, dtype=torch.float32, device=h.device)
        if rows:
            torch.library.wrap_triton(_swiglu_backward_kernel)[(rows, blocks)](
                h, grad, out, partial, f, BLOCK=block, AMAX=amax)
        return out, partial

    @torch.library.triton_op("lightning_megatron::swiglu_backward", mutates_args=())
    def _swiglu_backward_cuda(h: Tensor, grad: Tensor) -> Tensor:
        """:func:`swiglu_backward_reference` as one Triton kernel (contiguous CUDA inputs)."""
        return _launch(h, grad, False)[0]

    @torch.library.triton_op("lightning_megatron::swiglu_backward_amax", mutates_args=())
    def _swiglu_backward_amax_cuda(h: Tensor, grad: Tensor) -> Tuple[Tensor, Tensor]:
        """The same kernel, also writing each program's largest ``|d h|`` (``[programs]`` fp32)."""
        return _launch(h, grad, True)


def _kernel_applies(h: Tensor, grad: Tensor) -> bool:
    return (triton is not None and h.is_cuda and h.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and grad.dtype == h.dtype and h.is_contiguous() and grad.is_contiguous())


def swiglu_backward(h: Tensor, grad: Tensor) -> Tensor:
    """:func:`swiglu_backward_reference`: one Triton kernel for contiguous CUDA fp32 / bf16 / fp16 inputs, the torch
    formula otherwise."""
    if _kernel_applies(h, grad):
        return torch.ops.lightning_megatron.swiglu_backward(h, grad)
    return swiglu_backward_reference(h, grad)


def swiglu_backward_with_amax(h: Tensor, grad: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`swiglu_backward` and the largest absolute value of what it returns (0-d fp32; NaN if any value is NaN):
    on CUDA from the same kernel's per-program maxima (no second read of the gradient), elsewhere from the result."""
    if _kernel_applies(h, grad):
        out, partial = torch.ops.lightning_megatron.swiglu_backward_amax(h, grad)
        return out, partial.amax() if partial.numel() else partial.new_zeros(())
    out = swiglu_backward_reference(h, grad)
    return out, out.abs().amax().float() if out.numel() else out.new_zeros((), dtype=torch.float32)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``h`` ``[..., 2f]``; backward :func:`swiglu_backward` (with ``grad_amax``:
    :func:`swiglu_backward_with_amax`, the amax handed to ``grad_amax``)."""

    @staticmethod
    def forward(ctx, h: Tensor, grad_amax: Optional[Callable[[Tensor], None]]) -> Tensor:
        ctx.save_for_backward(h)
        ctx.grad_amax = grad_amax
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[Tensor, None]:
        (h,) = ctx.saved_tensors
        if ctx.grad_amax is None:
            return swiglu_backward(h, grad.contiguous()), None
        out, amax = swiglu_backward_with_amax(h, grad.contiguous())
        ctx.grad_amax(amax)
        return out, None


def swiglu(h: Tensor, grad_amax: Optional[Callable[[Tensor], None]] = None) -> Tensor:
    """``silu(gate) * up`` for ``h`` ``[..., 2f]`` packed as ``[gate; up]`` -> ``[..., f]``, with the one-pass
    backward of the module docstring. ``grad_amax``: called in the backward with the largest absolute value of the
    gradient with respect to ``h`` (0-d fp32), taken in the same pass."""
    return _SwiGLU.apply(h, grad_amax)
