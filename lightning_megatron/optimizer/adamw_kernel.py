"""The AdamW update of many tensors in one Triton launch (CUDA): what :class:`~lightning_megatron.PrecisionAwareAdamW`
runs on a GPU when its tensors allow it.

The compiled update (``torch.compile`` of :func:`~lightning_megatron.optimizer.precision_aware_adamw.adamw_multi_update_`)
is one kernel per flat run of tensors. Where the gradients are separate allocations (a step whose bf16 gradients
stay where the backward left them) that is one kernel per parameter, and each kernel's start and tail cost time that
one launch over all of them does not. :class:`MultiTensorAdamW` is that one launch: each program updates one chunk
of one tensor, found through device tables (:class:`~lightning_megatron.utils.chunk_tables.ChunkTables`) of the
tensors' addresses, element counts and bias corrections, reading and writing 16 bytes at a time. It applies when every
tensor is contiguous, starts at a multiple of 16 bytes and holds a multiple of 8 elements
(:func:`~lightning_megatron.utils.chunk_tables.aligned`), on one CUDA device, in the dtypes below; otherwise the
optimizer runs the compiled update.

The arithmetic is :func:`~lightning_megatron.optimizer.precision_aware_adamw.adamw_update_`'s, in fp32, in the same
order: ``m += (1 - beta1) (g - m)`` (torch's ``lerp`` at weights below 0.5), ``v = beta2 v + (1 - beta2) g g``,
``p = p (1 - lr wd) - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)``, the bias corrections
computed by torch over the entries' step counts. Parameters are fp32 or bf16; gradients fp32, bf16 or fp16; moments
fp32 or bf16; with fp32 parameters, an optional compute copy (bf16 / fp16) written in the same pass; with bf16
parameters, an optional int16 remainder (:mod:`~lightning_megatron.optimizer.param_remainders`: the two hold the fp32
main parameter, read joined and written split). ``found_inf`` > 0 skips every program before it reads anything;
``grad_scale`` divides the gradients. No communication.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from lightning_megatron.utils.chunk_tables import ChunkTables, aligned

__all__ = ["MultiTensorAdamW"]

try:   # CPU-only installations run the update as torch operations
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the installation
    triton = None

#: elements per program, read in blocks of ``_BLOCK``
_CHUNK = 8192
_BLOCK = 1024
_NO_EXTRA, _COPY, _REMAINDER = 0, 1, 2

if triton is not None:
    @triton.jit
    def _adamw_kernel(addresses, numels, chunk_tensor, chunk_start, bias1, bias2_sqrt, lr_ptr, scale_ptr, found_ptr,
                      one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, PARAM: tl.constexpr,
                      GRAD: tl.constexpr, EXP_AVG: tl.constexpr, EXP_AVG_SQ: tl.constexpr, COPY: tl.constexpr,
                      EXTRA: tl.constexpr, SCALED: tl.constexpr, GUARDED: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr):
        """Program ``p``: chunk ``chunk_start[p]`` of entry ``chunk_tensor[p]``, whose five addresses (parameter,
        gradient, exp_avg, exp_avg_sq, copy or remainder) are row ``5 * entry`` of ``addresses``; ``bias1`` /
        ``bias2_sqrt``: per entry ``1 - beta1^step`` and ``sqrt(1 - beta2^step)``. ``PARAM`` is int16 when ``EXTRA``
        is the remainder (the bf16 high half read as bits)."""
        skip = False
        if GUARDED:
            skip = tl.load(found_ptr) > 0
        if not skip:
            p = tl.program_id(0)
            t = tl.load(chunk_tensor + p)
            start = tl.multiple_of(tl.load(chunk_start + p), 16)
            n = tl.multiple_of(tl.load(numels + t), 8)
            row = addresses + 5 * t
            param = tl.multiple_of(tl.load(row), 16).to(tl.pointer_type(PARAM))
            grad = tl.multiple_of(tl.load(row + 1), 16).to(tl.pointer_type(GRAD))
            exp_avg = tl.multiple_of(tl.load(row + 2), 16).to(tl.pointer_type(EXP_AVG))
            exp_avg_sq = tl.multiple_of(tl.load(row + 3), 16).to(tl.pointer_type(EXP_AVG_SQ))
            extra = tl.multiple_of(tl.load(row + 4), 16)
            lr = tl.load(lr_ptr)
            decay = 1.0 - lr * weight_decay
            step_size = lr / tl.load(bias1 + t)
            correction = tl.load(bias2_sqrt + t)
            scale = 1.0
            if SCALED:
                scale = tl.load(scale_ptr)
            for i in tl.range(0, CHUNK, BLOCK):
                o = start + i + tl.arange(0, BLOCK)
                mask = o < n
                g = tl.load(grad + o, mask=mask, other=0.0).to(tl.float32)
                if SCALED:
                    g = g / scale
                m = tl.load(exp_avg + o, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(exp_avg_sq + o, mask=mask, other=0.0).to(tl.float32)
                if EXTRA == 2:
                    high = tl.load(param + o, mask=mask, other=0).to(tl.int32)
                    low = tl.load(extra.to(tl.pointer_type(tl.int16)) + o, mask=mask, other=0).to(tl.int32)
                    old = (high * 65536 + low).to(tl.float32, bitcast=True)
                else:
                    old = tl.load(param + o, mask=mask, other=0.0).to(tl.float32)
                m = m + one_minus_beta1 * (g - m)
                v = v * beta2 + one_minus_beta2 * g * g
                new = old * decay - step_size * (m / (tl.sqrt_rn(v) / correction + eps))
                if EXTRA == 2:
                    bits = new.to(tl.int32, bitcast=True)
                    high = (bits + 32768) >> 16
                    tl.store(param + o, high.to(tl.int16), mask=mask)
                    tl.store(extra.to(tl.pointer_type(tl.int16)) + o, (bits - high * 65536).to(tl.int16), mask=mask)
                else:
                    tl.store(param + o, new.to(PARAM), mask=mask)
                    if EXTRA == 1:
                        tl.store(extra.to(tl.pointer_type(COPY)) + o, new.to(COPY), mask=mask)
                tl.store(exp_avg + o, m.to(EXP_AVG), mask=mask)
                tl.store(exp_avg_sq + o, v.to(EXP_AVG_SQ), mask=mask)

    _DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
               torch.int16: tl.int16}

_PARAMS = (torch.float32, torch.bfloat16)
_GRADS = (torch.float32, torch.bfloat16, torch.float16)
_MOMENTS = (torch.float32, torch.bfloat16)
_COPIES = (torch.bfloat16, torch.float16)


def _one_dtype(tensors: Sequence[Tensor], allowed: Sequence[torch.dtype]) -> Optional[torch.dtype]:
    """The one dtype of ``tensors`` if it is in ``allowed``, else None."""
    dtypes = {t.dtype for t in tensors}
    return next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in allowed else None


class MultiTensorAdamW:
    """AdamW over lists of tensors in one Triton launch (see the module docstring). :meth:`applies` says whether a
    set of lists can take it; calling it updates them in place. Holds its device tables between calls."""

    def __init__(self) -> None:
        self._tables = ChunkTables(_CHUNK)

    @staticmethod
    def applies(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                lr: object, param_copies: Optional[List[Tensor]] = None,
                remainders: Optional[List[Tensor]] = None) -> bool:
        """Whether the kernel takes these lists (one entry per tensor, matching shapes): Triton present, a 0-d
        learning-rate tensor, every tensor contiguous, non-empty, aligned (:func:`aligned`) and on one CUDA device,
        one dtype per list among those the module docstring names."""
        if triton is None or not params or not isinstance(lr, Tensor):
            return False
        extra = param_copies if param_copies is not None else remainders
        lists = [params, grads, exp_avgs, exp_avg_sqs] + ([extra] if extra is not None else [])
        everything = [t for column in lists for t in column]
        device = params[0].device
        if device.type != "cuda" or lr.device != device:
            return False
        if not all(t.device == device and t.is_contiguous() and t.numel() > 0 for t in everything):
            return False
        if remainders is not None and (param_copies is not None or _one_dtype(params, (torch.bfloat16,)) is None
                                       or _one_dtype(remainders, (torch.int16,)) is None):
            return False
        if param_copies is not None and (_one_dtype(params, (torch.float32,)) is None
                                         or _one_dtype(param_copies, _COPIES) is None):
            return False
        return (_one_dtype(params, _PARAMS) is not None and _one_dtype(grads, _GRADS) is not None
                and _one_dtype(exp_avgs, _MOMENTS) is not None and _one_dtype(exp_avg_sqs, _MOMENTS) is not None
                and aligned(everything))

    def __call__(self, params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                 steps: List[Tensor], lr: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                 grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                 param_copies: Optional[List[Tensor]] = None, remainders: Optional[List[Tensor]] = None) -> None:
        """One AdamW step of every entry, in place (``steps``: each entry's 0-d step count, already counted for this
        step; the other arguments as :func:`~lightning_megatron.optimizer.precision_aware_adamw.adamw_update_`'s).
        Call only where :meth:`applies`."""
        device = params[0].device
        extra = param_copies if param_copies is not None else remainders
        mode = _REMAINDER if remainders is not None else _COPY if param_copies is not None else _NO_EXTRA
        columns = [params, grads, exp_avgs, exp_avg_sqs, extra if extra is not None else params]
        numels, chunk_tensor, chunk_start = self._tables.layout(device, [t.numel() for t in params])
        addresses = self._tables.addresses(device, [column[i].data_ptr() for i in range(len(params))
                                                    for column in columns])
        counts = torch.stack(steps).float()
        bias1 = 1 - beta1 ** counts
        bias2_sqrt = (1 - beta2 ** counts).sqrt()
        _adamw_kernel[(chunk_tensor.numel(),)](
            addresses, numels, chunk_tensor, chunk_start, bias1, bias2_sqrt, lr,
            grad_scale if grad_scale is not None else lr, found_inf if found_inf is not None else lr,
            1 - beta1, beta2, 1 - beta2, eps, weight_decay,
            PARAM=tl.int16 if mode == _REMAINDER else _DTYPES[params[0].dtype], GRAD=_DTYPES[grads[0].dtype],
            EXP_AVG=_DTYPES[exp_avgs[0].dtype], EXP_AVG_SQ=_DTYPES[exp_avg_sqs[0].dtype],
            COPY=_DTYPES[param_copies[0].dtype] if param_copies is not None else tl.bfloat16, EXTRA=mode,
            SCALED=grad_scale is not None, GUARDED=found_inf is not None, CHUNK=_CHUNK, BLOCK=_BLOCK)
