"""SwiGLU's one-pass backward on one GPU (``lightning_megatron.models.swiglu``): the Triton kernel runs, eagerly and
inside ``torch.compile``, for the MLP's bf16 activations; its gradient is the float64 gradient rounded to bf16 (at
most one bf16 rounding off, ragged column blocks and leading dimensions included); compiled and eager give the same
bits; float64 and non-contiguous inputs take the torch formula with the same values.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lightning_megatron.models.swiglu import (swiglu, swiglu_backward, swiglu_backward_reference,
                                               swiglu_backward_with_amax)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _float64_grad(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h64 = h.detach().double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(g.double())
    return h64.grad


def _kernels(fn) -> list:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if e.device_time_total > 0]


@pytest.mark.parametrize("shape", [(2, 3, 2 * 1000), (4096, 2 * 5632)])
def test_kernel_gradient_is_the_float64_gradient_rounded(shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    grad = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", generator=g).to(torch.bfloat16)
    out = swiglu_backward(h, grad)
    assert any("swiglu_backward_kernel" in k for k in _kernels(lambda: swiglu_backward(h, grad)))
    exact = _float64_grad(h, grad)
    err = (out.double() - exact).abs()
    assert torch.isfinite(out).all()
    assert bool((err <= exact.abs() * 2.0 ** -8 + 1e-30).all()), float((err / exact.abs().clamp_min(1e-30)).max())
    reference = swiglu_backward_reference(h, grad)   # the torch formula: the same up to fp32 operation order
    assert float((out.float() - reference.float()).abs().max()) <= float(exact.abs().max()) * 2.0 ** -7


def test_compiled_module_takes_the_kernel_and_matches_eager_bit_for_bit():
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(512, 2 * 704, device="cuda", generator=g).to(torch.bfloat16)
    grad = torch.randn(512, 704, device="cuda", generator=g).to(torch.bfloat16)
    compiled = torch.compile(swiglu, fullgraph=True)
    grads = []
    for fn in (swiglu, compiled):
        x = h.clone().requires_grad_()
        fn(x).backward(grad)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    x = h.clone().requires_grad_()

    def step():
        compiled(x).backward(grad)
    assert any("swiglu_backward_kernel" in k for k in _kernels(step))


def test_other_inputs_take_the_torch_formula_with_the_same_values():
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(64, 2 * 96, device="cuda", generator=g, dtype=torch.float64)
    grad = torch.randn(64, 96, device="cuda", generator=g, dtype=torch.float64)
    assert torch.allclose(swiglu_backward(h, grad), _float64_grad(h, grad), rtol=1e-12, atol=1e-15)
    wide = torch.randn(2 * 96, 64, device="cuda", generator=g).to(torch.bfloat16).t()   # not contiguous
    grad16 = grad.to(torch.bfloat16)
    assert torch.equal(swiglu_backward(wide, grad16), swiglu_backward(wide.contiguous(), grad16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_amax_is_the_largest_value_it_wrote(dtype):
    """The kernel's per-program maxima give exactly ``out.abs().amax()`` of the gradient it wrote (ragged column
    blocks included), eagerly and compiled; a NaN anywhere makes it NaN."""
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(37, 2 * 1500, device="cuda", generator=g).to(dtype)
    grad = torch.randn(37, 1500, device="cuda", generator=g).to(dtype)
    for fn in (swiglu_backward_with_amax, torch.compile(swiglu_backward_with_amax, fullgraph=True)):
        out, amax = fn(h, grad)
        assert torch.equal(out, swiglu_backward(h, grad))
        assert amax.dtype == torch.float32 and float(amax) == float(out.float().abs().max())
    grad[20, 1499] = float("nan")
    assert torch.isnan(swiglu_backward_with_amax(h, grad)[1])
    assert any("swiglu_backward_kernel" in k for k in _kernels(lambda: swiglu_backward_with_amax(h, grad)))
