"""Each tensor's largest absolute value, for many tensors in one pass: what the non-finite check reads of every
gradient (finite exactly when this value is; NaN where the tensor holds a NaN).

:class:`MaxAbsPerTensor` on CUDA is one Triton kernel per dtype over all the tensors of that dtype: each program
reads one chunk of one tensor (the tensor's address comes from a table on the device), keeps the chunk's largest
``|x|`` (NaN if any element is NaN) and folds it into that tensor's slot with an atomic max (over the value's bits
as an integer, which orders non-negative floats and NaN as the values: a float atomic max would drop a NaN).
``torch._foreach_norm`` with ``ord=inf`` computes the same values, more slowly on the benchmark model's gradients
(benchmarks/RESULTS.md). The tables (which chunk belongs to which tensor, and the tensors' addresses) are built on the
host and copied to the device once per layout and set of addresses; tensors whose addresses do not change between steps
(CUDA graph outputs, contiguous buffers) cost no copy after the first. Elsewhere (the CPU, other dtypes, non-contiguous
tensors) the values come from ``torch._foreach_norm``. No communication.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["MaxAbsPerTensor"]

try:   # the CUDA kernel; CPU-only installations use torch._foreach_norm
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the installation
    triton = None

#: elements each program of the kernel reads (in blocks of ``_BLOCK``)
_CHUNK = 16384
_BLOCK = 2048
#: warps per program
_NUM_WARPS = 4
#: address tables kept on the device (layouts whose addresses change every step need a new one each step)
_KEEP_TABLES = 8
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


if triton is not None:
    @triton.jit
    def _max_abs_kernel(addresses, numels, slots, chunk_tensor, chunk_start, out, DTYPE: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program ``p``: chunk ``chunk_start[p]`` of tensor ``chunk_tensor[p]`` (``numels`` elements at
        ``addresses``, of ``DTYPE``); its largest ``|x|`` (NaN if any is NaN) atomically maxed into
        ``out[slots[tensor]]``: int32 holding fp32 bits, zeros to begin with. The values are >= 0 or a positive NaN,
        whose bits order as integers as the values do (NaN above inf); Triton's float atomic max would drop a NaN."""
        p = tl.program_id(0)
        t = tl.load(chunk_tensor + p)
        start = tl.load(chunk_start + p)
        n = tl.load(numels + t)
        base = tl.load(addresses + t).to(tl.pointer_type(DTYPE))
        largest = tl.zeros((BLOCK,), dtype=tl.float32)
        nans = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in tl.range(0, CHUNK, BLOCK):
            offsets = start + i + tl.arange(0, BLOCK)
            x = tl.load(base + offsets, mask=offsets < n, other=0.0).to(tl.float32)
            nans += (x != x).to(tl.int32)
            largest = tl.maximum(largest, tl.abs(x))
        value = tl.max(largest, axis=0)
        value = tl.where(tl.sum(nans, axis=0) > 0, float("nan"), value)   # tl.maximum / tl.max may drop a NaN
        tl.atomic_max(out + tl.load(slots + t), value.to(tl.int32, bitcast=True))

    _TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class MaxAbsPerTensor:
    """:meth:`__call__`: ``[len(tensors)]`` fp32, each tensor's largest absolute value (NaN if it holds a NaN, inf if
    it holds an inf and no NaN), in the order given. On CUDA (contiguous fp32 / bf16 / fp16 tensors of one device,
    none empty) one Triton kernel per dtype; otherwise ``torch._foreach_norm(tensors, inf)``.

    Holds the kernel's device tables: per layout (device and element counts: which chunk belongs to which tensor, and
    which output slot each tensor has) and per set of addresses (the last :data:`_KEEP_TABLES`)."""

    def __init__(self) -> None:
        self._layouts: Dict[Tuple, Tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self._addresses: "OrderedDict[Tuple, Tensor]" = OrderedDict()

    def __call__(self, tensors: Sequence[Tensor]) -> Tensor:
        tensors = list(tensors)
        if not tensors:
            return torch.zeros(0)
        if not _kernel_applies(tensors):
            values = torch._foreach_norm(tensors, float("inf"))
            if len({v.dtype for v in values}) == 1:   # one stack and one cast, not a cast kernel per tensor
                return torch.stack(values).float()
            return torch.stack([v.float() for v in values])
        device = tensors[0].device
        out = torch.zeros(len(tensors), dtype=torch.int32, device=device)   # fp32 bits (the kernel's docstring)
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for dtype, members in by_dtype.items():
            numels, slots, chunk_tensor, chunk_start = self._layout(
                device, tuple(tensors[i].numel() for i in members), tuple(members))
            addresses = self._address_table(device, tuple(tensors[i].data_ptr() for i in members))
            _max_abs_kernel[(chunk_tensor.numel(),)](addresses, numels, slots, chunk_tensor, chunk_start, out,
                                                     DTYPE=_TRITON_DTYPES[dtype], CHUNK=_CHUNK, BLOCK=_BLOCK,
                                                     num_warps=_NUM_WARPS)
        return out.view(torch.float32)

    def _layout(self, device: torch.device, numels: Tuple[int, ...],
                slots: Tuple[int, ...]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(numels, slots, chunk_tensor, chunk_start)`` on ``device``: per tensor its element count and output slot,
        per chunk of :data:`_CHUNK` elements its tensor and first element."""
        key = (device, numels, slots)
        held = self._layouts.get(key)
        if held is None:
            sizes = torch.tensor(numels, dtype=torch.int64)
            chunks = (sizes + _CHUNK - 1) // _CHUNK
            tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), chunks)
            first = torch.cumsum(chunks, 0) - chunks
            start = (torch.arange(int(chunks.sum()), dtype=torch.int64) - first.repeat_interleave(chunks)) * _CHUNK
            held = tuple(_to_device(t, device) for t in (sizes, torch.tensor(slots, dtype=torch.int32), tensor, start))
            self._layouts[key] = held
        return held

    def _address_table(self, device: torch.device, addresses: Tuple[int, ...]) -> Tensor:
        key = (device, addresses)
        held = self._addresses.get(key)
        if held is None:
            held = _to_device(torch.tensor(addresses, dtype=torch.int64), device)
            self._addresses[key] = held
            while len(self._addresses) > _KEEP_TABLES:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(key)
        return held


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (on the CPU) on ``device``, through pinned memory without waiting for the device (a copy from pageable
    memory would wait for the work queued before it)."""
    return t.pin_memory().to(device, non_blocking=True)


def _kernel_applies(tensors: Sequence[Tensor]) -> bool:
    if triton is None or not tensors:
        return False
    device = tensors[0].device
    return device.type == "cuda" and all(t.device == device and t.dtype in _KERNEL_DTYPES and t.is_contiguous()
                                         and t.numel() > 0 for t in tensors)
