"""Local experts: ``GroupedMLPExperts`` (stacked weights, one grouped GEMM) and ``SequentialMLPExperts``.

Both take tokens already sorted by local expert, ``tokens [N, h]`` with ``tokens_per_expert [E_local]``
(sum = N), and return ``[N, h]``. Weights: ``weight1 [E_local, h, 2f]`` (SwiGLU: gate then up halves; ``[.., h, f]``
without GLU) and ``weight2 [E_local, f, h]``. Under expert tensor parallelism (``etp > 1``) each rank holds
``f / etp`` of the ffn dimension (``weight1 [E_local, h, 2f/etp]`` = its gate slice then its up slice,
``weight2 [E_local, f/etp, h]``) and returns partial sums that the dispatcher adds up over the ETP group.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.contract import RoutedExperts
from lightning_megatron.parallel.tensor_parallel.layers import shard_tensor, unshard_tensor
from lightning_megatron.parallel.tensor_parallel.mappings import all_gather_dim0, group_rank, group_size


def _activation(x: Tensor, swiglu: bool) -> Tensor:
    if swiglu:
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x)


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class GroupedMLPExperts(RoutedExperts):
    """All local experts as stacked tensors: ``forward(tokens [N, h], tokens_per_expert [E_local]) -> [N, h]``.

    ``ep_group`` / ``etp_group``: where the other experts / the other ffn slices live (no communication in
    ``forward``; only :meth:`gather_global` talks, for checkpoints). ``ffn_hidden_size`` is the full ``f``.
    ``global_shape`` / ``shard_global`` / ``gather_global`` map the local weights onto the full tensors of all
    ``E`` experts (``weight1 [E, h, 2f]``, ``weight2 [E, f, h]``), so initialisation and checkpoints do not
    depend on the layout. ``use_grouped_mm``: ``None`` (default) uses ``torch._grouped_mm`` for CUDA bf16 inputs only; ``True`` tries it
    for any input (torch builds with a CPU kernel run it too); ``False`` always loops over experts. A failing
    grouped GEMM (old torch, unsupported dtype, or rows not 16-byte aligned, e.g. bf16 with ``f`` not a multiple
    of 8) falls back to the loop; ``last_used_grouped_mm`` says which path the last call took.
    ``fp8_gemms``: set by :func:`lightning_megatron.precision.fp8.convert_to_fp8` (one ``(fc1, fc2)`` pair of FP8
    GEMMs per local expert): the experts then loop, each expert's two GEMMs in FP8 (own scales per expert and weight).
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, swiglu: bool = True,
                 weight1: Optional[Tensor] = None, weight2: Optional[Tensor] = None,
                 use_grouped_mm: Optional[bool] = None, init_std: float = 0.02, ep_group=None,
                 etp_group=None) -> None:
        super().__init__()
        self.num_local_experts, self.hidden_size, self.ffn_hidden_size = num_local_experts, hidden_size, ffn_hidden_size
        self.swiglu = swiglu
        self.use_grouped_mm = use_grouped_mm
        self.ep_group, self.etp_group = ep_group, etp_group
        etp = group_size(etp_group)
        if ffn_hidden_size % etp != 0:
            raise ValueError(f"moe_ffn_hidden_size ({ffn_hidden_size}) must be divisible by the expert tensor "
                             f"parallel size etp ({etp}): each ETP rank holds f/etp of every expert")
        f_local = ffn_hidden_size // etp
        fc1_out = 2 * f_local if swiglu else f_local
        if weight1 is None:
            weight1 = torch.empty(num_local_experts, hidden_size, fc1_out)
            if not weight1.is_meta:
                weight1.normal_(0.0, init_std)
        if weight2 is None:
            weight2 = torch.empty(num_local_experts, f_local, hidden_size)
            if not weight2.is_meta:
                weight2.normal_(0.0, init_std)
        assert weight1.shape == (num_local_experts, hidden_size, fc1_out), weight1.shape
        assert weight2.shape == (num_local_experts, f_local, hidden_size), weight2.shape
        self.weight1 = nn.Parameter(weight1.clone())
        self.weight2 = nn.Parameter(weight2.clone())
        self.last_used_grouped_mm = False
        self.fp8_gemms: Optional[List[Tuple[Callable[..., Tensor], Callable[..., Tensor]]]] = None

    # ---- layout: local shard <-> global tensor (experts by global index, ffn dim over ETP)
    # dim and stride of the ETP split of each weight
    _ETP_SPLIT = {"weight1": (2, None), "weight2": (1, 1)}

    def _etp_split(self, name: str) -> Tuple[int, int]:
        dim, stride = self._ETP_SPLIT[name]
        return dim, (stride if stride is not None else (2 if self.swiglu else 1))

    @property
    def expert_offset(self) -> int:
        """Global index of the first local expert (``ep_rank * E_local``)."""
        return group_rank(self.ep_group) * self.num_local_experts

    def global_shape(self, name: str) -> Tuple[int, ...]:
        """Shape of the full tensor of all experts: ``weight1 [E, h, 2f]``, ``weight2 [E, f, h]``."""
        shape = list(getattr(self, name).shape)
        shape[0] *= group_size(self.ep_group)
        shape[self._etp_split(name)[0]] *= group_size(self.etp_group)
        return tuple(shape)

    def shard_global(self, name: str, full: Tensor) -> Tensor:
        """This rank's part of the full tensor ``full``: its experts (by global index), its ffn slice."""
        lo = self.expert_offset
        local = full[lo:lo + self.num_local_experts]
        dim, stride = self._etp_split(name)
        return shard_tensor(local, dim, group_rank(self.etp_group), group_size(self.etp_group), stride)

    def gather_global(self, name: str, local: Tensor) -> Tensor:
        """The full tensor from every rank's ``local`` (collective over the ETP group, then the EP group)."""
        dim, stride = self._etp_split(name)
        if group_size(self.etp_group) > 1:
            shards = list(all_gather_dim0(local.contiguous().unsqueeze(0), self.etp_group).unbind(0))
            local = unshard_tensor(shards, dim, stride)
        return all_gather_dim0(local.contiguous(), self.ep_group)

    def is_sharded(self, name: str) -> bool:
        return group_size(self.ep_group) * group_size(self.etp_group) > 1

    def _want_grouped(self, x: Tensor) -> bool:
        if not _grouped_mm_available() or self.use_grouped_mm is False:
            return False
        if self.use_grouped_mm is None:
            return x.is_cuda and x.dtype == torch.bfloat16
        return True

    def forward(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        counts = tokens_per_expert.to("cpu", torch.int64)
        if self.fp8_gemms is not None:
            self.last_used_grouped_mm = False
            return _loop_experts_fp8(tokens, counts.tolist(), self.weight1, self.weight2, self.fp8_gemms,
                                     self.activation)
        w1, w2 = self.weight1.to(tokens.dtype), self.weight2.to(tokens.dtype)
        if self._want_grouped(tokens) and tokens.shape[0] > 0:
            try:
                offs = torch.cumsum(counts, 0).to(device=tokens.device, dtype=torch.int32)
                h = torch._grouped_mm(tokens, w1, offs=offs)
                out = torch._grouped_mm(self.activation(h), w2, offs=offs)
                self.last_used_grouped_mm = True
                return out
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        self.last_used_grouped_mm = False
        return _loop_experts(tokens, counts.tolist(), list(w1.unbind(0)), list(w2.unbind(0)), self.activation)

    def activation(self, h: Tensor) -> Tensor:
        """The experts' activation: ``silu(gate) * up`` of ``h [N, 2f]`` (SwiGLU) or ``gelu(h)``, ``-> [N, f]``
        (what selective recompute's ``"moe_act"`` recomputes)."""
        return _activation(h, self.swiglu)


def _loop_experts(tokens: Tensor, counts: List[int], w1s: List[Tensor], w2s: List[Tensor],
                  activation: Callable[[Tensor], Tensor]) -> Tensor:
    outs = []
    for chunk, w1, w2 in zip(torch.split(tokens, counts, dim=0), w1s, w2s):
        outs.append(activation(chunk @ w1) @ w2)
    if not outs:
        return tokens.new_zeros(0, w2s[0].shape[-1] if w2s else tokens.shape[-1])
    return torch.cat(outs, dim=0)


def _loop_experts_fp8(tokens: Tensor, counts: List[int], weight1: Tensor, weight2: Tensor,
                      gemms: List[Tuple[Callable[..., Tensor], Callable[..., Tensor]]],
                      activation: Callable[[Tensor], Tensor]) -> Tensor:
    """Each local expert's ``activation(x @ w1[e]) @ w2[e]`` with both GEMMs through its FP8 GEMMs ``gemms[e]``
    (``gemm(x [n, in], weight [out, in])``; experts without tokens are skipped). ``[N, h] -> [N, h]`` in the compute
    dtype."""
    outs = []
    for e, chunk in enumerate(torch.split(tokens, counts, dim=0)):
        if chunk.shape[0] == 0:
            continue
        fc1, fc2 = gemms[e]
        h = fc1(chunk, weight1[e].t().contiguous())
        outs.append(fc2(activation(h), weight2[e].t().contiguous()))
    if not outs:
        return tokens.new_zeros(0, weight2.shape[-1])
    return torch.cat(outs, dim=0)


class SequentialMLPExperts(RoutedExperts):
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
                             [w.to(tokens.dtype) for w in self.fc2], self.activation)

    def activation(self, h: Tensor) -> Tensor:
        """The experts' activation (see :meth:`GroupedMLPExperts.activation`)."""
        return _activation(h, self.swiglu)
