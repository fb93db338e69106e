"""Megatron-style tensor-parallel layers on plain tensors.

All layers take activations sequence-first, ``[s, b, h]``. Under sequence parallelism (SP) the input of
a column-parallel layer and the output of a row-parallel layer are split along ``s`` over the TP group.
Each layer keeps its local GEMM a plain ``F.linear``-shaped call on a local ``weight`` so FP8 libraries can
convert it later, and knows how its local shard relates to the global tensor (``global_shape`` /
``shard_global`` / ``gather_global``), which layout-independent initialisation and checkpoints use.
"""
from __future__ import annotations

from typing import Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.parallel.layout_rules import pad_vocab_size
from lightning_megatron.parallel.tensor_parallel.comm_overlap import ring_column_parallel_linear, ring_row_parallel_linear
from lightning_megatron.parallel.tensor_parallel.mappings import (
    Group,
    all_gather_dim0,
    all_gather_into,
    reduce_scatter_into,
    all_reduce,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_dim0,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def shard_tensor(full: Tensor, dim: int, rank: int, size: int, stride: int = 1) -> Tensor:
    """This rank's shard of ``full`` along ``dim``.

    With ``stride > 1`` the dim is first cut into ``stride`` equal blocks (e.g. SwiGLU's ``[gate; up]``)
    and the rank takes its slice of every block, as Megatron's ``partition_stride``.
    """
    if size == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    for b in blocks:
        if b.shape[dim] % size != 0:
            raise ValueError(
                f"dimension {dim} of size {full.shape[dim]} (stride {stride}) is not divisible by tp={size}"
            )
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard_tensor(shards: list[Tensor], dim: int, stride: int = 1) -> Tensor:
    """Inverse of :func:`shard_tensor` given every rank's shard, in rank order."""
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim) for i in range(stride)], dim=dim)


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (vocabulary padding)."""
    if t.shape[0] >= rows:
        return t
    pad = t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


class TensorParallelModule(nn.Module):
    """Base of the TP layers: how each local parameter maps onto its global (unpadded) tensor.

    Subclasses set ``self.group`` (the TP group), ``self._partition`` = {param name: (dim, stride)} and
    ``self._vocab_rows`` (the true vocabulary size where dim 0 is a padded vocabulary, else None).
    """

    group: Group
    _partition: dict
    _vocab_rows: Optional[int] = None
    _padded_rows: Optional[int] = None
    _canonical_rows: Optional[int] = None  # vocabulary rows of the tp=1 layout, used by gather_global

    @property
    def tp_size(self) -> int:
        return group_size(self.group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.group)

    def is_sharded(self, name: str) -> bool:
        """Whether parameter ``name`` is split over the TP group (else it is replicated)."""
        return name in self._partition and self.tp_size > 1

    def global_shape(self, name: str) -> Tuple[int, ...]:
        """Shape of the global, unpadded tensor behind local parameter ``name``."""
        local = tuple(getattr(self, name).shape)
        if name not in self._partition:
            return local
        dim, _ = self._partition[name]
        shape = list(local)
        shape[dim] *= self.tp_size
        if self._vocab_rows is not None and dim == 0:
            shape[0] = self._vocab_rows
        return tuple(shape)

    def shard_global(self, name: str, full: Tensor) -> Tensor:
        """Local shard of the global (unpadded) tensor ``full`` for parameter ``name``."""
        if name not in self._partition:
            return full
        dim, stride = self._partition[name]
        if self._vocab_rows is not None and dim == 0:
            full = pad_rows(full, self._padded_rows)
        return shard_tensor(full, dim, self.tp_rank, self.tp_size, stride)

    def gather_global(self, name: str, local: Tensor) -> Tensor:
        """Global tensor from every TP rank's ``local`` (collective over the TP group).

        A padded vocabulary dim is cut to the true vocabulary, then padded to ``_canonical_rows`` if set.
        """
        if name not in self._partition:
            return local
        dim, stride = self._partition[name]
        size = self.tp_size
        if size > 1:
            shards = list(all_gather_dim0(local.contiguous().unsqueeze(0), self.group).unbind(0))
            full = unshard_tensor(shards, dim, stride)
        else:
            full = local
        if self._vocab_rows is not None and dim == 0:
            full = full[: self._vocab_rows]
            if self._canonical_rows is not None:
                full = pad_rows(full, self._canonical_rows)
        return full


def tensor_parallel_sharded(module: nn.Module) -> Set[int]:
    """``id()`` of the parameters of ``module`` that are shards over the TP group (their squared norms are summed over
    TP; every other parameter is replicated over it). No communication."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, TensorParallelModule)
        for name, p in m.named_parameters(recurse=False)
        if m.is_sharded(name)
    }


class _ColumnParallelLinearFn(torch.autograd.Function):
    """``y = gather_sp(x) @ W^T + b`` with the backward collectives overlapped with the weight-grad GEMM.

    Forward under SP all-gathers ``x`` over dim 0; with ``recompute_gather`` it keeps only the local shard
    for backward and redoes the gather there, overlapped with the input-gradient GEMM (Megatron's choice:
    less memory), otherwise it keeps the gathered input (one collective fewer). Backward computes the input gradient first, launches its
    reduction (reduce-scatter under SP, all-reduce otherwise) asynchronously, and computes the weight
    gradient while it is in flight. Mixed precision is explicit: under autocast inputs and weight are cast
    to the autocast dtype and the weight gradient is returned in the weight's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, compute_dtype, recompute_gather):
        if compute_dtype is not None:
            x_c, w_c = x.to(compute_dtype), weight.to(compute_dtype)
            b_c = bias.to(compute_dtype) if bias is not None else None
        else:
            x_c, w_c, b_c = x, weight, bias
        total = all_gather_dim0(x_c, group) if sequence_parallel else x_c
        regather = sequence_parallel and recompute_gather
        ctx.save_for_backward(x_c if regather else total, w_c)
        ctx.group, ctx.sp, ctx.regather, ctx.has_bias = group, sequence_parallel, regather, bias is not None
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(total, w_c, b_c)

    @staticmethod
    def backward(ctx, grad_out):
        saved, w_c = ctx.saved_tensors
        group, sp = ctx.group, ctx.sp
        grad_out = grad_out.to(w_c.dtype).contiguous()
        total = saved
        gather_work = None
        if ctx.regather and group_size(group) > 1:
            total = torch.empty(
                (saved.shape[0] * group_size(group),) + tuple(saved.shape[1:]), dtype=saved.dtype, device=saved.device
            )
            gather_work = all_gather_into(total, saved.contiguous(), group=group, async_op=True)
        grad_input = grad_out.matmul(w_c)
        if gather_work is not None:
            gather_work.wait()
        reduce_work = None
        if group_size(group) > 1:
            if sp:
                sub = torch.empty(
                    (grad_input.shape[0] // group_size(group),) + tuple(grad_input.shape[1:]),
                    dtype=grad_input.dtype,
                    device=grad_input.device,
                )
                reduce_work = reduce_scatter_into(sub, grad_input.contiguous(), group=group, async_op=True)
            else:
                reduce_work = dist.all_reduce(grad_input, group=group, async_op=True)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = g2.t().matmul(total.reshape(-1, total.shape[-1])).to(ctx.weight_dtype)
        grad_bias = g2.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        if reduce_work is not None:
            reduce_work.wait()
            if sp:
                grad_input = sub
        return grad_input.to(ctx.x_dtype), grad_weight, grad_bias, None, None, None, None


def _autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


class ColumnParallelLinear(TensorParallelModule):
    """``Y = X A^T + b`` with ``A`` split by output rows over the TP group.

    Args:
        input_size, output_size: global sizes. Weight is ``[output_size/tp, input_size]``.
        group: TP process group (``None`` = no parallelism).
        bias: whether to hold a (split) bias.
        sequence_parallel: input is ``[s/tp, b, in]`` and is all-gathered over ``group`` (reduce-scatter of
            its gradient); otherwise input is ``[s, b, in]`` replicated (gradient all-reduced).
        gather_output: all-gather the output's last dim (default False: keep ``[s, b, out/tp]``).
        stride: partition stride of the output dim (2 for fused ``[gate; up]``).
        skip_weight_param_allocation: hold no weight; ``forward`` then needs ``weight=`` (tied output layer).
        vocab_size: when dim 0 is a padded vocabulary, the true vocabulary size (rows past it are padding).

    Attribute ``recompute_input_gather`` (default False): under SP, True keeps only the local input shard
    for backward and all-gathers it again there (Megatron's choice, less activation memory); False keeps the
    gathered input (one collective fewer per layer; measured 8% faster at tp=2 on H200 for +0.7 GiB).
    """

    recompute_input_gather: bool = False
    #: the local GEMM ``(x, weight, bias) -> y`` in FP8 (set by ``lightning_megatron.precision.fp8.convert_to_fp8``),
    #: else None
    fp8_gemm = None
    #: under SP: the gather and GEMM as a ring of chunks (``tp_comm_overlap``; tensor_parallel/comm_overlap.py)
    tp_comm_overlap: bool = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        group: Group = None,
        bias: bool = False,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        vocab_size: Optional[int] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        tp = group_size(group)
        if output_size % tp != 0:
            raise ValueError(f"output_size={output_size} is not divisible by tp={tp}")
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = sequence_parallel and tp > 1
        self.gather_output = gather_output
        self._partition = {"weight": (0, stride), "bias": (0, stride)}
        self._vocab_rows, self._padded_rows = vocab_size, output_size if vocab_size is not None else None
        kw = dict(device=device, dtype=dtype)
        self.weight = (
            None if skip_weight_param_allocation else nn.Parameter(torch.empty(output_size // tp, input_size, **kw))
        )
        self.bias = nn.Parameter(torch.zeros(output_size // tp, **kw)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Group, sequence_parallel: bool = False, stride: int = 1,
                    vocab_size: Optional[int] = None, padded_size: Optional[int] = None,
                    tied: bool = False) -> "ColumnParallelLinear":
        """Build from a plain linear (``weight [out, in]``), keeping this rank's shard of its values.

        Meta-device weights stay on meta. ``padded_size``: global output size after vocabulary padding for
        this tp. ``tied``: hold no weight (the output layer uses the embedding's).
        """
        weight = getattr(linear, "weight", None)
        out, inp = (padded_size or linear.out_features), linear.in_features
        ref = weight if weight is not None else torch.empty(0)
        layer = cls(inp, out, group, bias=getattr(linear, "bias", None) is not None,
                    sequence_parallel=sequence_parallel, stride=stride, skip_weight_param_allocation=tied,
                    vocab_size=vocab_size, device=ref.device, dtype=ref.dtype)
        if weight is not None and not tied and not weight.is_meta:
            full = weight.detach()[:vocab_size] if vocab_size is not None else weight.detach()
            layer.weight.data.copy_(layer.shard_global("weight", full))
        if layer.bias is not None and not linear.bias.is_meta:
            layer.bias.data.copy_(layer.shard_global("bias", linear.bias.detach()))
        return layer

    def forward(self, x: Tensor, weight: Optional[Tensor] = None) -> Tensor:
        """``x``: ``[s/tp, b, in]`` under SP else ``[s, b, in]`` -> ``[s, b, out/tp]`` (or ``out`` gathered)."""
        w = self.weight if weight is None else weight
        if w is None:
            raise RuntimeError("ColumnParallelLinear was built with skip_weight_param_allocation: pass weight=")
        if self.fp8_gemm is not None and self.sequence_parallel and self.tp_size > 1 \
                and getattr(getattr(self.fp8_gemm, "config", None), "gathers_in_fp8", False):
            y = self.fp8_gemm.sequence_parallel(x, w, self.bias, self.group)   # the input gathered in FP8
        elif self.fp8_gemm is not None:   # the same collectives as mappings, around the FP8 GEMM
            if self.tp_size > 1:
                x = (gather_from_sequence_parallel_region(x, self.group) if self.sequence_parallel
                     else copy_to_tensor_model_parallel_region(x, self.group))
            y = self.fp8_gemm(x, w, self.bias)
        elif self.tp_size == 1:
            y = F.linear(x, w, self.bias)
        elif self.tp_comm_overlap and self.sequence_parallel:
            y = ring_column_parallel_linear(x, w, self.bias, self.group, _autocast_dtype(x),
                                            self.recompute_input_gather)
        else:
            y = _ColumnParallelLinearFn.apply(x, w, self.bias, self.group, self.sequence_parallel, _autocast_dtype(x),
                                              self.recompute_input_gather)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, sp={self.sequence_parallel}"


class RowParallelLinear(TensorParallelModule):
    """``Y = X A^T + b`` with ``A`` split by input columns over the TP group; input is already split.

    Args:
        input_size, output_size: global sizes. Weight is ``[output_size, input_size/tp]``.
        group: TP process group.
        bias: a replicated bias added after the reduction (its grad is all-reduced over TP under SP).
        sequence_parallel: reduce-scatter the output to ``[s/tp, b, out]`` instead of all-reducing it.

    Attribute ``reduce_bias_grad`` (default True): under SP all-reduce the bias gradient over TP inside
    backward. The strategy sets it False and reduces all SP-replicated gradients in one collective before
    the optimizer step (:func:`lightning_megatron.parallel.grad_sync.allreduce_sequence_parallel_grads`).
    """

    reduce_bias_grad: bool = True
    #: the local GEMM ``(x, weight, bias) -> y`` in FP8 (set by ``lightning_megatron.precision.fp8.convert_to_fp8``),
    #: else None
    fp8_gemm = None
    #: under SP: the GEMM and reduce-scatter as a ring of chunks (``tp_comm_overlap``; tensor_parallel/comm_overlap.py)
    tp_comm_overlap: bool = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        group: Group = None,
        bias: bool = False,
        sequence_parallel: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = group
        tp = group_size(group)
        if input_size % tp != 0:
            raise ValueError(f"input_size={input_size} is not divisible by tp={tp}")
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = sequence_parallel and tp > 1
        self._partition = {"weight": (1, 1)}
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp, **kw))
        self.bias = nn.Parameter(torch.zeros(output_size, **kw)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Group, sequence_parallel: bool = False) -> "RowParallelLinear":
        """Build from a plain linear, keeping this rank's column shard of its weight (meta stays meta)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    sequence_parallel=sequence_parallel, device=w.device, dtype=w.dtype)
        if not w.is_meta:
            layer.weight.data.copy_(layer.shard_global("weight", w.detach()))
            if layer.bias is not None:
                layer.bias.data.copy_(linear.bias.detach())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[s, b, in/tp]`` -> ``[s/tp, b, out]`` under SP, else ``[s, b, out]``."""
        linear = F.linear if self.fp8_gemm is None else self.fp8_gemm
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        if self.sequence_parallel and self.tp_comm_overlap and self.fp8_gemm is None:
            y = ring_row_parallel_linear(x, self.weight, self.group, _autocast_dtype(x))
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(linear(x, self.weight), self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(linear(x, self.weight), self.group)
        if self.bias is not None:
            reduce = self.sequence_parallel and self.reduce_bias_grad
            bias = copy_to_tensor_model_parallel_region(self.bias, self.group) if reduce else self.bias
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding with the (padded) vocabulary split by rows over the TP group.

    Token ids outside this rank's range are looked up as 0 and their rows zeroed, then the partial
    embeddings are summed over the group: all-reduce (output ``[s, b, h]``) or, with ``reduce_scatter``
    (sequence parallel), reduce-scatter along ``s`` (output ``[s/tp, b, h]``).

    Args:
        num_embeddings: padded vocabulary size (a multiple of tp); weight is ``[num_embeddings/tp, h]``.
        embedding_dim: hidden size.
        group: TP group.
        vocab_size: the true vocabulary size (rows past it are padding, never looked up).
        reduce_scatter: reduce-scatter the output over the sequence (SP) instead of all-reducing.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group = None,
                 vocab_size: Optional[int] = None, reduce_scatter: bool = False,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.group = group
        tp = group_size(group)
        if num_embeddings % tp != 0:
            raise ValueError(f"padded vocabulary {num_embeddings} is not divisible by tp={tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = num_embeddings // tp
        self.vocab_start = self.per_rank * group_rank(group)
        self.reduce_scatter = reduce_scatter and tp > 1
        self._partition = {"weight": (0, 1)}
        self._vocab_rows = vocab_size if vocab_size is not None else num_embeddings
        self._padded_rows = num_embeddings
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Group, vocab_size: int, padded_size: int,
                       reduce_scatter: bool = False) -> "VocabParallelEmbedding":
        """Build from a plain embedding (rows past ``vocab_size`` are padding); meta stays meta."""
        w = emb.weight
        layer = cls(padded_size, emb.embedding_dim, group, vocab_size, reduce_scatter, device=w.device, dtype=w.dtype)
        if not w.is_meta:
            layer.weight.data.copy_(layer.shard_global("weight", w.detach()[:vocab_size]))
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        """``ids``: ``[s, b]`` -> ``[s, b, h]`` (or ``[s/tp, b, h]`` with ``reduce_scatter``)."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_tensor_model_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, sp={self.reduce_scatter}"


def apply_tp_comm_overlap(module: nn.Module, enabled: bool) -> int:
    """With ``enabled``: switch the sequence-parallel column- and row-parallel linear layers of ``module`` (not
    those running FP8 GEMMs) to the ring paths. Returns the number of layers switched."""
    if not enabled:
        return 0
    count = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel:
            m.tp_comm_overlap = True
            count += 1
    return count


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "TensorParallelModule",
    "pad_vocab_size",
    "shard_tensor",
    "unshard_tensor",
    "all_reduce",
    "reduce_scatter_dim0",
    "apply_tp_comm_overlap",
]
