"""Local experts: ``GroupedMLPExperts`` (stacked weights, one grouped GEMM) and ``SequentialMLPExperts``.

Both take tokens already sorted by local expert, ``tokens [N, h]`` with ``tokens_per_expert [E_local]``
(sum = N), and return ``[N, h]``. Weights: ``weight1 [E_local, h, 2f]`` (SwiGLU: gate then up halves; ``[.., h, f]``
without GLU) and ``weight2 [E_local, f, h]``.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _activation(x: Tensor, swiglu: bool) -> Tensor:
    if swiglu:
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x)


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class GroupedMLPExperts(nn.Module):
    """All local experts as stacked tensors.

    ``use_grouped_mm``: ``None`` (default) uses ``torch._grouped_mm`` for CUDA bf16 inputs only; ``True`` tries it
    for any input (torch builds with a CPU kernel run it too); ``False`` always loops over experts. A failing
    grouped GEMM (old torch, unsupported dtype, or rows not 16-byte aligned, e.g. bf16 with ``f`` not a multiple
    of 8) falls back to the loop; ``last_used_grouped_mm`` says which path the last call took.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, swiglu: bool = True,
                 weight1: Optional[Tensor] = None, weight2: Optional[Tensor] = None,
                 use_grouped_mm: Optional[bool] = None, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_local_experts, self.hidden_size, self.ffn_hidden_size = num_local_experts, hidden_size, ffn_hidden_size
        self.swiglu = swiglu
        self.use_grouped_mm = use_grouped_mm
        fc1_out = 2 * ffn_hidden_size if swiglu else ffn_hidden_size
        if weight1 is None:
            weight1 = torch.empty(num_local_experts, hidden_size, fc1_out).normal_(0.0, init_std)
        if weight2 is None:
            weight2 = torch.empty(num_local_experts, ffn_hidden_size, hidden_size).normal_(0.0, init_std)
        assert weight1.shape == (num_local_experts, hidden_size, fc1_out), weight1.shape
        assert weight2.shape == (num_local_experts, ffn_hidden_size, hidden_size), weight2.shape
        self.weight1 = nn.Parameter(weight1.clone())
        self.weight2 = nn.Parameter(weight2.clone())
        self.last_used_grouped_mm = False

    def _want_grouped(self, x: Tensor) -> bool:
        if not _grouped_mm_available() or self.use_grouped_mm is False:
            return False
        if self.use_grouped_mm is None:
            return x.is_cuda and x.dtype == torch.bfloat16
        return True

    def forward(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        counts = tokens_per_expert.to("cpu", torch.int64)
        w1, w2 = self.weight1.to(tokens.dtype), self.weight2.to(tokens.dtype)
        if self._want_grouped(tokens) and tokens.shape[0] > 0:
            try:
                offs = torch.cumsum(counts, 0).to(device=tokens.device, dtype=torch.int32)
                h = torch._grouped_mm(tokens, w1, offs=offs)
                out = torch._grouped_mm(_activation(h, self.swiglu), w2, offs=offs)
                self.last_used_grouped_mm = True
                return out
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        self.last_used_grouped_mm = False
        return _loop_experts(tokens, counts.tolist(), list(w1.unbind(0)), list(w2.unbind(0)), self.swiglu)


def _loop_experts(tokens: Tensor, counts: List[int], w1s: List[Tensor], w2s: List[Tensor], swiglu: bool) -> Tensor:
    outs = []
    for chunk, w1, w2 in zip(torch.split(tokens, counts, dim=0), w1s, w2s):
        outs.append(_activation(chunk @ w1, swiglu) @ w2)
    if not outs:
        return tokens.new_zeros(0, w2s[0].shape[-1] if w2s else tokens.shape[-1])
    return torch.cat(outs, dim=0)


class SequentialMLPExperts(nn.Module):
    """Reference: one ``(w1 [h, 2f], w2 [f, h])`` pair per expert in a ``ModuleList``-like layout, a Python loop."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, swiglu: bool = True,
                 weight1: Optional[Tensor] = None, weight2: Optional[Tensor] = None, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_local_experts, self.swiglu = num_local_experts, swiglu
        fc1_out = 2 * ffn_hidden_size if swiglu else ffn_hidden_size
        if weight1 is None:
            weight1 = torch.empty(num_local_experts, hidden_size, fc1_out).normal_(0.0, init_std)
        if weight2 is None:
            weight2 = torch.empty(num_local_experts, ffn_hidden_size, hidden_size).normal_(0.0, init_std)
        self.fc1 = nn.ParameterList([nn.Parameter(w.clone()) for w in weight1.unbind(0)])
        self.fc2 = nn.ParameterList([nn.Parameter(w.clone()) for w in weight2.unbind(0)])

    def forward(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        counts = tokens_per_expert.to("cpu", torch.int64).tolist()
        return _loop_experts(tokens, counts, [w.to(tokens.dtype) for w in self.fc1],
                             [w.to(tokens.dtype) for w in self.fc2], self.swiglu)
