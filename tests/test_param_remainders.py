"""fp32 main parameters held as bf16 copy plus int16 remainder (``MegatronPrecision(store_param_remainders=True)``,
:mod:`lightning_megatron.optimizer.param_remainders`).

Units: the split and the join are exact inverses over every finite value, the infinities and both zeros, and the bf16
half is torch's rounding except at exact ties (then the neighbour away from zero); :class:`MainParams` holds no fp32
main parameters outside the main view; 20 optimizer steps over the halves (direct steps, steps through the main view
with fp32 main gradients, a skipped step) keep the fp32 main parameters bit for bit those of the fp32-main-parameter
path; a main view's writes (checkpoint loading) are split back. Training runs are in ``test_main_grad.py``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_megatron import MegatronPrecision, PrecisionAwareAdamW
from lightning_megatron.optimizer.param_remainders import join_fp32, split_fp32
from lightning_megatron.parallel.param_buffer.buffer import MainParams


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-120, 120, (200_000,), generator=g).float())
    ties = (torch.randint(0, 2 ** 15 - 128, (2000,), generator=g, dtype=torch.int32) * 65536 + 0x8000)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, -1e-45, 1.0, -1.0,
                            2 ** -126, -(2 ** -126)])
    return torch.cat([scaled, ties.view(torch.float32), -ties.view(torch.float32), special])


def test_split_and_join_are_exact_inverses():
    x = _values()
    high, low = split_fp32(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_fp32(high, low).view(torch.int32), x.view(torch.int32))


def test_the_bf16_half_is_torchs_rounding_except_at_ties_where_it_leaves_zero():
    x = _values()
    high, _ = split_fp32(x)
    differs = high.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)
    ties = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert bool(differs.any()) and bool(ties[differs].all())
    assert bool((high[differs].double().abs() > x[differs].double().abs()).all())


def _model_and_params(remainders: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    main = MainParams(model, torch.bfloat16, bucket_size=300, store_param_remainders=remainders)
    opt = PrecisionAwareAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, exp_avg_dtype="bf16",
                              exp_avg_sq_dtype="bf16")
    main.attach(opt)
    return model, main, opt


def test_no_fp32_main_parameters_outside_the_main_view():
    model, main, _ = _model_and_params(True)
    assert all(b.main is None and b.remainder is not None and b.remainder.dtype == torch.int16 for b in main.buckets)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with main.main_view():
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(b.main is not None for b in main.buckets)
    assert all(b.main is None for b in main.buckets)


def test_twenty_steps_over_the_halves_keep_the_fp32_main_parameters_bit_for_bit():
    """Alternating direct steps (bf16 gradients kept) and steps through the main view (fp32 main gradients), and one
    step the non-finite guard skips: every fp32 main parameter equals the fp32-main-parameter path's bit for bit, and
    every bf16 copy is its main parameter's bf16 half."""
    runs = [_model_and_params(False), _model_and_params(True)]
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = [torch.randn(p.shape, generator=g) * 10.0 ** -(step % 4) for p in runs[0][0].parameters()]
        for model, main, opt in runs:
            main.start_step(direct=step % 2 == 0)
            for p, grad in zip(model.parameters(), grads):
                p.grad = grad.to(torch.bfloat16)
                main._accumulate(p)
            main.finish_backward()
            opt.found_inf = torch.ones(()) if step == 7 else None
            opt.step()
            main.to_compute()
    (ref, ref_main, _), (model, main, _) = runs
    for a, b in zip(ref.parameters(), model.parameters()):
        fp32 = ref_main.main_param(a)
        assert torch.equal(main.main_param(b).view(torch.int32), fp32.view(torch.int32))
        assert torch.equal(b.detach().view(torch.int16), split_fp32(fp32)[0].view(torch.int16))
    start = _model_and_params(False)[1]   # the steps moved the parameters
    assert all(not torch.equal(ref_main.main_param(a), start.main_param(s))
               for a, s in zip(ref.parameters(), start.params))


def test_main_view_writes_are_split_back():
    model, main, _ = _model_and_params(True)
    loaded = {id(p): torch.randn(p.shape) for p in model.parameters()}
    with main.main_view():
        for p in model.parameters():
            p.data.copy_(loaded[id(p)])
    for p in model.parameters():
        assert torch.equal(main.main_param(p), loaded[id(p)])
        assert torch.equal(p.detach().view(torch.int16), split_fp32(loaded[id(p)])[0].view(torch.int16))


@pytest.mark.parametrize("kwargs, message", [
    (dict(store_param_remainders=True), "add params_dtype=torch.bfloat16"),
    (dict(params_dtype=torch.bfloat16, store_param_remainders=1), r"must be None \(on with bf16 parameters\) or a bool"),
])
def test_store_param_remainders_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MegatronPrecision("bf16-mixed", **kwargs)
