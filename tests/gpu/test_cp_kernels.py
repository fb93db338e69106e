"""The fused context-parallel block kernels (cuDNN and flash, returning the log-sum-exp) against the math path
on one GPU, the single-rank attention with every ``attention_kernel``, the compiled ring merge and the SM
carveout on CUDA.

Reference: the math path (explicit softmax) in float64 on the same half-precision inputs, so the error measured is
the kernel's own: outputs in the half type (its rounding alone is ~2e-3 relative in bf16, ~3e-4 in fp16), LSE in
float32, and q/k/v gradients from the ring's backward entry point (the *final* output and LSE, as after the
merge). Errors are relative Frobenius norms ``||x - ref|| / ||ref||``; NaN fails every band. Inputs are drawn
afresh per case, the ring's block shapes (own causal block, all queries against half the keys, half the queries
against all keys, non-causal), GQA (8 query heads, 2 key/value heads), head dim 128, contiguous and the model's
strided ``[s, b, n, d]`` layout.
"""
from __future__ import annotations

import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.parallel.context_parallel import context_parallel_attention
from lightning_megatron.parallel.context_parallel.kernels import (
    _attention_block,
    _attention_block_backward,
    _math_attention_block,
    block_kernel,
)

B, NQ, NKV, D = 2, 8, 2, 128
SCALE = D ** -0.5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: bands for the relative errors, about 3x the worst measured on an H200 (benchmarks/RESULTS.md, 2026-12-01:
#: bf16 out 2.2e-3, lse 6e-8, dq 2.5e-3, dk 3.0e-3, dv 2.9e-3; fp16 out 2.8e-4, lse 7e-8, dq 3.2e-4, dk 3.8e-4,
#: dv 3.6e-4; rounding the exact output to bf16 alone costs 1.6e-3, to fp16 2.0e-4)
BANDS = {
    torch.bfloat16: dict(out=7e-3, lse=2e-7, dq=1e-2, dk=1e-2, dv=1e-2),
    torch.float16: dict(out=1e-3, lse=2e-7, dq=1.2e-3, dk=1.2e-3, dv=1.2e-3),
}
BLOCKS = {  # name: (sq, sk, mask kind) as the zigzag ring forms them
    "own-causal": (512, 512, "causal"),
    "all-q-half-kv": (512, 256, "full"),
    "half-q-all-kv": (256, 512, "full"),
    "noncausal": (512, 512, "full"),
}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _randn(n: int, s: int, dtype: torch.dtype, gen: torch.Generator, strided: bool) -> torch.Tensor:
    """``[B, n, s, D]`` in ``dtype``: contiguous, or the model's ``[s, B, n, D]`` activations viewed as such."""
    if strided:
        return torch.randn(s, B, n, D, device="cuda", generator=gen).to(dtype).permute(1, 2, 0, 3)
    return torch.randn(B, n, s, D, device="cuda", generator=gen).to(dtype)


def _check(errs, dtype) -> None:
    for name, err in errs.items():
        band = BANDS[dtype][name]
        assert err <= band, f"{name}: relative error {err:.3e} over the band {band:.0e} (all: {errs})"


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_fused_block_matches_math(kernel, dtype, block, strided, measured):
    """One ring block through the fused kernel (forward: out and LSE; backward from the final out and LSE) against
    the float64 math path on the same inputs."""
    dt, (sq, sk, mask) = DTYPES[dtype], BLOCKS[block]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{kernel}{dtype}{block}{strided}".encode()))
    q, dout = _randn(NQ, sq, dt, gen, strided), _randn(NQ, sq, dt, gen, strided)
    k, v = _randn(NKV, sk, dt, gen, strided), _randn(NKV, sk, dt, gen, strided)
    assert block_kernel(q, mask, sq, sk, kernel) == kernel  # the fused kernel is what runs, not the math path

    out, lse = _attention_block(q, k, v, mask, SCALE, kernel)
    dq, dk, dv = _attention_block_backward(q, k, v, dout, out, lse, None, mask, SCALE, kernel)
    assert out.dtype == dt and lse.dtype == torch.float32 and dq.dtype == dk.dtype == dv.dtype == dt
    assert out.shape == (B, NQ, sq, D) and lse.shape == (B, NQ, sq) and dk.shape == (B, NKV, sk, D)

    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = _math_attention_block(q64, k64, v64, mask, SCALE)
    delta = (dout64 * ref_out).sum(-1)
    rdq, rdk, rdv = _attention_block_backward(q64, k64, v64, dout64, ref_out, ref_lse, delta, mask, SCALE, "math")
    errs = dict(out=rel(out, ref_out), lse=rel(lse, ref_lse), dq=rel(dq, rdq), dk=rel(dk, rdk), dv=rel(dv, rdv))
    measured(**errs, out_rounding=rel(ref_out.to(dt), ref_out))
    _check(errs, dt)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kernel", ["auto", "cudnn", "flash", "math"])
def test_single_rank_attention_matches_float64_sdpa(kernel, dtype, measured):
    """``context_parallel_attention(group=None, attention_kernel=...)`` (the ring's autograd function on one rank)
    on the model's strided layout, causal, GQA: output and q/k/v gradients against float64 SDPA."""
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"single{kernel}{dtype}".encode()))
    s = 1024
    q, k, v = (_randn(n, s, dt, gen, strided=True).requires_grad_() for n in (NQ, NKV, NKV))
    dout = _randn(NQ, s, dt, gen, strided=True)
    out = context_parallel_attention(q, k, v, None, attention_kernel=kernel)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=SCALE, enable_gqa=True)
    ref.backward(dout.double())
    assert out.dtype == dt and out.shape == q.shape
    errs = dict(out=rel(out, ref), dq=rel(q.grad, q64.grad), dk=rel(k.grad, k64.grad), dv=rel(v.grad, v64.grad))
    measured(**errs)
    _check(errs, dt)


def test_compiled_ring_merge_matches_eager_on_cuda(measured):
    """With ``compile_merge`` the ring merges through one ``torch.compile``d kernel on CUDA (it must compile here,
    not fall back); it writes the strided row slice as the eager ops do and leaves the other rows alone.
    ``compile_merge=False`` is the eager ops exactly."""
    from lightning_megatron.parallel.context_parallel import ring

    gen = torch.Generator(device="cuda").manual_seed(11)
    out = torch.randn(1024, B, NQ, D, device="cuda", generator=gen).bfloat16().permute(1, 2, 0, 3)
    lse = torch.randn(B, NQ, 1024, device="cuda", generator=gen) + 5
    blk = torch.randn(B, NQ, 512, D, device="cuda", generator=gen).bfloat16()
    blk_lse = torch.randn(B, NQ, 512, device="cuda", generator=gen) + 5
    rows = slice(512, None)
    eager_o, eager_l = out.clone(), lse.clone()
    ring._merge_rows(eager_o[:, :, rows], eager_l[:, :, rows], blk, blk_lse)

    plain_o, plain_l = out.clone(), lse.clone()
    ring._merge(plain_o, plain_l, rows, blk, blk_lse, compile_merge=False)
    assert torch.equal(plain_o, eager_o) and torch.equal(plain_l, eager_l)

    comp_o = out.permute(2, 0, 1, 3).clone().permute(1, 2, 0, 3)  # same strided layout
    comp_l = lse.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ring._merge(comp_o, comp_l, rows, blk, blk_lse, compile_merge=True)
    failed = [str(w.message) for w in caught if "merge failed" in str(w.message)]
    assert not failed and ring._CUDA_MERGE and ring._CUDA_MERGE[0] is not ring._merge_rows, failed
    assert torch.equal(comp_o[:, :, :512], out[:, :, :512])
    o_err = float((comp_o.float() - eager_o.float()).abs().max() / eager_o.float().abs().max())
    l_err = float((comp_l - eager_l).abs().max())
    measured(out_max_abs_over_max=o_err, lse_max_abs=l_err)
    assert o_err <= 2 ** -8 and l_err < 1e-5, (o_err, l_err)


@pytest.mark.skipif(not hasattr(torch._C, "_set_sm_carveout_experimental"), reason="torch without the SM carveout API")
def test_carveout_window_on_cuda():
    """None is 16 SMs on CUDA, 0 none, n is n; the setting found on entry comes back; every SM is refused."""
    from lightning_megatron.parallel.context_parallel.sm_carveout import carveout_window

    before = torch._C._get_sm_carveout_experimental()
    for sm, inside in ((None, 16), (0, before), (8, 8)):
        with carveout_window(sm):
            assert torch._C._get_sm_carveout_experimental() == inside, sm
        assert torch._C._get_sm_carveout_experimental() == before
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    with pytest.raises(ValueError, match=f"cp_sm_carveout={sms} leaves no SM to the GEMMs: this GPU has {sms}"):
        with carveout_window(sms):
            pass
