"""fp32 main parameters stored as their bf16 compute copy plus a 16-bit remainder (Megatron's
``--store-param-remainders``; Transformer Engine's ``FusedAdam(store_param_remainders=True)``).

An fp32 value's 32 bits are its bf16 rounding's 16 bits shifted up, plus a signed 16-bit remainder:
``bits(x) = bits16(high) * 2**16 + remainder`` with ``remainder`` in ``[-2**15, 2**15)``. The rounding that makes
every remainder fit is to nearest with ties away from zero (on the bits): ``high = (bits(x) + 2**15) >> 16``. It
equals torch's round-to-nearest-even everywhere but at exact ties (the low 16 bits ``0x8000``), where it takes the
neighbour away from zero. :func:`join_fp32` and :func:`split_fp32` are exact inverses over every finite value and
the infinities, so a parameter kept this way is the same fp32 main parameter bit for bit, for 2 bytes instead of 4
next to its bf16 copy.

Both are elementwise torch operations on bit views (``Tensor.view(dtype)``), so they run eagerly on the CPU and fuse
into the compiled optimizer update on CUDA. No communication.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = ["join_fp32", "split_fp32"]


def join_fp32(high: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 values (shape of ``high``) that bf16 ``high`` and int16 ``remainder`` (same shape, contiguous in the
    last dimension) hold (:func:`split_fp32`'s inverse)."""
    bits = high.view(torch.int16).to(torch.int32) * 65536 + remainder.to(torch.int32)
    return bits.view(torch.float32)


def split_fp32(x: Tensor) -> Tuple[Tensor, Tensor]:
    """fp32 ``x`` -> ``(high, remainder)``: ``x`` rounded to bf16 (to nearest, ties away from zero) and the int16
    remainder with ``join_fp32(high, remainder)`` equal to ``x`` bit for bit (NaN payloads aside)."""
    bits = x.view(torch.int32)
    high = torch.bitwise_right_shift(bits + 32768, 16)
    remainder = bits - high * 65536
    return high.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)
