"""All-to-all (Ulysses) context-parallel attention: sequence-sharded to head-sharded and back, q, k and v in one
all-to-all, optionally in pipelined head chunks; the attention in between may itself be a ring (a2a+p2p)."""
from __future__ import annotations

import os
from typing import List, Sequence

import torch
import torch.distributed as dist

from lightning_megatron.parallel.context_parallel.ring import _ring_backward, _ring_forward


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


def _check_heads(nq: int, nkv: int, size: int, what: str) -> None:
    if nq % size != 0 or nkv % size != 0:
        raise ValueError(f"a2a context parallelism needs the number of query heads ({nq}) and key/value heads "
                         f"({nkv}) to be divisible by the {what} ({size})")


def _a2a_attention(q, k, v, a2a_group, ring_group, causal: bool, scale: float) -> torch.Tensor:
    chunks = _a2a_chunks(k.shape[1], dist.get_world_size(a2a_group))
    return _A2AAttention.apply(q, k, v, a2a_group, ring_group, causal, scale, chunks)
