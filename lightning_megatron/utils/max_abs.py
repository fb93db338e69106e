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

from typing import Dict, List, Sequence

import torch
from torch import Tensor

from lightning_megatron.utils.chunk_tables import ChunkTables, aligned, to_device

__all__ = ["MaxAbsPerTensor"]

try:   # the CUDA kernel; CPU-only installations use torch._foreach_norm
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the installation
    triton = None

#: elements each program of the kernel reads (in blocks of ``_BLOCK``)
_CHUNK = 16384
_BLOCK = 2048
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


if triton is not None:
    @triton.jit
    def _max_abs_kernel(addresses, numels, slots, chunk_tensor, chunk_start, out, DTYPE: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        """Program ``p``: chunk ``chunk_start[p]`` of tensor ``chunk_tensor[p]`` (``numels`` elements at
        ``addresses``, of ``DTYPE``); its largest ``|x|`` (NaN if any is NaN) atomically maxed into
        ``out[slots[tensor]]``: int32 holding fp32 bits, zeros to begin with. ``ALIGNED``: every tensor's address
        is a multiple of 16 bytes and its element count of 8 (:func:`~lightning_megatron.utils.chunk_tables.aligned`). The values are >= 0 or a positive NaN,
        whose bits order as integers as the values do (NaN above inf); Triton's float atomic max would drop a NaN."""
        p = tl.program_id(0)
        t = tl.load(chunk_tensor + p)
        start = tl.load(chunk_start + p)
        n = tl.load(numels + t)
        address = tl.load(addresses + t)
        if ALIGNED:   # every address a multiple of 16 bytes and every count of 8 elements: 16-byte loads
            start, n, address = tl.multiple_of(start, 16), tl.multiple_of(n, 8), tl.multiple_of(address, 16)
        base = address.to(tl.pointer_type(DTYPE))
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

    Holds the kernel's device tables (:class:`~lightning_megatron.utils.chunk_tables.ChunkTables`): per layout
    (device and element counts: which chunk belongs to which tensor) and per set of addresses (the last few); the
    output slots of each dtype's tensors are a table too."""

    def __init__(self) -> None:
        self._tables = ChunkTables(_CHUNK)
        self._slots: Dict[tuple, Tensor] = {}

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
            numels, chunk_tensor, chunk_start = self._tables.layout(device, [tensors[i].numel() for i in members])
            slots = self._slot_table(device, tuple(members))
            addresses = self._tables.addresses(device, [tensors[i].data_ptr() for i in members])
            _max_abs_kernel[(chunk_tensor.numel(),)](addresses, numels, slots, chunk_tensor, chunk_start, out,
                                                     DTYPE=_TRITON_DTYPES[dtype], CHUNK=self._tables.chunk, BLOCK=_BLOCK,
                                                     ALIGNED=aligned(tensors[i] for i in members))
        return out.view(torch.float32)

    def _slot_table(self, device: torch.device, slots: tuple) -> Tensor:
        """``slots`` (each tensor's output slot) as an int32 tensor on ``device``, kept per layout."""
        key = (device, slots)
        held = self._slots.get(key)
        if held is None:
            held = self._slots[key] = to_device(torch.tensor(slots, dtype=torch.int32), device)
        return held


def _kernel_applies(tensors: Sequence[Tensor]) -> bool:
    if triton is None or not tensors:
        return False
    device = tensors[0].device
    return device.type == "cuda" and all(t.device == device and t.dtype in _KERNEL_DTYPES and t.is_contiguous()
                                         and t.numel() > 0 for t in tensors)
