"""SwiGLU's one-pass backward (``lightning_megatron.models.swiglu``) on the CPU: the gradient autograd gives for
``silu(gate) * up`` (float64 to rounding, and ``gradcheck``), half-precision inputs computed in fp32 and rounded once,
and the model's MLP takes it. The CUDA kernel is checked by ``tests/gpu/test_swiglu_kernel.py``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_megatron import GPTConfig
from lightning_megatron.models import swiglu as swiglu_module
from lightning_megatron.models.gpt import MLP
from lightning_megatron.models.swiglu import swiglu, swiglu_backward


def _autograd(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h = h.detach().clone().requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(g)
    return h.grad


def test_backward_is_autograds_gradient():
    torch.manual_seed(0)
    h = torch.randn(3, 5, 2 * 7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 7, dtype=torch.float64)
    assert torch.autograd.gradcheck(swiglu, (h,))
    out = swiglu(h)
    gate, up = h.detach().chunk(2, dim=-1)
    assert torch.equal(out, F.silu(gate) * up)
    out.backward(g)
    assert torch.allclose(h.grad, _autograd(h, g), rtol=1e-13, atol=1e-15)


def test_half_precision_is_computed_in_fp32_and_rounded_once():
    torch.manual_seed(1)
    h = torch.randn(4, 2 * 16).to(torch.bfloat16)
    g = torch.randn(4, 16).to(torch.bfloat16)
    exact = _autograd(h.double(), g.double())
    out = swiglu_backward(h, g)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, swiglu_backward(h.float(), g.float()).to(torch.bfloat16))
    assert bool(((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8).all())


def test_mlp_backward_goes_through_the_one_pass_backward(monkeypatch):
    calls = []
    original = swiglu_module.swiglu_backward

    def spy(h, grad):
        calls.append(tuple(h.shape))
        return original(h, grad)
    monkeypatch.setattr(swiglu_module, "swiglu_backward", spy)
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, vocab_size=32,
                       seq_length=8, swiglu=True)
    mlp = MLP(config).double()
    x = torch.randn(8, 2, 16, dtype=torch.float64, requires_grad=True)
    mlp(x).sum().backward()
    assert calls == [(8, 2, 48)]


def test_backward_keeps_only_the_packed_input():
    """What autograd keeps for the backward: ``h`` alone (``[..., 2f]``), not also ``silu(gate)`` as ``silu(gate) * up``
    does eagerly (a third less of the SwiGLU's activation memory without ``torch.compile``)."""
    def saved_bytes(fn, h):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h)
        return sum(storages.values())

    h = torch.randn(64, 2 * 32, dtype=torch.bfloat16, requires_grad=True)

    def plain(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    assert saved_bytes(swiglu, h) == h.numel() * 2
    assert saved_bytes(plain, h) == h.numel() * 3


def test_backward_hands_over_the_largest_gradient_value():
    """``swiglu(h, grad_amax)``: the backward calls ``grad_amax`` once with the largest ``|d h|`` of the gradient it
    returns (as rounded to ``h``'s dtype, 0-d fp32); the gradient is the same as without it. A NaN gradient gives a
    NaN amax (as ``amax`` would)."""
    torch.manual_seed(3)
    h = torch.randn(6, 2 * 10).to(torch.bfloat16)
    g = torch.randn(6, 10).to(torch.bfloat16)
    seen = []
    x = h.clone().requires_grad_()
    swiglu(x, seen.append).backward(g)
    plain = h.clone().requires_grad_()
    swiglu(plain).backward(g)
    assert torch.equal(x.grad, plain.grad) and len(seen) == 1
    assert seen[0].dtype == torch.float32 and seen[0].dim() == 0
    assert float(seen[0]) == float(plain.grad.float().abs().max())
    g[2, 3] = float("nan")
    seen.clear()
    swiglu(h.clone().requires_grad_(), seen.append).backward(g)
    assert torch.isnan(seen[0])
