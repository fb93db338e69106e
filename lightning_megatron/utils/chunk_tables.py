"""Device tables for Triton kernels that run over many tensors in one launch (the non-finite check's max-abs pass,
the optimizer's update): each program takes one chunk of one tensor, and finds which tensor, where in it, and the
tensor's addresses in tables on the device.

:class:`ChunkTables` builds them on the host and copies them to the device once per layout (the tensors' element
counts) and once per set of addresses, keeping the last few address tables: tensors whose addresses do not change
between steps (CUDA graph outputs, contiguous buffers) cost no copy after the first. No communication.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["ChunkTables", "aligned", "to_device"]


def aligned(tensors: Iterable[Tensor]) -> bool:
    """Whether every tensor starts at a multiple of 16 bytes and holds a multiple of 8 elements: a kernel that reads
    them from an address table may then load 16 bytes at a time (told so with ``tl.multiple_of``; a wrong promise is
    a misaligned access). Fresh allocations start at multiples of 512 bytes; views into a buffer may not."""
    return all(t.data_ptr() % 16 == 0 and t.numel() % 8 == 0 for t in tensors)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (on the CPU) on ``device``: for CUDA through pinned memory, without waiting for the device (a copy from
    pageable memory would wait for the work queued before it); ``t`` itself for the CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ChunkTables:
    """The tables of a multi-tensor kernel that splits every tensor into chunks of ``chunk`` elements.

    :meth:`layout`: per tensor its element count (int64), per chunk (one program each) its tensor (int32) and its first
    element (int64). :meth:`addresses`: the tensors' addresses (int64, in the order given; several per tensor when a
    kernel reads several tensors of each entry). ``keep``: address tables kept (the least recently used goes first)."""

    def __init__(self, chunk: int, keep: int = 8) -> None:
        self.chunk, self.keep = chunk, keep
        self._layouts: Dict[Tuple, Tuple[Tensor, Tensor, Tensor]] = {}
        self._addresses: "OrderedDict[Tuple, Tensor]" = OrderedDict()

    def layout(self, device: torch.device, numels: Sequence[int]) -> Tuple[Tensor, Tensor, Tensor]:
        """``(numels, chunk_tensor, chunk_start)`` on ``device`` for tensors of ``numels`` elements (none empty)."""
        key = (device, tuple(numels))
        held = self._layouts.get(key)
        if held is None:
            sizes = torch.tensor(key[1], dtype=torch.int64)
            chunks = (sizes + self.chunk - 1) // self.chunk
            tensor = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), chunks)
            first = torch.cumsum(chunks, 0) - chunks
            start = (torch.arange(int(chunks.sum()), dtype=torch.int64) - first.repeat_interleave(chunks)) * self.chunk
            held = tuple(to_device(t, device) for t in (sizes, tensor, start))
            self._layouts[key] = held
        return held

    def addresses(self, device: torch.device, addresses: Sequence[int]) -> Tensor:
        """``addresses`` as an int64 tensor on ``device`` (kept: the same addresses again cost no copy)."""
        key = (device, tuple(addresses))
        held = self._addresses.get(key)
        if held is None:
            held = to_device(torch.tensor(key[1], dtype=torch.int64), device)
            self._addresses[key] = held
            while len(self._addresses) > self.keep:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(key)
        return held
