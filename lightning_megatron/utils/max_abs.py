"""Each tensor's largest absolute value, for many tensors in one pass: what the non-finite check reads of every
gradient (finite exactly when this value is; NaN where the tensor holds a NaN).

:class:`MaxAbsPerTensor` on CUDA is one Triton kernel per dtype over all the tensors of that dtype: each program
reads one chunk of one tensor (the tensor's address comes from a table on the device) as integers, keeps the
chunk's largest ``|x|`` as the largest of the bits without the sign bit (which order as the absolute values do, NaN
above inf; no element is converted) and folds it into that tensor's slot with an atomic max over fp32 bits (a float
atomic max would drop a NaN).
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
    def _max_abs_kernel(addresses, numels, slots, chunk_tensor, chunk_start, out, BITS: tl.constexpr,
                        MAGNITUDE: tl.constexpr, KIND: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program ``p``: chunk ``chunk_start[p]`` of tensor ``chunk_tensor[p]`` (``numels`` elements at
        ``addresses``), read as integers of ``BITS`` (the float's width); its largest ``|x|`` atomically maxed into
        ``out[slots[tensor]]``: int32 holding fp32 bits, zeros to begin with.

        A float's bits without the sign bit (``& MAGNITUDE``) order as integers as the absolute values do, with inf
        above every finite value and every NaN above inf, so one integer maximum per element gives the largest
        ``|x|`` (a NaN if the chunk holds one) without converting any element. ``KIND`` turns the result into fp32
        bits: 0 fp32 (already), 1 bf16 (the upper half of an fp32), 2 fp16 (converted). Triton's float atomic max
        would drop a NaN; the integer one keeps it."""
        p = tl.program_id(0)
        t = tl.load(chunk_tensor + p)
        start = tl.load(chunk_start + p)
        n = tl.load(numels + t)
        base = tl.load(addresses + t).to(tl.pointer_type(BITS))
        largest = tl.zeros((BLOCK,), dtype=BITS)
        for i in tl.range(0, CHUNK, BLOCK):
            offsets = start + i + tl.arange(0, BLOCK)
            x = tl.load(base + offsets, mask=offsets < n, other=0)
            largest = tl.maximum(largest, x & MAGNITUDE)
        value = tl.max(largest, axis=0).to(tl.int32)
        if KIND == 1:
            value = value << 16
        elif KIND == 2:
            value = value.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
        tl.atomic_max(out + tl.load(slots + t), value)

    #: per float dtype: the integers its bits are read as, the mask that drops the sign bit, and ``KIND``
    _BITS = {torch.float32: (tl.int32, 0x7FFFFFFF, 0), torch.bfloat16: (tl.int16, 0x7FFF, 1),
             torch.float16: (tl.int16, 0x7FFF, 2)}


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
            bits, magnitude, kind = _BITS[dtype]
            _max_abs_kernel[(chunk_tensor.numel(),)](addresses, numels, slots, chunk_tensor, chunk_start, out,
                                                     BITS=bits, MAGNITUDE=magnitude, KIND=kind, CHUNK=_CHUNK,
                                                     BLOCK=_BLOCK, num_warps=_NUM_WARPS)
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
