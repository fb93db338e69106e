"""The model's causal self-attention kernels (``GPTConfig.attention_backend``) on one GPU: ``fused`` runs cuDNN's fused
attention for bf16 grouped-query inputs in the model's strided layout and ``flash`` the flash kernel, eagerly and
inside ``torch.compile`` (the kernels that ran are read from the profiler), and cuDNN's output and gradients are as
close to a float64 reference as flash's; ``fused`` refuses a head dim it does not run cuDNN for, naming the rule.

Errors are relative Frobenius norms ``||x - ref|| / ||ref||`` against the explicit softmax in float64 on the same bf16
inputs; NaN fails every comparison.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_megatron.models.attention import causal_attention, cudnn_attention_accepts

S, B, NQ, NKV, D = 512, 2, 16, 8, 128


def _inputs(d: int = D):
    g = torch.Generator(device="cuda").manual_seed(0)
    # [s, b, n, d] activations viewed as [b, n, s, d], as SelfAttention hands them over
    q = torch.randn(S, B, NQ, d, device="cuda", generator=g).to(torch.bfloat16).permute(1, 2, 0, 3)
    k, v = (torch.randn(S, B, NKV, d, device="cuda", generator=g).to(torch.bfloat16).permute(1, 2, 0, 3)
            for _ in range(2))
    dout = torch.randn(B, NQ, S, d, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, dout


def _reference(q, k, v, dout):
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    rep = NQ // NKV
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / D ** 0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(rep, 1)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _run(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn(q, k, v)
        out.backward(dout)
        torch.cuda.synchronize()
    kernels = " ".join(e.name for e in prof.events() if e.device_type.name == "CUDA")
    return [out.detach(), q.grad, k.grad, v.grad], kernels


def _errors(got, ref):
    return [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, ref)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_runs_cudnn_for_bf16_gqa_and_is_as_exact_as_flash(compiled, measured):
    q, k, v, dout = _inputs()
    assert cudnn_attention_accepts(q, k, 0.0)
    ref = _reference(q, k, v, dout)

    def fused(q, k, v):
        return causal_attention(q, k, v, 0.0, "fused")

    def flash(q, k, v):
        return causal_attention(q, k, v, 0.0, "flash")

    if compiled:
        torch._dynamo.reset()
        fused, flash = torch.compile(fused, fullgraph=True), torch.compile(flash, fullgraph=True)
        _run(fused, q, k, v, dout), _run(flash, q, k, v, dout)   # compiled outside the profiled runs
    got, kernels = _run(fused, q, k, v, dout)
    theirs, their_kernels = _run(flash, q, k, v, dout)
    ours_err, their_err = _errors(got, ref), _errors(theirs, ref)
    measured(out=ours_err[0], dq=ours_err[1], dk=ours_err[2], dv=ours_err[3], flash_out=their_err[0],
             flash_dq=their_err[1])
    assert "cudnn" in kernels, kernels[:400]
    assert "cudnn" not in their_kernels and "flash" in their_kernels, their_kernels[:400]
    for ours, flash_err in zip(ours_err, their_err):
        assert ours <= 1.5 * flash_err + 1e-3, (ours_err, their_err)
    assert max(ours_err) < 1e-2, ours_err


def test_fused_refuses_a_head_dim_it_does_not_run_cudnn_for():
    q, k, v, _ = _inputs(d=256)
    assert not cudnn_attention_accepts(q, k, 0.0)
    with pytest.raises(ValueError, match=r"attention_backend='fused'.*multiple of 8 and <= 128.*head dim 256"):
        causal_attention(q, k, v, 0.0, "fused")
    out = causal_attention(q, k, v, 0.0, "auto")   # auto: torch's choice
    assert out.shape == (B, NQ, S, 256) and torch.isfinite(out).all()
