"""Packed sequences on one GPU: ``document_attention`` takes FlexAttention with a document-causal block mask for bf16
inputs (the kernel that ran is read from the profiler: no fallback to the boolean-mask SDPA), its output and
gradients are as close to a float64 reference as plain causal SDPA's are to theirs, a row never sees another
document, and at seq 8192 with documents of 1024 tokens the masked forward + backward is faster than the full causal
one (it skips the blocks between documents).

Errors are relative Frobenius norms ``||x - ref|| / ||ref||`` against the explicit softmax in float64 on the same
bf16 inputs.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from lightning_megatron.models import attention as attention_module
from lightning_megatron.models.attention import document_attention

B, NQ, NKV, D = 1, 16, 8, 128


def _inputs(s: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, NQ, s, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, NKV, s, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    dout = torch.randn(B, NQ, s, D, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, dout


def _documents(s: int, lengths) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert ids.numel() == s
    return ids.unsqueeze(0).expand(B, s).cuda()


def _reference(q, k, v, dout, docs):
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    rep = NQ // NKV
    s = q.shape[2]
    visible = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(s, s, dtype=torch.bool,
                                                                              device="cuda").tril()
    scores = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / D ** 0.5).masked_fill(~visible, float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(rep, 1)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _run(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _errors(got, want):
    return [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want)]


def test_flex_document_attention_matches_float64_and_runs_flex(measured):
    s = 2048
    q, k, v, dout = _inputs(s)
    docs = _documents(s, (100, 900, 1, 47, 1000))   # borders inside the 128-blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a FlexAttention failure warns and falls back: fail instead
        got = _run(lambda a, b, c: document_attention(a, b, c, docs), q, k, v, dout)
    assert attention_module._FLEX and attention_module._FLEX[0] is not False
    errors = _errors(got, _reference(q, k, v, dout, docs))
    causal_ids = torch.zeros_like(docs)
    base = _errors(_run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
                        q, k, v, dout), _reference(q, k, v, dout, causal_ids))
    measured(**dict(zip(("out", "dq", "dk", "dv"), errors)))
    for err, ref in zip(errors, base):
        assert err <= 2 * ref + 1e-3, (errors, base)


def _step_ms(fn, q, k, v, dout, repeat: int = 20) -> float:
    for _ in range(3):
        _run(fn, q, k, v, dout)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        _run(fn, q, k, v, dout)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def test_documents_of_1024_at_seq_8192_are_faster_than_full_causal(measured):
    s = 8192
    q, k, v, dout = _inputs(s, seed=1)
    docs = _documents(s, (1024,) * 8)
    masked = _step_ms(lambda a, b, c: document_attention(a, b, c, docs), q, k, v, dout)
    causal = _step_ms(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
                      q, k, v, dout)
    measured(document_masked_ms=masked, full_causal_ms=causal)
    assert masked < causal, (masked, causal)


def test_float32_takes_the_exact_boolean_mask_path():
    s = 256
    q, k, v, dout = (t.float() for t in _inputs(s))
    docs = _documents(s, (56, 200))
    out = document_attention(q, k, v, docs)
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(s, s, dtype=torch.bool,
                                                                           device="cuda").tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(out, want)
