"""Context parallelism (CP): attention over a sequence sharded across the ranks of a CP group.

Layout (Megatron's ``get_batch_on_this_cp_rank``): the global sequence of length ``S`` is cut into ``2*cp``
chunks of ``c = S / (2*cp)`` tokens and CP rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` concatenated
("zigzag"), so every rank does the same amount of causal-attention work. Every per-token batch tensor (tokens,
labels, loss_mask, position_ids, RoPE frequencies) must be split the same way (:func:`zigzag_split`,
:func:`zigzag_positions`).

:func:`context_parallel_attention` takes the SDPA layout ``q [b, n_q, s_local, d]``, ``k, v [b, n_kv, s_local,
d]`` (GQA when ``n_kv < n_q``) and returns the rows of full (causal) attention over the whole sequence that
belong to the local tokens. Four communication schemes, as ``cp_comm_type`` in Megatron / Transformer Engine:

- ``"p2p"``: ring exchange of the K/V blocks (each step's exchange is started before the current block is
  computed, so they overlap); partial results are merged with their log-sum-exp. Backward is a second ring
  in which dK/dV travel with the K/V block they belong to (exact, flash-attention style recomputation from
  the saved output and log-sum-exp). Causal work that is fully masked is skipped with TE's zigzag rule.
- ``"all_gather"``: all-gather K/V (reordered to global order), local queries attend at their global
  positions. Not overlapped.
- ``"a2a"`` (Ulysses): all-to-all from sequence-sharded/all-heads to head-sharded/full-sequence, full
  attention, all-to-all back. Heads (``n_q`` and ``n_kv``) must be divisible by cp.
- ``"a2a+p2p"``: a2a inside ``inner_group`` and the ring across ``outer_group``. CP rank must be
  ``outer_rank * inner_size + inner_rank`` (Megatron's ``create_hierarchical_groups``: the first, inner
  level is made of consecutive CP ranks). After the inner a2a a rank holds the chunks of its whole inner
  group, which form a zigzag layout with respect to the outer group, so the same ring applies.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = [
    "zigzag_split",
    "zigzag_gather",
    "zigzag_positions",
    "context_parallel_attention",
    "COMM_TYPES",
]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
_MASK_KINDS = ("full", "causal")


# --------------------------------------------------------------------------------------------------------------
# Zigzag layout
# --------------------------------------------------------------------------------------------------------------


def _check_divisible(n: int, cp_size: int, what: str) -> int:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if n % (2 * cp_size) != 0:
        raise ValueError(
            f"{what} ({n}) must be divisible by 2 * context-parallel size (2 * {cp_size} = {2 * cp_size}) "
            "for the load-balanced (zigzag) context-parallel split"
        )
    return n // (2 * cp_size)


def zigzag_split(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int) -> torch.Tensor:
    """Keep chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks of ``dim``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    c = _check_divisible(t.size(dim), cp_size, f"size of dim {dim}")
    if cp_size == 1:
        return t
    return torch.cat([t.narrow(dim, cp_rank * c, c), t.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)], dim)


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions (``int64 [seq_len / cp_size]``) of the tokens CP rank ``cp_rank`` holds."""
    return zigzag_split(torch.arange(seq_len, device=device), cp_size, cp_rank, 0)


def _chunks_to_global(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Reassemble the zigzag shards of ranks ``0..len(pieces)-1`` (in rank order) into global order."""
    halves = [p.chunk(2, dim) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def zigzag_gather(t_local: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`zigzag_split` over ``group``: all-gather and reorder to global order (no autograd)."""
    cp = dist.get_world_size(group)
    if t_local.size(dim) % 2 != 0:
        raise ValueError(f"local size of dim {dim} ({t_local.size(dim)}) must be even (two zigzag chunks)")
    pieces = [torch.empty_like(t_local) for _ in range(cp)]
    dist.all_gather(pieces, t_local.contiguous(), group=group)
    return _chunks_to_global(pieces, dim)


# --------------------------------------------------------------------------------------------------------------
# Attention block primitive (math path)
# --------------------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask (query i sees keys j <= i + sk - sq); top-left when sq == sk."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def _scores(q, k, mask_kind: str, scale: float) -> torch.Tensor:
    b, nq, sq, d = q.shape
    nkv, sk = k.shape[1], k.shape[2]
    qg = q.reshape(b, nkv, nq // nkv, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * scale
    if mask_kind == "causal":
        s = s.masked_fill(~_causal_mask(sq, sk, q.device), float("-inf"))
    elif mask_kind != "full":
        raise ValueError(f"mask_kind must be one of {_MASK_KINDS}, got {mask_kind!r}")
    return s


#: Environment variable choosing the per-block kernel of the ring on CUDA half types: ``auto`` (default: the
#: fastest measured on H200, see benchmarks/RESULTS.md), ``flash``, ``cudnn`` or ``math``.
KERNEL_ENV = "LIGHTNING_MEGATRON_CP_ATTENTION"
_KERNELS = ("auto", "flash", "cudnn", "math")


def block_kernel(q: torch.Tensor, mask_kind: str, sq: int, sk: int) -> str:
    """The kernel a ring block uses: ``"flash"`` / ``"cudnn"`` (fused, return the log-sum-exp) on CUDA in
    fp16/bf16 with head dim <= 256 and a mask the kernels express (none, or a square causal block: their causal
    mask is top-left aligned), else ``"math"``. :data:`KERNEL_ENV` overrides the fused choice."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in _KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r} must be one of {_KERNELS}")
    fused_ok = (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
                and (mask_kind == "full" or sq == sk))
    if not fused_ok or choice == "math":
        return "math"
    if choice == "auto":
        return "flash" if _CUDNN_FAILED else "cudnn"
    return choice


def use_fused_attention(q: torch.Tensor, mask_kind: str, sq: int, sk: int) -> bool:
    """Whether a block goes to a fused CUDA kernel (see :func:`block_kernel`)."""
    return block_kernel(q, mask_kind, sq, sk) != "math"


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, n_kv, s, d] -> [b, n_kv*groups, s, d]`` (query head ``i`` uses kv head ``i // groups``)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_kv_grad(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`_repeat_kv` for gradients: sum over each kv head's query-head group."""
    if groups == 1:
        return t
    b, n, s, d = t.shape
    return t.reshape(b, n // groups, groups, s, d).sum(2)


def _kernel_inputs(q, k, v):
    """Contiguous ``q`` and K/V with their heads repeated to ``n_q`` (the fused kernels take equal head counts),
    and the repetition factor ``n_q / n_kv``."""
    g = q.shape[1] // k.shape[1]
    return q.contiguous(), _repeat_kv(k, g).contiguous(), _repeat_kv(v, g).contiguous(), g


def _flash_forward(q, k, v, causal: bool, scale: float):
    """Fused flash attention of one block: ``(out [b, n_q, sq, d] in q's dtype, lse [b, n_q, sq] float32)``."""
    q, k, v, _ = _kernel_inputs(q, k, v)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """Fused flash-attention backward of one block given the *final* merged ``out`` and ``lse`` (the kernel
    derives ``delta = rowsum(dout * out)`` itself). Returns ``(dq, dk, dv)`` (dk/dv folded back to n_kv heads)."""
    q, k, v, g = _kernel_inputs(q, k, v)
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
        causal, empty, empty, scale=scale)
    return dq, _fold_kv_grad(dk, g), _fold_kv_grad(dv, g)


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    """Fused cuDNN attention of one block: ``(out [b, n_q, sq, d], lse [b, n_q, sq] float32)``."""
    q, k, v, _ = _kernel_inputs(q, k, v)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    lse = res[1]
    return res[0], lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])  # cuDNN may add a trailing 1


def _cudnn_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """cuDNN attention backward of one block given the final merged ``out`` and ``lse``."""
    q, k, v, g = _kernel_inputs(q, k, v)
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous().unsqueeze(-1), empty, empty, None, None,
        None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    return dq, _fold_kv_grad(dk, g), _fold_kv_grad(dv, g)


_FUSED = {"flash": (_flash_forward, _flash_backward), "cudnn": (_cudnn_forward, _cudnn_backward)}
#: Set once when cuDNN attention is unavailable here (old cuDNN, GPU or shape it rejects): "auto" then uses
#: flash for the rest of the process. A capability cache, not communication state.
_CUDNN_FAILED: List[bool] = []


def _run_fused(which: int, kernel: str, *args):
    """Forward (``which=0``) or backward (1) through ``kernel``; under ``auto`` a cuDNN failure falls back to
    flash (cuDNN is 1.8x faster on H200 at the benchmark model's shapes: benchmarks/RESULTS.md)."""
    if kernel == "cudnn" and os.environ.get(KERNEL_ENV, "auto") == "auto":
        try:
            return _FUSED["cudnn"][which](*args)
        except RuntimeError:
            _CUDNN_FAILED.append(True)
            return _FUSED["flash"][which](*args)
    return _FUSED[kernel][which](*args)


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_kind: str,
                     scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of one Q block against one K/V block: ``(out [b, n_q, sq, d], lse [b, n_q, sq])``.

    ``mask_kind``: ``"full"`` (no mask) or ``"causal"`` (bottom-right aligned; with ``sq == sk`` the usual
    lower triangle). GQA: ``n_q`` is a multiple of ``n_kv``. On CUDA in fp16/bf16 a fused kernel (cuDNN or
    flash, :func:`block_kernel`) computes it without materialising the attention matrix (out in the input dtype,
    lse in float32); otherwise a math path (explicit softmax) in the inputs' dtype, or float32 for half types.
    Not for autograd: the ring has its own backward (:func:`_attention_block_backward`).
    """
    if mask_kind not in _MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {_MASK_KINDS}, got {mask_kind!r}")
    kernel = block_kernel(q, mask_kind, q.shape[2], k.shape[2])
    if kernel != "math":
        return _run_fused(0, kernel, q, k, v, mask_kind == "causal", scale)
    return _math_attention_block(q, k, v, mask_kind, scale)


def _math_attention_block(q, k, v, mask_kind: str, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Math path of :func:`_attention_block`; differentiable by autograd."""
    cd = _compute_dtype(q.dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    b, nq, sq, d = q.shape
    s = _scores(q, k, mask_kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return out.reshape(b, nq, sq, d), lse.reshape(b, nq, sq)


def _attention_output(q, k, v, mask_kind: str, scale: float) -> torch.Tensor:
    """Differentiable attention output only (the all_gather path). Fused SDPA on CUDA half types, where a
    causal block with ``sq < sk`` uses the bottom-right aligned causal bias; otherwise the math path."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        g = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, g), _repeat_kv(v, g)
        sq, sk = q.shape[2], k.shape[2]
        if mask_kind == "causal" and sq != sk:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask_kind == "causal", scale=scale)
    return _math_attention_block(q, k, v, mask_kind, scale)[0].to(q.dtype)


def _attention_block_backward(q, k, v, dout, out, lse, delta, mask_kind: str, scale: float):
    """Exact gradients of one block given the *final* (merged) ``out``, ``lse`` and ``delta = rowsum(dout * out)``.

    Flash-attention backward: ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - delta)``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``. Returns ``(dq, dk, dv)``: the fused CUDA kernel where
    :func:`use_fused_attention` allows (``out`` in q's dtype), else the math path in the compute dtype.
    """
    kernel = block_kernel(q, mask_kind, q.shape[2], k.shape[2])
    if kernel != "math":
        return _run_fused(1, kernel, q, k, v, dout.to(q.dtype), out, lse, mask_kind == "causal", scale)
    cd = _compute_dtype(q.dtype)
    q, k, v, dout = q.to(cd), k.to(cd), v.to(cd), dout.to(cd)
    b, nq, sq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    s = _scores(q, k, mask_kind, scale)
    p = torch.exp(s - lse.reshape(b, nkv, g, sq, 1))
    dog = dout.reshape(b, nkv, g, sq, d)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dog, v)
    ds = p * (dp - delta.reshape(b, nkv, g, sq, 1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k).reshape(b, nq, sq, d) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.reshape(b, nkv, g, sq, d)) * scale
    return dq, dk, dv


def _merge(out, lse, blk_out, blk_lse):
    """Merge a partial result into (out, lse) with the log-sum-exp rule (in place)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


# --------------------------------------------------------------------------------------------------------------
# Ring (p2p)
# --------------------------------------------------------------------------------------------------------------


def _ring_shift(send: torch.Tensor, group, tag: int):
    """Start sending ``send`` to the next rank of ``group`` and receiving the previous rank's; (reqs, recv)."""
    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (r + 1) % cp)
    prv = dist.get_global_rank(group, (r - 1) % cp)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


def _step_plan(step: int, rank: int, cp: int, causal: bool, c: int):
    """Which part of the work at ring ``step`` is visible: (q rows slice, kv cols slice, mask_kind).

    TE's zigzag rule: step 0 = local causal; source rank < my rank: all Q against the first half (chunk
    ``src``) of the received K/V; source rank > my rank: only the second Q chunk against all of it.
    """
    if not causal:
        return slice(None), slice(None), "full"
    if step == 0:
        return slice(None), slice(None), "causal"
    src = (rank - step) % cp
    if src < rank:
        return slice(None), slice(0, c), "full"
    return slice(c, None), slice(None), "full"


_TAG_KV, _TAG_DKV = 0, 1


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``group`` (``None`` = one rank: plain local attention on the local layout)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float):
        cp = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        c = q.shape[2] // 2
        cd = _compute_dtype(q.dtype)
        b, nq, sq, d = q.shape
        if cp == 1:  # one block: nothing to merge (the a2a path and the single-rank reference)
            out, lse = _attention_block(q, k, v, "causal" if causal else "full", scale)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.group, ctx.causal, ctx.scale = group, causal, scale
            return out.to(q.dtype)
        out = torch.empty(b, nq, sq, d, dtype=cd, device=q.device)
        lse = torch.empty((b, nq, sq), dtype=cd, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            reqs = None
            if step + 1 < cp:  # start the next exchange before computing this block
                reqs, nxt_kv = _ring_shift(kv, group, _TAG_KV)
            rows, cols, mask = _step_plan(step, rank, cp, causal, c)
            blk_out, blk_lse = _attention_block(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], mask, scale)
            if step == 0:  # step 0 covers every row: start from it instead of merging into zeros / -inf
                out.copy_(blk_out)
                lse.copy_(blk_lse)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], blk_out.to(cd), blk_lse.to(cd))
            if reqs is not None:
                _wait(reqs)
                kv = nxt_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        c = q.shape[2] // 2
        cd = _compute_dtype(q.dtype)
        if use_fused_attention(q, "full", 1, 1):  # every ring block is fused: it takes out/dout in q's dtype
            out, dout, delta = out.to(q.dtype), dout.to(q.dtype), None
        else:
            dout = dout.to(cd)
            delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = None  # accumulator of the K/V block held at this step; it travels with the block
        dkv_reqs, recv_dkv = None, None
        for step in range(cp):
            reqs = None
            if step + 1 < cp:
                reqs, nxt_kv = _ring_shift(kv, group, _TAG_KV)
            rows, cols, mask = _step_plan(step, rank, cp, causal, c)
            bdq, bdk, bdv = _attention_block_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                      dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                                      None if delta is None else delta[:, :, rows], mask, scale)
            dq[:, :, rows] += bdq
            if dkv_reqs is None:
                dkv = torch.zeros((2,) + tuple(k.shape), dtype=cd, device=k.device)
            else:
                _wait(dkv_reqs)
                dkv = recv_dkv
            dkv[0][:, :, cols] += bdk
            dkv[1][:, :, cols] += bdv
            if cp > 1:  # pass the accumulator on with its block (after the last step it reaches its owner)
                dkv_reqs, recv_dkv = _ring_shift(dkv, group, _TAG_DKV)
            if reqs is not None:
                _wait(reqs)
                kv = nxt_kv
        if dkv_reqs is not None:
            _wait(dkv_reqs)
            dkv = recv_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# --------------------------------------------------------------------------------------------------------------
# all-to-all (Ulysses) and all-gather, autograd-aware
# --------------------------------------------------------------------------------------------------------------


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, n, s_local, d]`` zigzag shard of all heads -> ``[b, n/A, A*s_local, d]`` (A = group size).

    The result is the group's sequence in "group-zigzag" order: first chunks of ranks 0..A-1 then second
    chunks of ranks A-1..0 (global order when the group is the whole CP group).
    """
    a = dist.get_world_size(group)
    b, n, s, d = x.shape
    send = x.reshape(b, a, n // a, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return _chunks_to_global(list(recv.unbind(0)), dim=2)


def _head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`."""
    a = dist.get_world_size(group)
    b, h, _, d = y.shape
    send = torch.stack([zigzag_split(y, a, j, 2) for j in range(a)]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, a * h, send.shape[3], d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, g):
        return _head_to_seq(g.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_head(g.contiguous(), ctx.group), None


class _AllGatherSeq(torch.autograd.Function):
    """All-gather zigzag shards along dim 2 into global order; backward sums over ranks and re-splits."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return zigzag_gather(x, group, dim=2)

    @staticmethod
    def backward(ctx, g):
        # gloo has no reduce-scatter: all-reduce then keep this rank's zigzag chunks (exact, more traffic)
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return zigzag_split(g, dist.get_world_size(ctx.group), dist.get_rank(ctx.group), 2), None


def _all_gather_attention(q, k, v, group, causal: bool, scale: float) -> torch.Tensor:
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    kg = _AllGatherSeq.apply(k, group)
    vg = _AllGatherSeq.apply(v, group)
    if not causal:
        return _attention_output(q, kg, vg, "full", scale)
    c = q.shape[2] // 2
    outs = []
    for i, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c  # queries of global chunk `chunk` see keys [0, end), causal at the end
        outs.append(_attention_output(q[:, :, i * c:(i + 1) * c], kg[:, :, :end], vg[:, :, :end], "causal", scale))
    return torch.cat(outs, dim=2).to(q.dtype)


# --------------------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------------------


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                               comm_type: str = "p2p", causal: bool = True, scale: Optional[float] = None,
                               inner_group=None, outer_group=None) -> torch.Tensor:
    """Attention of the local zigzag tokens against the whole (CP-sharded) sequence.

    ``q [b, n_q, s_local, d]``, ``k, v [b, n_kv, s_local, d]``, every rank of ``group`` holding chunks
    ``(r, 2cp-1-r)`` of the sequence (:func:`zigzag_split` along the sequence dim). Returns
    ``[b, n_q, s_local, d]``, the matching rows of full attention (causal by default) over the whole
    sequence. Differentiable with exact gradients for q, k and v. ``group=None`` or a group of size 1 is plain
    local attention. ``comm_type``: ``"p2p"``, ``"all_gather"``, ``"a2a"`` or ``"a2a+p2p"`` (the latter needs
    ``inner_group`` (a2a) and ``outer_group`` (ring) with ``inner_size * outer_size == cp``).
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {comm_type!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, heads, s_local, d]; got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, nq, s_local, d = q.shape
    if k.shape[0] != b or k.shape[2] != s_local or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} "
                         "in batch, sequence or head dim")
    nkv = k.shape[1]
    if nq % nkv != 0:
        raise ValueError(f"number of query heads ({nq}) must be a multiple of key/value heads ({nkv})")
    cp = _group_size(group)
    if s_local % 2 != 0:
        raise ValueError(
            f"local sequence length ({s_local}) must be even: the global sequence length ({s_local * cp}) must "
            f"be divisible by 2 * context-parallel size (2 * {cp} = {2 * cp})"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    if cp == 1:
        return _RingAttention.apply(q, k, v, None, causal, scale)
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, causal, scale)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, group, causal, scale)
    if comm_type == "a2a":
        _check_heads(nq, nkv, cp, "context-parallel size")
        return _a2a_attention(q, k, v, group, None, causal, scale)
    # a2a+p2p
    if inner_group is None or outer_group is None:
        raise ValueError("comm_type 'a2a+p2p' needs both inner_group (a2a) and outer_group (p2p ring)")
    inner, outer = _group_size(inner_group), _group_size(outer_group)
    if inner * outer != cp:
        raise ValueError(f"hierarchical context-parallel sizes {inner} (inner, a2a) x {outer} (outer, p2p) = "
                         f"{inner * outer} must equal the context-parallel size {cp}")
    expected = dist.get_rank(outer_group) * inner + dist.get_rank(inner_group)
    if dist.get_rank(group) != expected:
        raise ValueError(
            f"CP rank {dist.get_rank(group)} must equal outer_rank * inner_size + inner_rank = "
            f"{dist.get_rank(outer_group)} * {inner} + {dist.get_rank(inner_group)} = {expected}: the inner "
            "(a2a) groups must be consecutive CP ranks and the outer (ring) groups strided by inner_size"
        )
    _check_heads(nq, nkv, inner, "inner (a2a) context-parallel size")
    return _a2a_attention(q, k, v, inner_group, outer_group if outer > 1 else None, causal, scale)


def _check_heads(nq: int, nkv: int, size: int, what: str) -> None:
    if nq % size != 0 or nkv % size != 0:
        raise ValueError(f"a2a context parallelism needs the number of query heads ({nq}) and key/value heads "
                         f"({nkv}) to be divisible by the {what} ({size})")


def _a2a_attention(q, k, v, a2a_group, ring_group, causal: bool, scale: float) -> torch.Tensor:
    qh, kh, vh = (_SeqToHead.apply(t, a2a_group) for t in (q, k, v))
    out = _RingAttention.apply(qh, kh, vh, ring_group, causal, scale)
    return _HeadToSeq.apply(out, a2a_group)
