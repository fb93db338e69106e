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
from typing import Optional

import torch
import torch.distributed as dist

from lightning_megatron.parallel.config import (
    A2A_COMM_TYPES,
    CP_ATTENTION_KERNELS,
    CP_COMM_TYPES,
    check_cp_kernel_options,
)
from lightning_megatron.parallel.context_parallel.all_gather import _all_gather_attention
from lightning_megatron.parallel.context_parallel.kernels import block_kernel, use_fused_attention
from lightning_megatron.parallel.context_parallel.layout import (RingDocuments, split_batch, zigzag_gather,
                                                                 zigzag_positions, zigzag_split)
from lightning_megatron.parallel.context_parallel.ring import _RingAttention
from lightning_megatron.parallel.context_parallel.ulysses import _a2a_attention, _check_heads

__all__ = [
    "zigzag_split",
    "split_batch",
    "zigzag_gather",
    "zigzag_positions",
    "context_parallel_attention",
    "COMM_TYPES",
    "block_kernel",
    "use_fused_attention",
    "CP_ATTENTION_KERNELS",
]

COMM_TYPES = CP_COMM_TYPES


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                               comm_type: str = "p2p", causal: bool = True, scale: Optional[float] = None,
                               inner_group=None, outer_group=None, wgrad=None, attention_kernel: str = "auto",
                               compile_merge: bool = True, sm_carveout: Optional[int] = None,
                               document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of the local zigzag tokens against the whole (CP-sharded) sequence.

    ``q [b, n_q, s_local, d]``, ``k, v [b, n_kv, s_local, d]``, every rank of ``group`` holding chunks
    ``(r, 2cp-1-r)`` of the sequence (:func:`zigzag_split` along the sequence dim). Returns
    ``[b, n_q, s_local, d]``, the matching rows of full attention (causal by default) over the whole
    sequence. Differentiable with exact gradients for q, k and v. ``group=None`` or a group of size 1 is plain
    local attention. ``comm_type``: ``"p2p"``, ``"all_gather"``, ``"a2a"`` or ``"a2a+p2p"`` (the latter needs
    ``inner_group`` (a2a) and ``outer_group`` (ring) with ``inner_size * outer_size == cp``).

    ``wgrad``: the layer's delayed weight-gradient GEMMs
    (:class:`~lightning_megatron.parallel.deferred_wgrad.DeferredWgrad`), run during the backward all-to-alls so
    the transfers overlap compute; a2a and a2a+p2p only (the ring already overlaps its transfers).

    Kernel options (``ParallelConfig``'s ``cp_attention_kernel``, ``cp_compile_merge``, ``cp_sm_carveout``):
    ``attention_kernel`` is the ring's per-block kernel on CUDA fp16/bf16, one of :data:`CP_ATTENTION_KERNELS`
    (``"auto"``: cuDNN, flash where cuDNN refuses; CPU and float32 always take the math path; ``all_gather``
    uses SDPA's own choice); ``compile_merge`` compiles the ring's log-sum-exp merge on CUDA; ``sm_carveout`` is
    the number of SMs the delayed weight-gradient GEMMs leave to the a2a exchanges (None: 16 on CUDA; 0: none).

    ``document_ids`` ``[b, s_local]`` (int, the local zigzag chunks' ids, as :func:`split_batch` cuts them): packed
    sequences, a query sees only keys of its own document. They are all-gathered over ``group`` into sequence order
    (a small integer exchange per call) and every block (ring step, all-gather chunk, a2a's whole sequences) is
    masked with its query and key chunks' ids, so documents may cross chunk and rank borders. The blocks then take
    the math kernel (``attention_kernel`` is ignored; on CUDA the all_gather path uses SDPA with a boolean mask).
    """
    check_cp_kernel_options(attention_kernel, compile_merge, sm_carveout, prefix="")
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
    if wgrad is not None and (cp == 1 or comm_type not in A2A_COMM_TYPES):
        raise ValueError(f"delayed weight gradients (wgrad=...) are run by the a2a exchanges: comm_type must be "
                         f"'a2a' or 'a2a+p2p' with cp > 1, got comm_type={comm_type!r}, cp={cp}")

    global_ids = None
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, s_local):
            raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; expected [b, s_local] = "
                             f"{[b, s_local]} (this rank's zigzag chunks, as split_batch cuts them)")
        document_ids = document_ids.to(q.device)
        global_ids = zigzag_gather(document_ids, group, dim=1) if cp > 1 else document_ids

    def ring_documents(ring_size: int):
        return None if global_ids is None else RingDocuments(global_ids, ring_size)

    if cp == 1:
        return _RingAttention.apply(q, k, v, None, causal, scale, attention_kernel, compile_merge, ring_documents(1))
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, causal, scale, attention_kernel, compile_merge,
                                    ring_documents(cp))
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, group, causal, scale, global_ids)
    if comm_type == "a2a":
        _check_heads(nq, nkv, cp, "context-parallel size")
        return _a2a_attention(q, k, v, group, None, causal, scale, attention_kernel, compile_merge, sm_carveout, wgrad,
                              ring_documents(1))
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
    # after the inner a2a an inner group holds outer zigzag chunks o and 2*outer-1-o of the sequence
    return _a2a_attention(q, k, v, inner_group, outer_group if outer > 1 else None, causal, scale, attention_kernel,
                          compile_merge, sm_carveout, wgrad, ring_documents(outer))
