"""Which kernel computes the causal self-attention of :class:`~lightning_megatron.models.gpt.SelfAttention`:
``GPTConfig.attention_backend``, Megatron's ``--attention-backend`` with its names.

=========== ====================================================================================================
``auto``    ``scaled_dot_product_attention`` as torch dispatches it (the default): torch picks the kernel by GPU,
            dtype, shapes and version (which one it picks for the benchmark model: ``benchmarks/RESULTS.md``).
``fused``   cuDNN's fused attention (Megatron's ``fused``: cuDNN through Transformer Engine) for CUDA fp16 / bf16
            inputs, ValueError where cuDNN does not take those; CPU and fp32 inputs, which no fused GPU kernel
            takes, get torch's choice (as ``cp_attention_kernel`` does for the context-parallel blocks).
``flash``   the flash kernel of ``scaled_dot_product_attention`` only.
``unfused`` ``scaled_dot_product_attention``'s math path: the explicit softmax (``local`` is the same here).
=========== ====================================================================================================

With ``fused`` cuDNN gets the keys and values of grouped-query attention as they are (fewer heads than the queries)
and the model's ``[s, b, n, d]`` activations viewed as ``[b, n, s, d]``, so nothing is repeated or copied; whether it
applies is decided from the inputs' device, dtype and shape only (no trial call), so it is the same when
``torch.compile`` traces it. cuDNN's backward did not repeat bit for bit between two runs of the same step on an
H200 (the GPU tier's CUDA-graph and recompute comparisons, which expect that, fail with ``fused`` forced on their tiny
models). On the CPU every backend computes what torch's CPU kernels do (``flash``: its CPU flash kernel, ``unfused``:
the math path); nothing here communicates.

Packed sequences (a batch's ``document_ids``, docs/data.md) take :func:`document_attention` whatever the backend:
FlexAttention with a document-causal block mask on CUDA in fp16 / bf16, else the exact boolean-mask SDPA.
"""
from __future__ import annotations

import logging
import warnings
import weakref
from contextlib import nullcontext
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_megatron.models.config import ATTENTION_BACKENDS

log = logging.getLogger(__name__)

__all__ = ["ATTENTION_BACKENDS", "CUDNN_MAX_HEAD_DIM", "cudnn_attention_accepts", "causal_attention",
           "document_causal_mask", "document_block_mask", "document_attention"]

#: the head dims ``fused`` runs cuDNN's fused attention for (a multiple of 8, at most this)
CUDNN_MAX_HEAD_DIM = 128

_SDPA_ONLY = {"flash": SDPBackend.FLASH_ATTENTION, "unfused": SDPBackend.MATH, "local": SDPBackend.MATH}


def cudnn_attention_accepts(q: Tensor, k: Tensor, dropout_p: float) -> bool:
    """Whether ``fused`` runs cuDNN's fused attention for ``q`` ``[b, n, s, d]`` and ``k`` ``[b, g, s, d]``: CUDA fp16 / bf16
    on a GPU of compute capability 8.0 or newer, head dims equal, a multiple of 8 and at most
    :data:`CUDNN_MAX_HEAD_DIM`, no attention dropout."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and dropout_p == 0.0):
        return False
    d = q.shape[-1]
    if d % 8 != 0 or d > CUDNN_MAX_HEAD_DIM or k.shape[-1] != d:
        return False
    # constant-folded by torch.compile: the choice is fixed when a compiled layer is traced
    return torch.cuda.get_device_properties(q.device).major >= 8


def _cudnn_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """cuDNN's fused causal attention (differentiable: torch's autograd formula calls its backward kernel)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    need_lse = q.requires_grad or k.requires_grad or v.requires_grad
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, need_lse, 0.0, True, False)[0]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, backend: str = "auto",
                     document_ids: Optional[Tensor] = None) -> Tensor:
    """Causal ``softmax(q k^T / sqrt(d)) v`` with attention dropout ``dropout_p``: ``q`` ``[b, n, s, d]``, ``k`` and
    ``v`` ``[b, g, s, d]`` (``g`` divides ``n``: grouped-query attention) -> ``[b, n, s, d]`` in ``q``'s dtype,
    computed by ``backend`` (see the module docstring). ``document_ids`` ``[b, s]`` (packed sequences): query ``i``
    sees key ``j`` only when ``j <= i`` and both have the same id (:func:`document_attention`)."""
    if document_ids is not None:
        return document_attention(q, k, v, document_ids, dropout_p)
    if backend == "fused" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if not cudnn_attention_accepts(q, k, dropout_p):
            raise ValueError(
                f"attention_backend='fused': cuDNN's fused attention needs a GPU of compute capability >= 8.0, a head "
                f"dim that is a multiple of 8 and <= {CUDNN_MAX_HEAD_DIM} and no attention dropout; got {q.dtype} on "
                f"{q.device}, head dim {q.shape[-1]}, dropout {dropout_p}. Use attention_backend='auto' (torch's "
                "choice) or 'flash'")
        return _cudnn_causal(q, k, v)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not one of {ATTENTION_BACKENDS}")
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(_SDPA_ONLY[backend]) if backend in _SDPA_ONLY else nullcontext():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)


def document_causal_mask(query_documents: Tensor, key_documents: Tensor, causal_offset: Optional[int] = 0) -> Tensor:
    """Boolean mask ``[b, 1, sq, sk]`` (True = attend) of packed sequences: query ``i`` sees key ``j`` when both
    have the same document id (``query_documents`` ``[b, sq]``, ``key_documents`` ``[b, sk]``) and, with
    ``causal_offset`` not None, ``j <= i + causal_offset`` (0: the usual lower triangle)."""
    mask = query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)
    if causal_offset is not None:
        sq, sk = query_documents.shape[-1], key_documents.shape[-1]
        i = torch.arange(sq, device=mask.device).unsqueeze(1)
        j = torch.arange(sk, device=mask.device).unsqueeze(0)
        mask = mask & (j <= i + causal_offset)
    return mask.unsqueeze(1)


#: FlexAttention compiled once on first eager CUDA use; ``False`` once compiling it failed here (the SDPA path is then
#: used): a capability cache, not an option
_FLEX: List = []


def document_block_mask(document_ids: Tensor) -> object:
    """FlexAttention's ``BlockMask`` of packed sequences for ``document_ids`` ``[b, s]``: query ``i`` sees key ``j``
    when ``j <= i`` and both have the same id; blocks of 128 x 128 with no visible pair are skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    b, s = docs.shape
    return create_block_mask(document_causal, b, None, s, s, device=docs.device)


#: the last eager :func:`document_block_mask`: ``(weak reference to its document ids, their version, the mask)``. Every
#: layer of a forward (and its recompute) gets the same ids tensor, so the mask is built once per micro-batch; an
#: in-place change of the ids bumps their version and builds it again. A cache of one entry, not an option.
_LAST_BLOCK_MASK: List = []


def _block_mask_of(document_ids: Tensor) -> object:
    """:func:`document_block_mask` of ``document_ids``, built once for the same unchanged tensor."""
    if _LAST_BLOCK_MASK:
        ref, version, mask = _LAST_BLOCK_MASK[0]
        if ref() is document_ids and version == document_ids._version:
            return mask
    mask = document_block_mask(document_ids)
    _LAST_BLOCK_MASK[:] = [(weakref.ref(document_ids), document_ids._version, mask)]
    return mask


def _flex_document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor) -> Tensor:
    """FlexAttention with :func:`document_block_mask`, so the work is that of the documents' own causal triangles
    (CUDA; compiled on first use, or traced as part of a compiled layer)."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = q.shape[1] != k.shape[1]
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=document_block_mask(document_ids), enable_gqa=gqa)
    block_mask = _block_mask_of(document_ids)
    if not _FLEX:
        log.info("packed sequences: compiling FlexAttention's document-causal kernel (first call)")
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0](q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _flex_applies(q: Tensor, dropout_p: float) -> bool:
    """Whether :func:`document_attention` takes FlexAttention: CUDA fp16 / bf16, no dropout, not failed here."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0 and _FLEX[:1] != [False]


def document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Causal attention of packed sequences: ``q`` ``[b, n, s, d]``, ``k``/``v`` ``[b, g, s, d]``, ``document_ids``
    ``[b, s]`` (int) -> ``[b, n, s, d]``; query ``i`` sees key ``j`` when ``j <= i`` and both have the same id.

    On CUDA in fp16 / bf16 without dropout: FlexAttention with a block mask (:func:`_flex_document_attention`), which
    skips the blocks that see no key, so the work falls with the documents' lengths. Elsewhere (CPU, float32 /
    float64, dropout): ``scaled_dot_product_attention`` with the boolean mask of :func:`document_causal_mask`, exact
    (a masked key's weight is exactly 0, so another document's values never reach a row). Communicates nothing."""
    if document_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; expected [b, s] = "
                         f"{[q.shape[0], q.shape[2]]} (one id per token of each row)")
    document_ids = document_ids.to(q.device)
    if _flex_applies(q, dropout_p):
        if torch.compiler.is_compiling():
            return _flex_document_attention(q, k, v, document_ids)
        try:
            return _flex_document_attention(q, k, v, document_ids)
        except Exception as e:  # noqa: BLE001 - no compiler / triton here: the exact SDPA path, once, loudly
            warnings.warn(f"packed sequences: FlexAttention failed ({type(e).__name__}: {e}); using "
                          "scaled_dot_product_attention with a boolean mask (no skipped blocks)")
            _FLEX[:] = [False]
    mask = document_causal_mask(document_ids, document_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])
