"""All-to-all (Ulysses) context-parallel attention: sequence-sharded to head-sharded and back; the attention in
between may itself be a ring (a2a+p2p).

The all-to-alls are grouped point-to-point transfers (``batch_isend_irecv``: one NCCL group, as NCCL runs an
all-to-all) that receive every chunk straight into its place in sequence order and send the attention output's
chunks straight from the kernel's buffer, so a direction costs one copy (the head gather on the sending side,
or the head scatter on the receiving side) instead of three (pack, the all-to-all's own self-copy, reorder). The
rank's own share never travels: it is copied locally while the transfers run.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_megatron.parallel.context_parallel.ring import _ring_backward, _ring_forward, _wait
from lightning_megatron.parallel.context_parallel.sm_carveout import carveout_window

_TAG_A2A = 2  # the ring uses tags 0 and 1; NCCL ignores tags, gloo matches on them


def _word_view(t: torch.Tensor, ratio: int) -> bool:
    return (t.stride(-1) == 1 and t.shape[-1] % ratio == 0 and t.storage_offset() % ratio == 0
            and all(st % ratio == 0 for st in t.stride()[:-1]))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-dtype strided views, moved as 8-byte words where both layouts allow it (head
    dim contiguous and a multiple of the word): the strided copy kernel makes one access per element, and with
    2-byte bf16 elements that reaches a fraction of the memory bandwidth. Bit-exact (integer words)."""
    size = dst.element_size()
    if dst.dtype == src.dtype and size < 8 and _word_view(dst, 8 // size) and _word_view(src, 8 // size):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
    dst.copy_(src)


def _own_slots(slots: torch.Tensor, r: int, a: int) -> torch.Tensor:
    """View of slots ``r`` and ``2a-1-r`` of ``slots [2a, ...]`` (rank ``r``'s zigzag chunks), stride ``2a-1-2r``."""
    return slots[r:2 * a - r:2 * a - 1 - 2 * r]


def _exchange(ops: List[dist.P2POp]):
    return dist.batch_isend_irecv(ops) if ops else []


def _peer_ops(group, peer: int, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor],
              tag: int) -> List[dist.P2POp]:
    """Send ``send[i]`` to global rank ``peer`` and receive ``recv[i]`` from it, for one grouped exchange; the
    peer builds the mirror list, so the i-th transfers match (in order for NCCL, by tag ``tag + i`` for gloo)."""
    return ([dist.P2POp(dist.isend, t.contiguous(), peer, group, tag + i) for i, t in enumerate(send)]
            + [dist.P2POp(dist.irecv, t, peer, group, tag + i) for i, t in enumerate(recv)])


def _seq_to_head(xs: Sequence[torch.Tensor], group, while_in_flight: Optional[Callable[[], None]] = None,
                 sm_carveout: Optional[int] = None) -> List[torch.Tensor]:
    """All-to-all from sequence- to head-sharding over ``group`` (size ``A``, my rank ``r``).

    ``xs``: ``[b, n_i, s_local, d]`` zigzag shards (chunks ``r`` and ``2A-1-r``; any strides, e.g. the model's
    ``[s, b, n, d]`` activations). Returns per tensor ``[b, n_i/A, A*s_local, d]``: heads ``[r*n_i/A,
    (r+1)*n_i/A)`` over the whole sequence in order, head slices of one ``[S, b, sum n_i/A, d]`` buffer into
    which the peers' chunks are received directly. Per peer the heads it owns are gathered into one send buffer
    (one copy per tensor); my own heads are copied into place while the transfers run, then
    ``while_in_flight()`` (independent work to overlap, if given) inside a
    :func:`~lightning_megatron.parallel.context_parallel.sm_carveout.carveout_window` of ``sm_carveout``.
    """
    a, r = dist.get_world_size(group), dist.get_rank(group)
    b, _, s, d = xs[0].shape
    c = s // 2
    hs = [x.shape[1] // a for x in xs]
    H = sum(hs)
    full = torch.empty(2 * a, c, b, H, d, dtype=xs[0].dtype, device=xs[0].device)
    by_head = [x.permute(2, 0, 1, 3).unflatten(2, (a, h)) for x, h in zip(xs, hs)]  # [s_local, b, A, h, d] views
    peers = [j for j in range(a) if j != r]
    send = torch.empty(len(peers), s, b, H, d, dtype=xs[0].dtype, device=xs[0].device)
    ops = []
    for p, j in enumerate(peers):
        off = 0
        for x, h in zip(by_head, hs):
            _copy(send[p, :, :, off:off + h], x[:, :, j])
            off += h
        ops += _peer_ops(group, dist.get_global_rank(group, j), [send[p, :c], send[p, c:]],
                         [full[j], full[2 * a - 1 - j]], _TAG_A2A)
    reqs = _exchange(ops)
    mine, off = _own_slots(full, r, a), 0
    for x, h in zip(by_head, hs):
        _copy(mine[:, :, :, off:off + h], x[:, :, r].unflatten(0, (2, c)))
        off += h
    if while_in_flight is not None:
        with carveout_window(sm_carveout):  # its GEMMs leave SMs to the exchange
            while_in_flight()
    _wait(reqs)
    full = full.view(2 * a * c, b, H, d)
    outs, off = [], 0
    for h in hs:
        outs.append(full[:, :, off:off + h].permute(1, 2, 0, 3))
        off += h
    return outs


def _head_to_seq(ys: Sequence[torch.Tensor], group, while_in_flight: Optional[Callable[[], None]] = None,
                 sm_carveout: Optional[int] = None) -> List[torch.Tensor]:
    """All-to-all back from head- to sequence-sharding over ``group``: the inverse of :func:`_seq_to_head`.

    ``ys``: ``[b, h_i, S, d]`` (my heads over the whole sequence in order). Returns per tensor ``[b, A*h_i,
    s_local, d]`` for my zigzag chunks, a view of a ``[s_local, b, A*h_i, d]`` buffer (the model's layout).
    Each peer's two chunks are sent straight from ``ys`` (no copy when ``ys`` is sequence-major, as the fused
    kernels' outputs are); received heads are scattered into place (one copy), my own copied while they travel,
    then ``while_in_flight()`` runs (if given, in a carveout window of ``sm_carveout`` as in :func:`_seq_to_head`).
    """
    a, r = dist.get_world_size(group), dist.get_rank(group)
    b, _, S, d = ys[0].shape
    c = S // (2 * a)
    slots = [y.permute(2, 0, 1, 3).unflatten(0, (2 * a, c)) for y in ys]  # [2A, c, b, h, d] views
    peers = [j for j in range(a) if j != r]
    outs = [torch.empty(2, c, b, a, y.shape[1], d, dtype=y.dtype, device=y.device) for y in ys]
    recvs = [torch.empty(len(peers), 2, c, b, y.shape[1], d, dtype=y.dtype, device=y.device) for y in ys]
    ops = []
    for p, j in enumerate(peers):
        send = [sl[k] for sl in slots for k in (j, 2 * a - 1 - j)]
        recv = [rv[p, k] for rv in recvs for k in (0, 1)]
        ops += _peer_ops(group, dist.get_global_rank(group, j), send, recv, _TAG_A2A + 2)
    reqs = _exchange(ops)
    for out, sl in zip(outs, slots):
        _copy(out[:, :, :, r], _own_slots(sl, r, a))
    if while_in_flight is not None:
        with carveout_window(sm_carveout):  # its GEMMs leave SMs to the exchange
            while_in_flight()
    _wait(reqs)
    for out, rv in zip(outs, recvs):
        for p, j in enumerate(peers):
            _copy(out[:, :, :, j], rv[p])
    return [out.view(2 * c, b, -1, d).permute(1, 2, 0, 3) for out in outs]


class _A2AAttention(torch.autograd.Function):
    """Ulysses attention: all-to-all from sequence- to head-sharding over ``a2a_group`` (q, k and v in one
    exchange), attention on whole sequences (a ring over ``ring_group`` for ``a2a+p2p``), all-to-all back.
    Backward mirrors it: ``dout`` in, ``dq, dk, dv`` back in one exchange. Communicates over ``a2a_group``
    (and ``ring_group``).

    ``wgrad`` (a :class:`~lightning_megatron.parallel.deferred_wgrad.DeferredWgrad`, or ``None``): the layer's
    delayed weight-gradient GEMMs, whose weights follow as extra inputs. Backward runs the smallest while ``dout``
    travels and the rest while ``dq, dk, dv`` travel (GEMMs leaving ``sm_carveout`` SMs to the exchange), and
    returns them as those inputs' gradients. ``kernel``, ``compile_merge``: the attention's, see
    :func:`~lightning_megatron.parallel.context_parallel.ring._ring_forward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, a2a_group, ring_group, causal: bool, scale: float, kernel: str, compile_merge: bool,
                sm_carveout: Optional[int], documents, wgrad, *weights):
        qh, kh, vh = _seq_to_head((q, k, v), a2a_group)
        out_h, state, fused = _ring_forward(qh, kh, vh, ring_group, causal, scale, kernel, compile_merge, documents)
        (out,) = _head_to_seq([out_h], a2a_group)
        ctx.save_for_backward(*state)
        ctx.a2a_group, ctx.ring_group, ctx.causal, ctx.scale, ctx.fused = a2a_group, ring_group, causal, scale, fused
        ctx.kernel, ctx.sm_carveout, ctx.wgrad, ctx.documents = kernel, sm_carveout, wgrad, documents
        return out

    @staticmethod
    def backward(ctx, dout):
        wgrad = ctx.wgrad
        smallest = (lambda: wgrad.run(max_gemms=1)) if wgrad is not None else None
        (dout_h,) = _seq_to_head([dout], ctx.a2a_group, smallest, ctx.sm_carveout)
        grads = _ring_backward(ctx.saved_tensors, ctx.fused, ctx.ring_group, ctx.causal, ctx.scale, dout_h,
                               ctx.kernel, ctx.documents)
        dq, dk, dv = _head_to_seq(grads, ctx.a2a_group, wgrad.run if wgrad is not None else None, ctx.sm_carveout)
        weight_grads = wgrad.grads() if wgrad is not None else ()
        return (dq, dk, dv, None, None, None, None, None, None, None, None, None) + weight_grads


def _check_heads(nq: int, nkv: int, size: int, what: str) -> None:
    if nq % size != 0 or nkv % size != 0:
        raise ValueError(f"a2a context parallelism needs the number of query heads ({nq}) and key/value heads "
                         f"({nkv}) to be divisible by the {what} ({size})")


def _a2a_attention(q, k, v, a2a_group, ring_group, causal: bool, scale: float, kernel: str, compile_merge: bool,
                   sm_carveout: Optional[int], wgrad=None, documents=None) -> torch.Tensor:
    """``documents``: the packed sequences' ids as the ring over ``ring_group`` (or one rank) sees the
    head-sharded whole sequences (see :func:`_ring_forward`)."""
    weights = wgrad.weights if wgrad is not None else ()
    return _A2AAttention.apply(q, k, v, a2a_group, ring_group, causal, scale, kernel, compile_merge, sm_carveout,
                               documents, wgrad, *weights)
