"""The load-balanced (zigzag) layout of a context-parallel sequence: split, positions, gather."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


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


class RingDocuments:
    """The document ids of packed sequences as a ring of ``ring_size`` ranks sees them: ``global_ids`` ``[b, S]``
    in sequence order (all-gathered once per attention call), each ring rank holding the zigzag chunks ``r`` and
    ``2*ring_size-1-r`` of the sequence. :meth:`mask` gives the same-document mask of one block of the ring."""

    def __init__(self, global_ids: torch.Tensor, ring_size: int) -> None:
        self.global_ids, self.ring_size = global_ids, ring_size

    def local(self, rank: int) -> torch.Tensor:
        """``[b, S / ring_size]``: the ids of ring rank ``rank``'s tokens."""
        return zigzag_split(self.global_ids, self.ring_size, rank, 1)

    def mask(self, q_rank: int, k_rank: int, rows: slice, cols: slice) -> torch.Tensor:
        """``[b, sq, sk]`` bool: which of ring rank ``q_rank``'s query rows ``rows`` and ring rank ``k_rank``'s key
        columns ``cols`` are in the same document."""
        return self.local(q_rank)[:, rows].unsqueeze(-1) == self.local(k_rank)[:, cols].unsqueeze(-2)


#: the batch keys :func:`split_batch` cuts along the sequence
BATCH_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


def split_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """CP rank ``cp_rank``'s load-balanced part of a batch: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` and ``document_ids`` ``[b, s]`` are cut into ``2*cp_size`` chunks along ``s`` and the rank keeps chunks ``cp_rank``
    and ``2*cp_size-1-cp_rank`` (:func:`zigzag_split`); ``position_ids`` (made ``arange(s)`` when absent) keep the
    true positions for RoPE. Other keys pass unchanged; a new dict is returned. Communicates nothing."""
    split = dict(batch)
    if split.get("position_ids") is None:
        tokens = batch["tokens"]
        split["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    for key in BATCH_SEQUENCE_KEYS:
        if isinstance(split.get(key), torch.Tensor):
            split[key] = zigzag_split(split[key], cp_size, cp_rank, dim=1)
    return split
