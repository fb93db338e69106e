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
  computed, so they overlap); partial results are merged with their log-sum-exp. Backward is a second ring,
  run in the other direction and ending with the own block, in which dK/dV travel with the K/V block they
  belong to (exact, flash-attention style recomputation from the saved output and log-sum-exp). Causal work
  that is fully masked is skipped with TE's zigzag rule.
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
import warnings
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


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the fused kernels take it: any strides (the model's ``[s, b, n, d]`` activations viewed as
    ``[b, n, s, d]`` are fine) as long as the head dim is contiguous. Both kernels take GQA K/V (fewer heads than
    ``q``) natively (benchmarks/probe_cp_kernels.py), so nothing is repeated or copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_forward(q, k, v, causal: bool, scale: float):
    """Fused flash attention of one block: ``(out [b, n_q, sq, d] in q's dtype and layout, lse [b, n_q, sq]
    float32)``."""
    q, k, v = (_kernel_input(t) for t in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """Fused flash-attention backward of one block given the *final* merged ``out`` and ``lse`` (the kernel
    derives ``delta = rowsum(dout * out)`` itself). Returns ``(dq, dk, dv)`` with the heads of q, k and v."""
    q, k, v, dout, out = (_kernel_input(t) for t in (q, k, v, dout, out))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty,
        scale=scale)
    return dq, dk, dv


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    """Fused cuDNN attention of one block: ``(out [b, n_q, sq, d] in q's layout, lse [b, n_q, sq] float32)``."""
    q, k, v = (_kernel_input(t) for t in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    lse = res[1]
    return res[0], lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])  # cuDNN may add a trailing 1


def _cudnn_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """cuDNN attention backward of one block given the final merged ``out`` and ``lse``."""
    q, k, v, dout, out = (_kernel_input(t) for t in (q, k, v, dout, out))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.contiguous().unsqueeze(-1), empty, empty, None, None, None, q.shape[2], k.shape[2],
        0.0, causal, scale=scale)
    return dq, dk, dv


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
        gqa = q.shape[1] != k.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        if mask_kind == "causal" and sq != sk:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), scale=scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask_kind == "causal", scale=scale, enable_gqa=gqa)
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


def _merge_rows(o: torch.Tensor, l: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """``(o, l) <- merge((o, l), (blk_out, blk_lse))`` in place, in ``l``'s precision (float32 for half types).

    The two weights ``exp(l - new)`` and ``exp(blk_lse - new)`` sum to one, so the merge is a linear
    interpolation towards the block; ``o`` (float32 or the kernels' half type) is rounded once.
    """
    new_lse = torch.logaddexp(l, blk_lse.to(l.dtype))
    w = torch.exp(blk_lse - new_lse).unsqueeze(-1)
    o.copy_(torch.lerp(o.to(l.dtype), blk_out.to(l.dtype), w))
    l.copy_(new_lse)


#: Environment variable: ``0`` keeps the ring's output merge eager on CUDA (default: one compiled kernel).
COMPILE_ENV = "LIGHTNING_MEGATRON_CP_COMPILE"
#: The merge used on CUDA, made on first use: :func:`_merge_rows` compiled into one fused kernel (TE fuses its
#: output correction the same way), or eager when compiling is off or fails. A capability cache, no comm state.
_CUDA_MERGE: List = []


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Merge a partial result for ``rows`` into ``(out, lse)`` in place with the log-sum-exp rule. Eager, the
    merge is four or five passes over the block (casts, lerp, copy back); on CUDA one compiled kernel reads
    ``out``, the block and the lse's and writes ``out`` once."""
    o, l = out[:, :, rows], lse[:, :, rows]
    if not o.is_cuda or os.environ.get(COMPILE_ENV, "1") == "0":
        return _merge_rows(o, l, blk_out, blk_lse)
    if not _CUDA_MERGE:
        _CUDA_MERGE.append(torch.compile(_merge_rows, dynamic=False, fullgraph=True))
    try:
        return _CUDA_MERGE[0](o, l, blk_out, blk_lse)
    except Exception as e:  # noqa: BLE001 - no compiler/triton here: fall back to eager, once, loudly
        if _CUDA_MERGE[0] is _merge_rows:
            raise
        warnings.warn(f"context parallel: compiling the ring's output merge failed ({type(e).__name__}: {e}); "
                      f"using eager ops (set {COMPILE_ENV}=0 to skip the attempt)")
        _CUDA_MERGE[0] = _merge_rows
        return _merge_rows(o, l, blk_out, blk_lse)


def _accumulator_dtype(q: torch.Tensor, cp: int, fused: bool) -> torch.dtype:
    """dtype of the ring's output / dq / dK,dV accumulators. Float32 in general; the kernels' own half type when
    they produce it and there is at most one addition (cp=2), where rounding the float32 sum once equals adding
    in the half type (the add is computed in float32 and rounded), so nothing is lost and two copies are saved."""
    return q.dtype if fused and cp <= 2 else _compute_dtype(q.dtype)


# --------------------------------------------------------------------------------------------------------------
# Ring (p2p)
# --------------------------------------------------------------------------------------------------------------


def _ring_shift(send: torch.Tensor, group, tag: int, backwards: bool = False):
    """Start sending ``send`` to the next rank of ``group`` and receiving the previous rank's (``backwards``:
    to the previous rank, from the next); returns ``(reqs, recv)``."""
    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    step = -1 if backwards else 1
    to = dist.get_global_rank(group, (r + step) % cp)
    frm = dist.get_global_rank(group, (r - step) % cp)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, to, group, tag), dist.P2POp(dist.irecv, recv, frm, group, tag)]
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


def _block_plan(src: int, rank: int, causal: bool, c: int):
    """Which part of the attention of my queries against the K/V block of CP rank ``src`` is visible:
    (q rows slice, kv cols slice, mask_kind).

    TE's zigzag rule: my own block is causal; ``src < rank``: all Q against the first half (chunk ``src``) of
    the block; ``src > rank``: only the second Q chunk against all of it. Every rank does the same work.
    """
    if not causal:
        return slice(None), slice(None), "full"
    if src == rank:
        return slice(None), slice(None), "causal"
    if src < rank:
        return slice(None), slice(0, c), "full"
    return slice(c, None), slice(None), "full"


_TAG_KV, _TAG_DKV = 0, 1


def _ring_forward(q, k, v, group, causal: bool, scale: float):
    """Ring attention forward over ``group`` (``None``: one rank). Returns ``(out in q's dtype, saved tensors for
    :func:`_ring_backward`, fused)``. See :class:`_RingAttention` for the schedule."""
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    c = q.shape[2] // 2
    fused = use_fused_attention(q, "full", 1, 1)
    acc = _accumulator_dtype(q, cp, fused)
    if cp == 1:  # one block: nothing to merge (the a2a path and the single-rank reference)
        out, lse = _attention_block(q, k, v, "causal" if causal else "full", scale)
        return out.to(q.dtype), (q, k, v, out, lse), fused
    kv = torch.stack([k, v])
    held = kv
    out = lse = None
    for step in range(cp):
        reqs = None
        if step + 1 < cp:  # start the next exchange before computing this block
            reqs, nxt_kv = _ring_shift(held, group, _TAG_KV)
        rows, cols, mask = _block_plan((rank - step) % cp, rank, causal, c)
        blk_out, blk_lse = _attention_block(q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols], mask, scale)
        if step == 0:  # step 0 covers every row: start from it instead of merging into zeros / -inf
            out, lse = blk_out.to(acc), blk_lse.to(_compute_dtype(q.dtype))
        else:
            _merge(out, lse, rows, blk_out, blk_lse)
        if reqs is not None:
            _wait(reqs)
            held = nxt_kv
    out_q = out.to(q.dtype)
    return out_q, (q, kv, held, out_q if fused else out, lse), fused


def _ring_backward(saved, fused: bool, group, causal: bool, scale: float, dout):
    """Gradients ``(dq, dk, dv)`` of :func:`_ring_forward` from its saved tensors and ``dout``."""
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    if cp == 1:
        q, k, v, out, lse = saved
    else:
        q, own, last, out, lse = saved
    c = q.shape[2] // 2
    if fused:  # the fused kernels take out/dout in q's dtype and derive delta themselves
        dout, delta = dout.to(q.dtype), None
    else:
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(-1)
    if cp == 1:
        dq, dk, dv = _attention_block_backward(q, k, v, dout, out, lse, delta, "causal" if causal else "full", scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    acc = _accumulator_dtype(q, cp, fused)
    dq = dkv = None
    dkv_reqs = recv_dkv = None
    held = last  # block of rank + 1; step j holds the block of rank + 1 + j, the last step the own one
    for step in range(cp):
        reqs = None
        if step + 2 < cp:  # the block after next-but-last travels; the last one is the saved own block
            reqs, nxt_kv = _ring_shift(held, group, _TAG_KV, backwards=True)
        rows, cols, mask = _block_plan((rank + 1 + step) % cp, rank, causal, c)
        bdq, bdk, bdv = _attention_block_backward(q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols],
                                                  dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                                  None if delta is None else delta[:, :, rows], mask, scale)
        if dq is None and rows == slice(None):
            dq = bdq.to(acc)
        else:
            if dq is None:
                dq = torch.zeros(q.shape, dtype=acc, device=q.device)
            dq[:, :, rows] += bdq
        if step == 0 and cols == slice(None):  # this block's accumulator starts here
            dkv = torch.stack([bdk, bdv]).to(acc)
        else:
            if step == 0:
                dkv = torch.zeros((2,) + tuple(held.shape[1:]), dtype=acc, device=q.device)
            else:  # ... or arrives from the next rank, which held this block one step earlier
                _wait(dkv_reqs)
                dkv = recv_dkv
            dkv[0][:, :, cols] += bdk
            dkv[1][:, :, cols] += bdv
        if step + 1 < cp:  # pass the accumulator on with its block; the own block's stays here
            dkv_reqs, recv_dkv = _ring_shift(dkv, group, _TAG_DKV, backwards=True)
        if reqs is not None:
            _wait(reqs)
            held = nxt_kv
        elif step + 2 == cp:
            held = own
    return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``group`` (``None`` = one rank: plain local attention on the local layout).

    Forward: step ``s`` holds the K/V block of rank ``rank - s`` (own block first) while the next one travels
    forwards. Backward runs the ring the other way, ending with the own block: it starts from the block the
    forward held last (rank ``rank + 1``, saved), then blocks ``rank + 2, ...`` travel backwards, and the own
    block's dK/dV accumulator arrives from the next rank while the own (causal, largest) block is computed, so
    no transfer is left exposed at the end. Each block's accumulator travels with the block. At cp=2 no K/V
    moves in backward at all. Memory: one extra K/V block per layer.

    Inputs may be strided views (the model passes its ``[s, b, n, d]`` activations as ``[b, n, s, d]``); on the
    fused path the output and ``dq`` keep ``q``'s layout, so the model's reshape back is free. K/V travel as
    one contiguous ``[2, b, n_kv, s_local, d]`` buffer.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float):
        out, saved, fused = _ring_forward(q, k, v, group, causal, scale)
        ctx.save_for_backward(*saved)
        ctx.group, ctx.causal, ctx.scale, ctx.fused = group, causal, scale, fused
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _ring_backward(ctx.saved_tensors, ctx.fused, ctx.group, ctx.causal, ctx.scale, dout)
        return grads + (None, None, None)


# --------------------------------------------------------------------------------------------------------------
# all-to-all (Ulysses) and all-gather, autograd-aware
# --------------------------------------------------------------------------------------------------------------


def _rank_major_chunks(a: int) -> List[int]:
    """Slot ``k`` of the rank-major layout (rank ``j``'s two chunks in slots ``2j, 2j+1``) holds global chunk
    ``perm[k]``: ``j`` and ``2a-1-j``."""
    return [j if k % 2 == 0 else 2 * a - 1 - j for j in range(a) for k in (0, 1)]


def _permute_chunks(src: torch.Tensor, dst: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``dst[i] = src[order[i]]`` along dim 0 by one contiguous block copy per chunk (host indices: an index
    tensor would have to be copied to the device, and a block copy is faster than an index_select)."""
    for i, j in enumerate(order):
        dst[i].copy_(src[j])
    return dst


def _pack_seq_to_head(xs: Sequence[torch.Tensor], a: int, chunk: int, chunks: int) -> torch.Tensor:
    """Send buffer ``[A, s_local, b, H, d]`` of head chunk ``chunk`` (of ``chunks``) of ``xs`` (``[b, n_i, s_local,
    d]`` zigzag shards): destination rank ``j`` gets its heads ``[j*n_i/A, (j+1)*n_i/A)``, of those the
    ``chunk``-th ``1/chunks``, of every tensor side by side (``H`` = their sum). One copy."""
    b, _, s, d = xs[0].shape
    hs = [x.shape[1] // (a * chunks) for x in xs]
    send = torch.empty(a, s, b, sum(hs), d, dtype=xs[0].dtype, device=xs[0].device)
    off = 0
    for x, h in zip(xs, hs):
        part = x.permute(2, 0, 1, 3).reshape(s, b, a, chunks, h, d)[:, :, :, chunk]
        send[:, :, :, off:off + h].copy_(part.permute(2, 0, 1, 3, 4))
        off += h
    return send


def _unpack_seq_to_head(recv: torch.Tensor, a: int, hs: Sequence[int]) -> List[torch.Tensor]:
    """Received ``[A, s_local, b, H, d]`` (source rank ``i``'s zigzag chunks ``i`` and ``2A-1-i``) -> per tensor
    ``[b, h_i, A*s_local, d]`` in sequence order: head slices of one contiguous ``[A*s_local, b, H, d]`` buffer
    (the model's ``[s, b, n, d]`` layout). One copy (the reorder)."""
    _, s, b, H, d = recv.shape
    c = s // 2
    perm = _rank_major_chunks(a)
    inverse = sorted(range(2 * a), key=perm.__getitem__)  # global chunk -> slot
    slots = recv.view(2 * a, c, b, H, d)
    full = _permute_chunks(slots, torch.empty(slots.shape, dtype=recv.dtype, device=recv.device), inverse)
    full = full.view(2 * a * c, b, H, d)
    outs, off = [], 0
    for h in hs:
        outs.append(full[:, :, off:off + h].permute(1, 2, 0, 3))
        off += h
    return outs


def _pack_head_to_seq(ys: Sequence[torch.Tensor], a: int) -> torch.Tensor:
    """Send buffer ``[2A, c, b, H, d]`` for the way back: ``ys`` (``[b, h_i, A*s_local, d]`` in sequence order)
    with rank ``j``'s chunks (``j``, ``2A-1-j``) in slots ``2j, 2j+1`` and every tensor's heads side by side."""
    b, _, S, d = ys[0].shape
    c, hs = S // (2 * a), [y.shape[1] for y in ys]
    send = torch.empty(2 * a, c, b, sum(hs), d, dtype=ys[0].dtype, device=ys[0].device)
    perm, off = _rank_major_chunks(a), 0
    for y, h in zip(ys, hs):
        _permute_chunks(y.permute(2, 0, 1, 3).reshape(2 * a, c, b, h, d), send[:, :, :, off:off + h], perm)
        off += h
    return send


def _unpack_head_to_seq(recv: torch.Tensor, a: int, hs: Sequence[int], outs: Sequence[torch.Tensor], chunk: int,
                        chunks: int) -> None:
    """Write received ``[2A, c, b, H, d]`` (from source rank ``i``: my tokens, its heads of chunk ``chunk``) into
    ``outs`` (``[s_local, b, n_i, d]`` buffers) at heads ``i*n_i/A + chunk*h_i + [0, h_i)``. One copy."""
    _, c, b, H, d = recv.shape
    r = recv.view(a, 2 * c, b, H, d)  # [source rank, my tokens, b, its heads, d]
    off = 0
    for out, h in zip(outs, hs):
        dst = out.view(2 * c, b, a, chunks, h, d)[:, :, :, chunk]
        dst.copy_(r[:, :, :, off:off + h].permute(1, 2, 0, 3, 4))
        off += h


#: Environment variable: the a2a path's head chunks (default 1). With ``n`` chunks, chunk ``i``'s attention runs
#: while chunk ``i+1``'s all-to-all arrives and chunk ``i-1``'s output leaves; the number of key/value heads must
#: divide by ``a2a size * n``.
A2A_CHUNKS_ENV = "LIGHTNING_MEGATRON_CP_A2A_CHUNKS"


def _a2a_chunks(nkv: int, a: int) -> int:
    raw = os.environ.get(A2A_CHUNKS_ENV, "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{A2A_CHUNKS_ENV}={raw!r} must be a positive integer")
    chunks = int(raw)
    if nkv % (a * chunks) != 0:
        raise ValueError(f"{A2A_CHUNKS_ENV}={chunks}: the key/value heads ({nkv}) must be divisible by the a2a size "
                         f"times the chunks ({a} * {chunks} = {a * chunks}); use a divisor of {nkv // a}")
    return chunks


def _start_all_to_all(send: torch.Tensor, group):
    """Start an all-to-all of ``send`` over ``group``; ``(work, recv)`` (wait on ``work`` before reading)."""
    recv = torch.empty_like(send)
    return dist.all_to_all_single(recv, send, group=group, async_op=True), recv


class _A2AAttention(torch.autograd.Function):
    """Ulysses attention: all-to-all from sequence- to head-sharding over ``a2a_group``, attention on whole
    sequences (a ring over ``ring_group`` for ``a2a+p2p``), all-to-all back; q, k and v travel in one all-to-all.

    The heads are processed in ``chunks`` pieces (:data:`A2A_CHUNKS_ENV`): every chunk's all-to-all is started
    up front, chunk ``i``'s attention waits only for its own, and its output starts back before chunk ``i+1``'s
    attention, so all transfers but the first and last overlap compute. Backward mirrors it.
    """

    @staticmethod
    def forward(ctx, q, k, v, a2a_group, ring_group, causal: bool, scale: float, chunks: int):
        a = dist.get_world_size(a2a_group)
        xs = (q, k, v)
        hs = [x.shape[1] // (a * chunks) for x in xs]
        started = [_start_all_to_all(_pack_seq_to_head(xs, a, i, chunks), a2a_group) for i in range(chunks)]
        saved, back, fused = [], [], False
        for work, recv in started:
            work.wait()
            qh, kh, vh = _unpack_seq_to_head(recv, a, hs)
            out_h, state, fused = _ring_forward(qh, kh, vh, ring_group, causal, scale)
            saved += state
            back.append(_start_all_to_all(_pack_head_to_seq([out_h], a), a2a_group))
        b, n, s, d = q.shape
        out = torch.empty(s, b, n, d, dtype=q.dtype, device=q.device)
        for i, (work, recv) in enumerate(back):
            work.wait()
            _unpack_head_to_seq(recv, a, hs[:1], [out], i, chunks)
        ctx.save_for_backward(*saved)
        ctx.a2a_group, ctx.ring_group, ctx.causal, ctx.scale = a2a_group, ring_group, causal, scale
        ctx.chunks, ctx.fused, ctx.shapes = chunks, fused, [x.shape for x in xs]
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, dout):
        a, chunks = dist.get_world_size(ctx.a2a_group), ctx.chunks
        per = len(ctx.saved_tensors) // chunks
        started = [_start_all_to_all(_pack_seq_to_head([dout], a, i, chunks), ctx.a2a_group) for i in range(chunks)]
        hs = [shape[1] // (a * chunks) for shape in ctx.shapes]
        back = []
        for i, (work, recv) in enumerate(started):
            work.wait()
            (dout_h,) = _unpack_seq_to_head(recv, a, hs[:1])
            state = ctx.saved_tensors[i * per:(i + 1) * per]
            grads = _ring_backward(state, ctx.fused, ctx.ring_group, ctx.causal, ctx.scale, dout_h)
            back.append(_start_all_to_all(_pack_head_to_seq(grads, a), ctx.a2a_group))
        outs = [torch.empty(sh[2], sh[0], sh[1], sh[3], dtype=dout.dtype, device=dout.device) for sh in ctx.shapes]
        for i, (work, recv) in enumerate(back):
            work.wait()
            _unpack_head_to_seq(recv, a, hs, outs, i, chunks)
        dq, dk, dv = (o.permute(1, 2, 0, 3) for o in outs)
        return dq, dk, dv, None, None, None, None, None


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
    chunks = _a2a_chunks(k.shape[1], dist.get_world_size(a2a_group))
    return _A2AAttention.apply(q, k, v, a2a_group, ring_group, causal, scale, chunks)
