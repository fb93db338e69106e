"""Attention of one Q block against one K/V block, returning the log-sum-exp: fused cuDNN / flash kernels on
CUDA half types, a math path elsewhere; and its backward from the merged output and log-sum-exp."""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from lightning_megatron.parallel.config import CP_ATTENTION_KERNELS

_MASK_KINDS = ("full", "causal")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask (query i sees keys j <= i + sk - sq); top-left when sq == sk."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def _scores(q, k, mask_kind: str, scale: float, doc_mask=None) -> torch.Tensor:
    """Scaled scores ``[b, n_kv, n_q/n_kv, sq, sk]``, -inf where ``mask_kind`` or ``doc_mask`` (``[b, sq, sk]``
    bool, True = visible: packed sequences' same-document pairs) hides a key."""
    b, nq, sq, d = q.shape
    nkv, sk = k.shape[1], k.shape[2]
    qg = q.reshape(b, nkv, nq // nkv, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * scale
    if mask_kind == "causal":
        s = s.masked_fill(~_causal_mask(sq, sk, q.device), float("-inf"))
    elif mask_kind != "full":
        raise ValueError(f"mask_kind must be one of {_MASK_KINDS}, got {mask_kind!r}")
    if doc_mask is not None:
        s = s.masked_fill(~doc_mask[:, None, None], float("-inf"))
    return s


def block_kernel(q: torch.Tensor, mask_kind: str, sq: int, sk: int, kernel: str = "auto") -> str:
    """The kernel a ring block uses: ``"flash"`` / ``"cudnn"`` (fused, return the log-sum-exp) on CUDA in
    fp16/bf16 with head dim <= 256 and a mask the kernels express (none, or a square causal block: their causal
    mask is top-left aligned), else ``"math"``. ``kernel`` (one of
    :data:`~lightning_megatron.parallel.config.CP_ATTENTION_KERNELS`, ``ParallelConfig.cp_attention_kernel``)
    forces the fused choice, or ``"math"``; ``"auto"`` is cuDNN (flash once cuDNN has refused here)."""
    if kernel not in CP_ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {CP_ATTENTION_KERNELS}")
    fused_ok = (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
                and (mask_kind == "full" or sq == sk))
    if not fused_ok or kernel == "math":
        return "math"
    if kernel == "auto":
        return "flash" if _CUDNN_FAILED else "cudnn"
    return kernel


def use_fused_attention(q: torch.Tensor, mask_kind: str, sq: int, sk: int, kernel: str = "auto") -> bool:
    """Whether a block goes to a fused CUDA kernel (see :func:`block_kernel`)."""
    return block_kernel(q, mask_kind, sq, sk, kernel) != "math"


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the fused kernels take it: any strides (the model's ``[s, b, n, d]`` activations viewed as
    ``[b, n, s, d]`` are fine) as long as the head dim is contiguous. Both kernels take GQA K/V (fewer heads than
    ``q``) as they are, so nothing is repeated or copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_forward(q, k, v, causal: bool, scale: float):
    """Fused flash attention of one block: ``(out [b, n_q, sq, d] in q's dtype and layout, lse [b, n_q, sq]
    float32)``."""
    q, k, v = (_kernel_input(t) for t in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """Fused flash-attention backward of one block given the *final* merged ``out`` and ``lse`` (the kernel
    derives ``delta = rowsum(dout * out)`` itself). Returns ``(dq, dk, dv)`` with the heads of q, k and v."""
    q, k, v, dout, out = (_kernel_input(t) for t in (q, k, v, dout, out))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty,
        scale=scale)
    return dq, dk, dv


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    """Fused cuDNN attention of one block: ``(out [b, n_q, sq, d] in q's layout, lse [b, n_q, sq] float32)``."""
    q, k, v = (_kernel_input(t) for t in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    lse = res[1]
    return res[0], lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])  # cuDNN may add a trailing 1


def _cudnn_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """cuDNN attention backward of one block given the final merged ``out`` and ``lse``."""
    q, k, v, dout, out = (_kernel_input(t) for t in (q, k, v, dout, out))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.contiguous().unsqueeze(-1), empty, empty, None, None, None, q.shape[2], k.shape[2],
        0.0, causal, scale=scale)
    return dq, dk, dv


_FUSED = {"flash": (_flash_forward, _flash_backward), "cudnn": (_cudnn_forward, _cudnn_backward)}
#: Set once when cuDNN attention is unavailable here (old cuDNN, GPU or shape it rejects): "auto" then uses
#: flash for the rest of the process. A capability cache, not communication state.
_CUDNN_FAILED: List[bool] = []


def _run_fused(which: int, kernel: str, requested: str, *args):
    """Forward (``which=0``) or backward (1) through ``kernel``; when ``requested`` is ``"auto"`` a cuDNN failure
    falls back to flash. ``auto`` tries cuDNN first because it is the faster of the two at the benchmark model's
    shapes (benchmarks/RESULTS.md)."""
    if kernel == "cudnn" and requested == "auto":
        try:
            return _FUSED["cudnn"][which](*args)
        except RuntimeError:
            _CUDNN_FAILED.append(True)
            return _FUSED["flash"][which](*args)
    return _FUSED[kernel][which](*args)


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_kind: str,
                     scale: float, kernel: str = "auto", doc_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of one Q block against one K/V block: ``(out [b, n_q, sq, d], lse [b, n_q, sq])``.

    ``mask_kind``: ``"full"`` (no mask) or ``"causal"`` (bottom-right aligned; with ``sq == sk`` the usual
    lower triangle). GQA: ``n_q`` is a multiple of ``n_kv``. On CUDA in fp16/bf16 a fused kernel (cuDNN or
    flash, :func:`block_kernel` with ``kernel``) computes it without materialising the attention matrix (out in
    the input dtype, lse in float32); otherwise a math path (explicit softmax) in the inputs' dtype, or float32 for half types.
    Not for autograd: the ring has its own backward (:func:`_attention_block_backward`). ``doc_mask``
    ``[b, sq, sk]`` (packed sequences, True = same document): always the math path; a row that sees no key of the
    block gets output 0 and log-sum-exp -inf, which the ring's merge leaves out exactly.
    """
    if mask_kind not in _MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {_MASK_KINDS}, got {mask_kind!r}")
    use = block_kernel(q, mask_kind, q.shape[2], k.shape[2], kernel) if doc_mask is None else "math"
    if use != "math":
        return _run_fused(0, use, kernel, q, k, v, mask_kind == "causal", scale)
    return _math_attention_block(q, k, v, mask_kind, scale, doc_mask)


def _math_attention_block(q, k, v, mask_kind: str, scale: float, doc_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Math path of :func:`_attention_block`; differentiable by autograd."""
    cd = _compute_dtype(q.dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    b, nq, sq, d = q.shape
    s = _scores(q, k, mask_kind, scale, doc_mask)
    lse = torch.logsumexp(s, dim=-1)
    if doc_mask is None:
        p = torch.exp(s - lse.unsqueeze(-1))
    else:  # rows that see no key of this block: lse -inf, weights 0 (not NaN)
        p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return out.reshape(b, nq, sq, d), lse.reshape(b, nq, sq)


def _attention_output(q, k, v, mask_kind: str, scale: float, doc_mask=None) -> torch.Tensor:
    """Differentiable attention output only (the all_gather path). Fused SDPA on CUDA half types, where a
    causal block with ``sq < sk`` uses the bottom-right aligned causal bias; otherwise the math path. ``doc_mask``
    ``[b, sq, sk]`` (packed sequences; every query sees at least one key): SDPA with the combined boolean mask on
    CUDA half types, else the math path."""
    if doc_mask is not None:
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            sq, sk = q.shape[2], k.shape[2]
            mask = doc_mask & _causal_mask(sq, sk, q.device) if mask_kind == "causal" else doc_mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        return _math_attention_block(q, k, v, mask_kind, scale, doc_mask)[0].to(q.dtype)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        gqa = q.shape[1] != k.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        if mask_kind == "causal" and sq != sk:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), scale=scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask_kind == "causal", scale=scale, enable_gqa=gqa)
    return _math_attention_block(q, k, v, mask_kind, scale)[0].to(q.dtype)


def _attention_block_backward(q, k, v, dout, out, lse, delta, mask_kind: str, scale: float, kernel: str = "auto",
                              doc_mask=None):
    """Exact gradients of one block given the *final* (merged) ``out``, ``lse`` and ``delta = rowsum(dout * out)``.

    Flash-attention backward: ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - delta)``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``. Returns ``(dq, dk, dv)``: the fused CUDA kernel where
    :func:`block_kernel` with ``kernel`` picks one (``out`` in q's dtype), else the math path in the compute dtype
    (always with ``doc_mask``, see :func:`_attention_block`; ``lse`` is the merged one, finite in every row).
    """
    use = block_kernel(q, mask_kind, q.shape[2], k.shape[2], kernel) if doc_mask is None else "math"
    if use != "math":
        return _run_fused(1, use, kernel, q, k, v, dout.to(q.dtype), out, lse, mask_kind == "causal", scale)
    cd = _compute_dtype(q.dtype)
    q, k, v, dout = q.to(cd), k.to(cd), v.to(cd), dout.to(cd)
    b, nq, sq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    s = _scores(q, k, mask_kind, scale, doc_mask)
    p = torch.exp(s - lse.reshape(b, nkv, g, sq, 1))
    dog = dout.reshape(b, nkv, g, sq, d)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dog, v)
    ds = p * (dp - delta.reshape(b, nkv, g, sq, 1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k).reshape(b, nq, sq, d) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.reshape(b, nkv, g, sq, d)) * scale
    return dq, dk, dv
