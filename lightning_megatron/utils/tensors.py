"""Tensor helpers every layer uses: this rank's part of a ``DTensor``, and the flat spans that a list of tensors forms
when they are views laid end to end in one storage (the contiguous parameter, gradient and optimizer-state buffers of
:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams` and :class:`~lightning_megatron.optimizer.PrecisionAwareAdamW`).

Work over many tensors (an optimizer update, a norm, a clip, a non-finite check, a data-parallel reduction) runs over
:func:`contiguous_spans` of them: a few flat tensors instead of one tensor per parameter, so a handful of kernels and a
host loop over spans, not parameters. Tensors that are not adjacent views (separate allocations, a gap, another dtype)
simply form spans of their own: the result is the same, only the number of tensors differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["local_tensor", "Span", "span_starts", "span_bounds", "contiguous_spans", "storage_order", "coalesce",
           "adjacent_runs", "flat_run"]


#: tensor types that are never a ``DTensor``
_PLAIN = (Tensor, torch.nn.Parameter)


def local_tensor(t: Optional[Tensor]) -> Optional[Tensor]:
    """This rank's part of ``t``: the local shard of a ``DTensor`` (FSDP's parameters, gradients and states), any other
    tensor (or None) as it is."""
    if t is None or type(t) in _PLAIN:   # the common case, without the import below
        return t
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Span:
    """A run of tensors of a list that are adjacent views of one storage: ``flat`` is a 1-D view of all their elements
    (``numel`` = the sum of theirs), covering list entries ``start`` to ``stop - 1``; ``sizes`` their element counts."""

    flat: Tensor
    start: int
    stop: int
    sizes: tuple


def _storage_key(t: Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.dtype, t.device)


def _flat_over(first: Tensor, numel: int) -> Tensor:
    """A 1-D view of ``numel`` elements of ``first``'s storage, starting at ``first``'s first element."""
    if numel == first.numel():
        return first.view(-1)
    return first.as_strided((numel,), (1,), first.storage_offset())


def span_starts(tensors: Sequence[Tensor]) -> List[int]:
    """The indices where :func:`contiguous_spans` starts a span (no views built)."""
    starts: List[int] = []
    previous = None   # (storage key, element offset where the previous tensor ends) when it is contiguous
    for i, t in enumerate(tensors):
        if t.is_contiguous():
            key, offset = _storage_key(t), t.storage_offset()
            if previous is None or previous != (key, offset):
                starts.append(i)
            previous = (key, offset + t.numel())
        else:
            starts.append(i)
            previous = None
    return starts


def span_bounds(tensors: Sequence[Tensor]) -> List[Tuple[int, int]]:
    """``[(start, stop), ...]``: the list ranges of :func:`contiguous_spans`, without building their flat views."""
    starts = span_starts(tensors)
    return list(zip(starts, starts[1:] + [len(tensors)]))


def contiguous_spans(tensors: Sequence[Tensor]) -> List[Span]:
    """The maximal runs of consecutive ``tensors`` that lie end to end in one storage (each contiguous, of one dtype
    and device, the next starting where the previous ends), as :class:`Span` s in list order. Every tensor is in
    exactly one span; a tensor on its own (or a non-contiguous one) is a span of one. No copy, no kernel."""
    return [Span(flat_run(tensors, a, b), a, b, tuple(t.numel() for t in tensors[a:b]))
            for a, b in span_bounds(tensors)]


def storage_order(tensors: Sequence[Tensor]) -> List[int]:
    """Indices of ``tensors`` ordered by storage (storages in the order they first appear in the list, each by element
    offset): the order in which views of flat buffers lie end to end. The same on every rank whose tensors have the
    same layout (it does not depend on addresses), so collectives issued in this order match across ranks."""
    first: dict = {}
    keys = []
    for i, t in enumerate(tensors):
        k = _storage_key(t)
        keys.append((first.setdefault(k, len(first)), t.storage_offset(), i))
    return [i for _, _, i in sorted(keys)]


def coalesce(tensors: Sequence[Tensor]) -> List[Tensor]:
    """The flat tensors covering exactly the elements of ``tensors`` (no copy): adjacent views merged, in
    :func:`storage_order`. For work that does not depend on which tensor an element belongs to (norms, scaling,
    finiteness, in-place reductions)."""
    return [s.flat for s in contiguous_spans([tensors[i] for i in storage_order(tensors)])]


def adjacent_runs(columns: Sequence[Sequence[Tensor]], cuts: Sequence[int] = ()) -> List[tuple]:
    """``[(start, stop), ...]``: the coarsest cut of ``range(n)`` over which, in every column (lists of ``n`` tensors
    that correspond entry by entry, e.g. parameters, gradients and moments), the tensors are adjacent views; ``cuts``:
    further indices where a run must start (e.g. where step counts differ)."""
    n = len(columns[0]) if columns else 0
    starts = set(cuts) | {0}
    for column in columns:
        starts.update(span_starts(column))
    bounds = sorted(s for s in starts if s < n) + [n]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b] if n else []


def flat_run(tensors: Sequence[Tensor], start: int, stop: int) -> Tensor:
    """``tensors[start:stop]`` (adjacent views, see :func:`adjacent_runs`) as one flat view; one tensor: flattened
    where that is a view, else as it is (elementwise work needs no flat shape)."""
    first = tensors[start]
    if stop == start + 1:
        return first.view(-1) if first.is_contiguous() else first
    return _flat_over(first, sum(t.numel() for t in tensors[start:stop]))
