"""Analytic training FLOPs of a GPT model, Megatron-LM's way.

Our own implementation of the GPT (non-hybrid, non-MLA) path of Megatron-LM's
``megatron/training/training.py::num_floating_point_operations`` (``transformer_flops()``): count the
matrix multiplications only (norms, softmax, activations, rotary and the loss are left out), each GEMM
``[M, K] x [K, N]`` costing ``2*M*N*K`` FLOPs in forward and twice that in backward (input gradient and
weight gradient), so every GEMM is counted ``3 * 2 * M*N*K``.

Per token, with ``L`` layers, hidden ``h``, ``q = num_attention_heads * kv_channels``,
``kv = num_query_groups * kv_channels``, ``E = 3`` with SwiGLU else ``2``, sequence length ``s`` and the
padded vocabulary ``V``::

    6 * [ (h*(q + 2*kv) + q*h) * L                     # QKV and output projections
        + c * s * q * L                                # QK^T and softmax(QK^T) V
        + h * E * (f * L_dense + f_moe * k * L_moe + f_shared * L_moe)   # dense MLP / routed / shared experts
        + h * V ]                                      # output layer (logits)

with ``c = 1`` for ``causal=True`` (Megatron's current code: only the lower half of the ``s x s`` score
matrix is counted) and ``c = 2`` for ``causal=False`` (the full square: the convention of Megatron's README
MFU table and of our ``PEERS.md`` baselines).

Vocabulary: Megatron counts the logits over ``args.padded_vocab_size``. We use the vocabulary our
:class:`GPTModel` actually allocates at tp=1, ``pad_vocab_size(vocab_size, 1, make_vocab_size_divisible_by)``
(the next multiple of ``make_vocab_size_divisible_by``, 128 by default), so the count does not change with the
tensor-parallel size (Megatron's padding to ``make_vocab_size_divisible_by * tp`` would add a few columns at
larger tp). A config object that carries ``padded_vocab_size`` (Megatron's args) is taken at its word.

MoE fields are read with ``getattr`` (missing means dense): ``num_moe_experts``, ``moe_router_topk`` (default
2, Megatron's), ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``), ``moe_layer_freq`` (int ``N``: layer
``i`` is MoE when ``i % N == 0``; or a 0/1 list of length ``num_layers``; default 1 = every layer) and
``moe_shared_expert_intermediate_size`` (default 0). A MoE layer costs the ``k`` routed experts plus the
shared expert; the router GEMM (``h x num_experts``) is not counted, as in Megatron.
Not covered (as in Megatron's other paths): multi-token prediction, multi-latent attention, latent MoE,
gated attention output, Mamba/hybrid layers.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning_megatron.moe.config import moe_layer_pattern
from lightning_megatron.parallel.layout_rules import pad_vocab_size

__all__ = ["num_floating_point_operations", "flops_per_token", "padded_vocab_size", "moe_layer_pattern",
           "core_attention_flops_per_square", "same_document_pairs"]

# 3 GEMMs per weight (forward, input gradient, weight gradient) x 2 FLOPs per multiply-add.
_FWD_BWD = 3
_FMA = 2


def padded_vocab_size(config: Any) -> int:
    """The vocabulary the logits are counted over: the model's own tp=1 padding (see the module docstring)."""
    padded = getattr(config, "padded_vocab_size", None)
    if padded is not None:
        return int(padded)
    return pad_vocab_size(config.vocab_size, 1, getattr(config, "make_vocab_size_divisible_by", 128))


def _shape(config: Any):
    h = config.hidden_size
    n = config.num_attention_heads
    g = getattr(config, "num_query_groups", None) or n
    d = getattr(config, "kv_channels", None) or h // n
    f = getattr(config, "ffn_hidden_size", None) or 4 * h
    return h, n, g, d, f


def num_floating_point_operations(config: Any, batch_size: int, seq_length: Optional[int] = None,
                                  causal: bool = True) -> float:
    """Model FLOPs of one forward + backward pass of ``batch_size`` sequences of ``seq_length`` tokens.

    ``config`` is a :class:`~lightning_megatron.GPTConfig` or any object with its field names (plus the
    optional MoE fields). ``seq_length`` defaults to ``config.seq_length``. ``causal=True`` counts attention
    scores over half of the ``s x s`` square (Megatron's current ``num_floating_point_operations``),
    ``causal=False`` over the full square (Megatron README / ``PEERS.md``). Returns the total over the whole
    model, not a per-device share.
    """
    s = config.seq_length if seq_length is None else seq_length
    h, n, g, d, f = _shape(config)
    L = config.num_layers
    q = n * d            # query projection width
    kv = g * d           # key (= value) projection width
    E = 3 if getattr(config, "swiglu", False) else 2   # SwiGLU: [gate; up] is h x 2f, then f x h
    V = padded_vocab_size(config)

    pattern = moe_layer_pattern(config)
    L_moe = sum(pattern)
    L_dense = L - L_moe
    if L_moe:
        k = getattr(config, "moe_router_topk", None) or 2
        f_moe = getattr(config, "moe_ffn_hidden_size", None) or f
        f_shared = getattr(config, "moe_shared_expert_intermediate_size", None) or 0
    else:
        k, f_moe, f_shared = 0, 0, 0

    # multiply-adds per token, summed over the model (x _FWD_BWD x _FMA at the end)
    attn_proj = (h * (q + 2 * kv) + q * h) * L
    # QK^T and PV: each 2 * s * q per token for the full square; causal counts half of it
    core_attn = (1 if causal else 2) * s * q * L
    mlp = h * E * (f * L_dense + f_moe * k * L_moe + f_shared * L_moe)
    logits = h * V
    per_token = _FWD_BWD * _FMA * (attn_proj + core_attn + mlp + logits)
    return float(batch_size) * float(s) * float(per_token)


def flops_per_token(config: Any, causal: bool = True, seq_length: Optional[int] = None) -> float:
    """Training FLOPs per token (forward + backward) at ``seq_length`` (default ``config.seq_length``)."""
    s = config.seq_length if seq_length is None else seq_length
    return num_floating_point_operations(config, 1, s, causal) / s


def core_attention_flops_per_square(config: Any, causal: bool = True) -> float:
    """FLOPs :func:`num_floating_point_operations` counts for ``QK^T`` and ``softmax(QK^T) V`` per unit of
    ``s**2`` of one sequence (``6 * c * q * L``, ``c`` as above). A packed row of documents ``d`` attends only inside
    them (``document_ids``): its attention FLOPs are this times ``sum(len_d**2)`` instead of ``s**2``
    (:func:`same_document_pairs`)."""
    h, n, g, d, f = _shape(config)
    return float(_FWD_BWD * _FMA * (1 if causal else 2) * n * d * config.num_layers)


def same_document_pairs(document_ids: Any) -> Any:
    """``sum over rows and documents of len_d**2`` for ``document_ids`` ``[b, s]`` (a token's document is its id;
    a document need not be contiguous): a 0-dim tensor on their device, computed without a host sync (each token
    counts the tokens of its row with its id, by sorting)."""
    import torch

    ordered = document_ids.sort(dim=-1).values.contiguous()
    same = (torch.searchsorted(ordered, ordered, right=True) - torch.searchsorted(ordered, ordered))
    return same.sum()
