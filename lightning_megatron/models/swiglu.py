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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["swiglu", "swiglu_backward", "swiglu_backward_reference"]

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
    def _swiglu_backward_kernel(h_ptr, g_ptr, out_ptr, f, BLOCK: tl.constexpr):
        """One row of ``h`` ``[rows, 2f]`` and ``g`` ``[rows, f]`` (contiguous), ``BLOCK`` columns of each half."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        h_row = h_ptr + row * 2 * f
        gate = tl.load(h_row + cols, mask=mask).to(tl.float32)
        up = tl.load(h_row + f + cols, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + row * f + cols, mask=mask).to(tl.float32)
        s = tl.sigmoid(gate)
        d_gate = g * up * s * (1 + gate * (1 - s))
        d_up = g * gate * s
        out_row = out_ptr + row * 2 * f
        tl.store(out_row + cols, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + f + cols, d_up.to(out_ptr.dtype.element_ty), mask=mask)

    @torch.library.triton_op("lightning_megatron::swiglu_backward", mutates_args=())
    def _swiglu_backward_cuda(h: Tensor, grad: Tensor) -> Tensor:
        """:func:`swiglu_backward_reference` as one Triton kernel (contiguous CUDA inputs)."""
        f = grad.shape[-1]
        rows = grad.numel() // f if f else 0
        out = torch.empty_like(h)
        if rows:
            block = 1024
            torch.library.wrap_triton(_swiglu_backward_kernel)[(rows, triton.cdiv(f, block))](
                h, grad, out, f, BLOCK=block)
        return out


def swiglu_backward(h: Tensor, grad: Tensor) -> Tensor:
    """:func:`swiglu_backward_reference`: one Triton kernel for contiguous CUDA fp32 / bf16 / fp16 inputs, the torch
    formula otherwise."""
    if (triton is not None and h.is_cuda and h.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and grad.dtype == h.dtype and h.is_contiguous() and grad.is_contiguous()):
        return torch.ops.lightning_megatron.swiglu_backward(h, grad)
    return swiglu_backward_reference(h, grad)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``h`` ``[..., 2f]``; backward :func:`swiglu_backward`."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        return swiglu_backward(h, grad.contiguous())


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``h`` ``[..., 2f]`` packed as ``[gate; up]`` -> ``[..., f]``, with the one-pass
    backward of the module docstring."""
    return _SwiGLU.apply(h)
