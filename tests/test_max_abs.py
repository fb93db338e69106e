"""``MaxAbsPerTensor`` (``lightning_megatron.utils.max_abs``) on the CPU, where it takes ``torch._foreach_norm``: each
tensor's largest absolute value in the order given, NaN and inf kept, any dtype. The CUDA kernel is checked by
``tests/gpu/test_max_abs_kernel.py``; the non-finite guard's gradient check goes through it."""
from __future__ import annotations

import math

import torch
from torch import nn

from lightning_megatron.parallel.nonfinite import per_tensor_max_abs
from lightning_megatron.utils.max_abs import MaxAbsPerTensor


def test_each_tensors_largest_absolute_value_in_order():
    torch.manual_seed(0)
    tensors = [torch.randn(7), torch.randn(3, 5).bfloat16(), torch.tensor([1.0, float("nan"), float("inf")]),
               torch.tensor([float("-inf"), 2.0]), torch.randn(4, 4, dtype=torch.float64), torch.zeros(2)]
    values = MaxAbsPerTensor()(tensors)
    assert values.dtype == torch.float32 and values.shape == (len(tensors),)
    want = [float(t.abs().amax()) for t in tensors]
    assert math.isnan(values[2]) and values[3] == math.inf and values[5] == 0.0
    assert all(float(v) == float(torch.tensor(w, dtype=torch.float32)) for i, (v, w) in enumerate(zip(values, want))
               if i != 2)
    assert MaxAbsPerTensor()([]).shape == (0,)


def test_guards_per_gradient_values_name_the_parameters_in_order():
    lin = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    lin(torch.randn(5, 3)).sum().backward()
    lin[0].bias.grad[1] = float("nan")
    order, values = per_tensor_max_abs(list(lin.parameters()))
    assert [id(p) for p in order] == [id(p) for p in lin.parameters()]
    assert math.isnan(values[1]) and all(math.isfinite(v) for i, v in enumerate(values.tolist()) if i != 1)
    assert float(values[0]) == float(lin[0].weight.grad.abs().amax())
