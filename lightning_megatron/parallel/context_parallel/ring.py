"""Ring (p2p) context-parallel attention: K/V blocks travel round the CP group, partial results merge by
log-sum-exp; the backward ring runs the other way and ends with the own block."""
from __future__ import annotations

import logging
import warnings
from typing import List

import torch
import torch.distributed as dist

from lightning_megatron.parallel.context_parallel.kernels import (
    _attention_block,
    _attention_block_backward,
    _compute_dtype,
    use_fused_attention,
)

log = logging.getLogger(__name__)


def _merge_rows(o: torch.Tensor, l: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """``(o, l) <- merge((o, l), (blk_out, blk_lse))`` in place, in ``l``'s precision (float32 for half types).

    The two weights ``exp(l - new)`` and ``exp(blk_lse - new)`` sum to one, so the merge is a linear
    interpolation towards the block; ``o`` (float32 or the kernels' half type) is rounded once.
    """
    new_lse = torch.logaddexp(l, blk_lse.to(l.dtype))
    w = torch.exp(blk_lse - new_lse).unsqueeze(-1)
    o.copy_(torch.lerp(o.to(l.dtype), blk_out.to(l.dtype), w))
    l.copy_(new_lse)


#: The merge used on CUDA with ``compile_merge``, made on first use: :func:`_merge_rows` compiled into one fused
#: kernel (TE fuses its output correction the same way), or eager once compiling failed here. A capability cache,
#: no comm state and no option: whether to compile is the caller's ``compile_merge``.
_CUDA_MERGE: List = []


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, blk_out: torch.Tensor, blk_lse: torch.Tensor,
           compile_merge: bool) -> None:
    """Merge a partial result for ``rows`` into ``(out, lse)`` in place with the log-sum-exp rule. Eager, the
    merge is four or five passes over the block (casts, lerp, copy back); on CUDA with ``compile_merge``
    (``ParallelConfig.cp_compile_merge``) one compiled kernel reads ``out``, the block and the lse's and writes
    ``out`` once."""
    o, l = out[:, :, rows], lse[:, :, rows]
    if not o.is_cuda or not compile_merge:
        return _merge_rows(o, l, blk_out, blk_lse)
    if not _CUDA_MERGE:
        log.info("context parallel: compiling the ring's output merge (first call; cp_compile_merge=False keeps it "
                 "eager)")
        _CUDA_MERGE.append(torch.compile(_merge_rows, dynamic=False, fullgraph=True))
    try:
        return _CUDA_MERGE[0](o, l, blk_out, blk_lse)
    except Exception as e:  # noqa: BLE001 - no compiler/triton here: fall back to eager, once, loudly
        if _CUDA_MERGE[0] is _merge_rows:
            raise
        warnings.warn(f"context parallel: compiling the ring's output merge failed ({type(e).__name__}: {e}); "
                      "using eager ops (cp_compile_merge=False skips the attempt)")
        _CUDA_MERGE[0] = _merge_rows
        return _merge_rows(o, l, blk_out, blk_lse)


def _accumulator_dtype(q: torch.Tensor, cp: int, fused: bool) -> torch.dtype:
    """dtype of the ring's output / dq / dK,dV accumulators. Float32 in general; the kernels' own half type when
    they produce it and there is at most one addition (cp=2), where rounding the float32 sum once equals adding
    in the half type (the add is computed in float32 and rounded), so nothing is lost and two copies are saved."""
    return q.dtype if fused and cp <= 2 else _compute_dtype(q.dtype)


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


def _doc_mask(documents, q_rank: int, k_rank: int, rows: slice, cols: slice):
    return None if documents is None else documents.mask(q_rank, k_rank, rows, cols)


def _ring_forward(q, k, v, group, causal: bool, scale: float, kernel: str, compile_merge: bool, documents=None):
    """Ring attention forward over ``group`` (``None``: one rank). Returns ``(out in q's dtype, saved tensors for
    :func:`_ring_backward`, fused)``. See :class:`_RingAttention` for the schedule. ``kernel``: the block kernel
    (:func:`~lightning_megatron.parallel.context_parallel.kernels.block_kernel`); ``compile_merge``: see
    :func:`_merge`. ``documents`` (a :class:`~lightning_megatron.parallel.context_parallel.layout.RingDocuments` of
    this ring, or None): packed sequences, each block also masked to same-document pairs of its query and key
    chunks (math kernel)."""
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    c = q.shape[2] // 2
    fused = use_fused_attention(q, "full", 1, 1, kernel) and documents is None
    acc = _accumulator_dtype(q, cp, fused)
    if cp == 1:  # one block: nothing to merge (the a2a path and the single-rank reference)
        out, lse = _attention_block(q, k, v, "causal" if causal else "full", scale, kernel,
                                    _doc_mask(documents, 0, 0, slice(None), slice(None)))
        return out.to(q.dtype), (q, k, v, out, lse), fused
    kv = torch.stack([k, v])
    held = kv
    out = lse = None
    for step in range(cp):
        reqs = None
        if step + 1 < cp:  # start the next exchange before computing this block
            reqs, nxt_kv = _ring_shift(held, group, _TAG_KV)
        src = (rank - step) % cp
        rows, cols, mask = _block_plan(src, rank, causal, c)
        blk_out, blk_lse = _attention_block(q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols], mask, scale,
                                            kernel, _doc_mask(documents, rank, src, rows, cols))
        if step == 0:  # step 0 covers every row: start from it instead of merging into zeros / -inf
            out, lse = blk_out.to(acc), blk_lse.to(_compute_dtype(q.dtype))
        else:
            _merge(out, lse, rows, blk_out, blk_lse, compile_merge)
        if reqs is not None:
            _wait(reqs)
            held = nxt_kv
    out_q = out.to(q.dtype)
    return out_q, (q, kv, held, out_q if fused else out, lse), fused


def _ring_backward(saved, fused: bool, group, causal: bool, scale: float, dout, kernel: str, documents=None):
    """Gradients ``(dq, dk, dv)`` of :func:`_ring_forward` from its saved tensors and ``dout`` (``kernel``,
    ``documents``: those the forward used)."""
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
        dq, dk, dv = _attention_block_backward(q, k, v, dout, out, lse, delta, "causal" if causal else "full", scale,
                                               kernel, _doc_mask(documents, 0, 0, slice(None), slice(None)))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    acc = _accumulator_dtype(q, cp, fused)
    dq = dkv = None
    dkv_reqs = recv_dkv = None
    held = last  # block of rank + 1; step j holds the block of rank + 1 + j, the last step the own one
    for step in range(cp):
        reqs = None
        if step + 2 < cp:  # the block after next-but-last travels; the last one is the saved own block
            reqs, nxt_kv = _ring_shift(held, group, _TAG_KV, backwards=True)
        src = (rank + 1 + step) % cp
        rows, cols, mask = _block_plan(src, rank, causal, c)
        bdq, bdk, bdv = _attention_block_backward(q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols],
                                                  dout[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                                  None if delta is None else delta[:, :, rows], mask, scale, kernel,
                                                  _doc_mask(documents, rank, src, rows, cols))
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
    one contiguous ``[2, b, n_kv, s_local, d]`` buffer. ``kernel``, ``compile_merge`` and ``documents``: see
    :func:`_ring_forward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float, kernel: str, compile_merge: bool, documents=None):
        out, saved, fused = _ring_forward(q, k, v, group, causal, scale, kernel, compile_merge, documents)
        ctx.save_for_backward(*saved)
        ctx.group, ctx.causal, ctx.scale, ctx.fused, ctx.kernel = group, causal, scale, fused, kernel
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _ring_backward(ctx.saved_tensors, ctx.fused, ctx.group, ctx.causal, ctx.scale, dout, ctx.kernel,
                               ctx.documents)
        return grads + (None, None, None, None, None, None)
