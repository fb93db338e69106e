"""The non-finite check's per-tensor pass on one GPU (``lightning_megatron.utils.max_abs``): one Triton kernel per
dtype gives each tensor's largest absolute value exactly as torch's ``amax`` does (chunks that end inside a block,
tensors of one element, fp32 / bf16 / fp16 side by side), NaN kept (also beside an inf, and as the last element),
inf kept; the address table is copied once for tensors that stay where they are and again for new ones;
non-contiguous tensors take torch's pass."""
from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_megatron.utils.max_abs import MaxAbsPerTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tensors():
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [(1,), (2047,), (2049,), (16384,), (16385,), (4096, 1227), (33, 3)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    return [torch.randn(*s, device="cuda", generator=g).mul(1 + i).to(dtypes[i % 3]) for i, s in enumerate(sizes)]


def test_values_are_torchs_amax_exactly():
    tensors = _tensors()
    m = MaxAbsPerTensor()
    values = m(tensors)
    want = torch.stack([t.abs().amax().float() for t in tensors])
    assert torch.equal(values, want)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m(tensors)
        torch.cuda.synchronize()
    assert any("max_abs_kernel" in e.key for e in prof.key_averages())


def test_nan_and_inf_are_kept():
    tensors = _tensors()
    tensors[1].view(-1)[-1] = float("nan")          # the last element of its tensor
    tensors[3].view(-1)[5] = float("inf")
    tensors[5].view(-1)[1000] = float("-inf")
    tensors[5].view(-1)[3_000_000] = float("nan")    # fp16 NaN beside an inf: NaN
    tensors[2].view(-1)[7] = float("-inf")           # fp16: inf, from its sign-dropped bits converted
    tensors[0].view(-1)[0] = -float("nan")           # bf16 NaN with the sign bit set: NaN
    tensors[4].view(-1)[16384] = -float("nan")       # fp32 (its chunk's only element): NaN
    tensors[6].view(-1)[0] = float("nan")            # bf16, its first element
    values = MaxAbsPerTensor()(tensors).tolist()
    assert math.isnan(values[1]) and values[3] == math.inf and math.isnan(values[5])
    assert values[2] == math.inf and math.isnan(values[0]) and math.isnan(values[4]) and math.isnan(values[6])


def test_address_tables_follow_the_tensors():
    m = MaxAbsPerTensor()
    tensors = _tensors()
    for _ in range(3):
        m(tensors)
    assert len(m._addresses) == 3   # the same tensors: one table per dtype (three here), copied once
    fresh = [t.clone() * 2 for t in tensors]
    assert torch.equal(m(fresh), torch.stack([t.abs().amax().float() for t in fresh]))
    assert len(m._addresses) == 6
    strided = [torch.randn(64, 64, device="cuda").t()]   # not contiguous: torch's pass, the same value
    assert torch.equal(m(strided), strided[0].abs().amax().reshape(1))
