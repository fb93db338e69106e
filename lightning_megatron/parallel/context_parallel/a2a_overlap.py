"""The a2a (Ulysses) exchanges split into a start and a finish, so the attention layer can compute its own
heads' projections while the peers' heads travel.

``start_seq_to_head`` sends each peer the projections of its heads at my tokens; ``finish_seq_to_head`` places
my own heads' projections (computed meanwhile) and returns my heads over the whole sequence. On the way back
``start_head_to_seq`` sends each peer my heads' attention output at its tokens and returns the part for my own
tokens (whose output-projection GEMM runs meanwhile); ``finish_head_to_seq`` returns the peers' heads at my
tokens. Backward mirrors each pair: the reverse exchange starts in the finish's backward and is waited for in the
start's backward, with the own-head work in between. A small empty tensor links a start to its finish in the
autograd graph; the buffers travel in an :class:`Exchange` object. Communicates over the a2a group.

With ``LIGHTNING_MEGATRON_CP_SM_CARVEOUT`` the GEMMs launched between an exchange's launch and its wait leave SMs
to it (:mod:`.sm_carveout`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_megatron.parallel.context_parallel.ring import _wait
from lightning_megatron.parallel.context_parallel.sm_carveout import CarveoutWindow, sm_carveout_from_env
from lightning_megatron.parallel.context_parallel.ulysses import _TAG_A2A, _copy, _exchange, _own_slots, _peer_ops


class Exchange:
    """One a2a exchange over ``group`` (size ``A`` >= 2, my rank ``r``) and its reverse in backward: the peers,
    their global ranks and the buffers and requests in flight between a start and its finish."""

    def __init__(self, group) -> None:
        self.group = group
        self.a, self.r = dist.get_world_size(group), dist.get_rank(group)
        if self.a < 2:
            raise ValueError(f"an overlapped a2a exchange needs an a2a group of 2 or more ranks, got {self.a}")
        self.peers = [j for j in range(self.a) if j != self.r]
        self.peer_ranks = [dist.get_global_rank(group, j) for j in self.peers]
        self.reqs: list = []
        self.buffers: List[torch.Tensor] = []
        self.window = CarveoutWindow(sm_carveout_from_env())

    def chunk_ops(self, p: int, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], tag: int) -> list:
        """Send ``send[i]`` to peer ``p`` (index into :attr:`peers`) and receive ``recv[i]`` from it."""
        return _peer_ops(self.group, self.peer_ranks[p], send, recv, tag)

    def launch(self, ops: list, buffers: List[torch.Tensor]) -> None:
        self.reqs, self.buffers = _exchange(ops), buffers
        self.window.open()  # the GEMMs launched until wait() leave SMs to the exchange

    def wait(self) -> List[torch.Tensor]:
        self.window.close()
        _wait(self.reqs)
        buffers, self.reqs, self.buffers = self.buffers, [], []
        return buffers


def _link(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


class _SeqToHeadStart(torch.autograd.Function):
    """Forward: send the peers their heads at my tokens. Backward: wait for my tokens' gradients of them."""

    @staticmethod
    def forward(ctx, ex: Exchange, n: int, *peer_parts):
        # peer_parts: for each peer (ex.peers order) n tensors [s_local, b, h_i, d] (its heads at my tokens)
        s, b, _, d = peer_parts[0].shape
        c, a = s // 2, ex.a
        fulls = [torch.empty(2 * a, c, b, t.shape[2], d, dtype=t.dtype, device=t.device) for t in peer_parts[:n]]
        ops = []
        for p, j in enumerate(ex.peers):
            mine = peer_parts[p * n:(p + 1) * n]
            send = [half for t in mine for half in (t[:c], t[c:])]
            recv = [slot for f in fulls for slot in (f[j], f[2 * a - 1 - j])]
            ops += ex.chunk_ops(p, send, recv, _TAG_A2A)
        ex.launch(ops, fulls)
        ctx.ex = ex
        return _link(peer_parts[0])

    @staticmethod
    def backward(ctx, _):
        grads = ctx.ex.wait()  # per tensor [peers, 2c, b, h, d]: my tokens' grads of the peers' heads
        return (None, None) + tuple(g[p] for p in range(len(ctx.ex.peers)) for g in grads)


class _SeqToHeadFinish(torch.autograd.Function):
    """Forward: place my own heads and wait for the peers'. Backward: send the peers' tokens' gradients back."""

    @staticmethod
    def forward(ctx, ex: Exchange, link, *own):
        # own: n tensors [s_local, b, h_i, d] (my heads at my tokens); returns [b, h_i, S, d] per tensor
        a, r = ex.a, ex.r
        s, b, _, d = own[0].shape
        c = s // 2
        fulls = ex.buffers  # being received into; my own slots are free to fill meanwhile
        for f, t in zip(fulls, own):
            _copy(_own_slots(f, r, a), t.unflatten(0, (2, c)))
        ex.wait()
        ctx.ex = ex
        return tuple(f.view(2 * a * c, b, f.shape[3], d).permute(1, 2, 0, 3) for f in fulls)

    @staticmethod
    def backward(ctx, *grads):
        ex = ctx.ex
        a, r = ex.a, ex.r
        gs = [g.permute(2, 0, 1, 3) for g in grads]  # [S, b, h, d]
        S, b, _, d = gs[0].shape
        c = S // (2 * a)
        slots = [g.unflatten(0, (2 * a, c)) for g in gs]
        recv = [torch.empty(len(ex.peers), 2 * c, b, g.shape[2], d, dtype=g.dtype, device=g.device) for g in gs]
        ops = []
        for p, j in enumerate(ex.peers):
            send = [sl[k] for sl in slots for k in (j, 2 * a - 1 - j)]
            back = [half for rv in recv for half in (rv[p, :c], rv[p, c:])]
            ops += ex.chunk_ops(p, send, back, _TAG_A2A)
        ex.launch(ops, recv)
        own = tuple(_own_slots(sl, r, a).reshape(2 * c, b, sl.shape[3], d) for sl in slots)
        return (None, _link(grads[0])) + own


def start_seq_to_head(ex: Exchange, peer_parts: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Start sending ``peer_parts[p]`` (tensors ``[s_local, b, h_i, d]``: peer ``ex.peers[p]``'s heads at my
    zigzag tokens) to the peers; returns the link to pass to :func:`finish_seq_to_head`."""
    flat = [t for part in peer_parts for t in part]
    return _SeqToHeadStart.apply(ex, len(peer_parts[0]), *flat)


def finish_seq_to_head(ex: Exchange, link: torch.Tensor, own: Sequence[torch.Tensor]
                       ) -> Tuple[torch.Tensor, ...]:
    """Wait for :func:`start_seq_to_head`'s transfers and place ``own`` (my heads at my tokens, ``[s_local, b,
    h_i, d]``): per tensor my heads over the whole sequence in order, ``[b, h_i, S, d]``."""
    return _SeqToHeadFinish.apply(ex, link, *own)


class _HeadToSeqStart(torch.autograd.Function):
    """Forward: send the peers my heads at their tokens, keep mine. Backward: wait, then place my own part."""

    @staticmethod
    def forward(ctx, ex: Exchange, y):
        # y [b, h, S, d] (my heads over the sequence) -> (my heads at my tokens [s_local, b, h, d], link)
        ys = y.permute(2, 0, 1, 3)
        S, b, h, d = ys.shape
        a, r, c = ex.a, ex.r, S // (2 * ex.a)
        slots = ys.unflatten(0, (2 * a, c))
        recv = torch.empty(len(ex.peers), 2 * c, b, h, d, dtype=y.dtype, device=y.device)
        ops = []
        for p, j in enumerate(ex.peers):
            ops += ex.chunk_ops(p, [slots[j], slots[2 * a - 1 - j]], [recv[p, :c], recv[p, c:]], _TAG_A2A)
        ex.launch(ops, [recv])
        own = torch.empty(2 * c, b, h, d, dtype=y.dtype, device=y.device)
        _copy(own.unflatten(0, (2, c)), _own_slots(slots, r, a))
        ctx.ex, ctx.shape = ex, (S, b, h, d)
        return own, _link(y)

    @staticmethod
    def backward(ctx, g_own, _):
        ex = ctx.ex
        a, r = ex.a, ex.r
        S, b, h, d = ctx.shape
        c = S // (2 * a)
        (full,) = ex.wait()
        _copy(_own_slots(full, r, a), g_own.unflatten(0, (2, c)))
        return None, full.view(S, b, h, d).permute(1, 2, 0, 3)


class _HeadToSeqFinish(torch.autograd.Function):
    """Forward: wait for the peers' heads at my tokens. Backward: send their gradients back."""

    @staticmethod
    def forward(ctx, ex: Exchange, link):
        (recv,) = ex.wait()
        ctx.ex = ex
        return recv

    @staticmethod
    def backward(ctx, g_recv):
        ex = ctx.ex
        a = ex.a
        _, s, b, h, d = g_recv.shape
        c = s // 2
        full = torch.empty(2 * a, c, b, h, d, dtype=g_recv.dtype, device=g_recv.device)
        ops = []
        for p, j in enumerate(ex.peers):
            ops += ex.chunk_ops(p, [g_recv[p, :c], g_recv[p, c:]], [full[j], full[2 * a - 1 - j]], _TAG_A2A)
        ex.launch(ops, [full])
        return None, _link(g_recv)


def start_head_to_seq(ex: Exchange, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Start sending each peer my heads' rows of ``y`` (``[b, h, S, d]``) at its tokens; returns ``(my heads at
    my zigzag tokens [s_local, b, h, d], link)``."""
    return _HeadToSeqStart.apply(ex, y)


def finish_head_to_seq(ex: Exchange, link: torch.Tensor) -> torch.Tensor:
    """Wait for :func:`start_head_to_seq`'s transfers: ``[peers, s_local, b, h, d]``, peer ``ex.peers[p]``'s heads
    at my zigzag tokens."""
    return _HeadToSeqFinish.apply(ex, link)
