"""A plain GPT / LLaMA decoder with no parallelism inside, in Megatron's module names and layout.

Activations are sequence-first ``[s, b, h]``. The model holds plain ``nn.Linear`` / ``nn.Embedding`` layers;
:func:`lightning_megatron.parallel.apply_tp` swaps them for tensor-parallel layers using
:meth:`GPTModel.tensor_parallel_plan`, and calls :meth:`GPTModel.set_tensor_parallel` so the few places that
need the TP group (loss, sequence-parallel norms and embedding scatter, dropout RNG) get it.

Initialisation is layout-independent: every parameter is drawn from its own generator seeded by the base
seed and the parameter's name, as a whole global tensor, then sliced to this rank's shard
(:meth:`GPTModel.init_weights`). So the same seed gives the same global weights under any tp/dp/ep layout
(experts: the full ``[E, ...]`` tensor is drawn and each rank keeps its experts by global expert index).

Mixture of experts: with ``config.num_moe_experts`` the MLP of every MoE layer (``moe_layer_freq``) is a
:class:`lightning_megatron.moe.MoELayer` (router, experts, optional shared expert), still named ``mlp``.
:meth:`GPTModel.set_expert_parallel` and :meth:`GPTModel.set_moe_token_groups` (called by the strategy) give
it its process groups.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_megatron.contract import RecomputeTarget
from lightning_megatron.models.attention import causal_attention, document_attention
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.kv_cache import KVCache, LayerKVCache
from lightning_megatron.models.swiglu import swiglu
from lightning_megatron.moe.layer import MoELayer
from lightning_megatron.moe.router import TopKRouter
from lightning_megatron.parallel.deferred_wgrad import DeferredWgrad
from lightning_megatron.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_megatron.parallel.layout_rules import pad_vocab_size
from lightning_megatron.parallel.tensor_parallel.layers import TensorParallelModule, pad_rows
from lightning_megatron.parallel.tensor_parallel.mappings import (
    Group,
    copy_to_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from lightning_megatron.parallel.tensor_parallel.plan import (
    ColumnParallelStyle,
    RowParallelStyle,
    SequenceParallelNormStyle,
    VocabParallelStyle,
)

RngFork = Callable[[], ContextManager]


def _null_fork() -> ContextManager:
    return contextlib.nullcontext()


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim.

    ``sequence_parallel_group`` (set by ``apply_tp`` under sequence parallelism): the weights are used
    through an identity whose backward all-reduces their gradients over that TP group, since each TP rank
    only saw its slice of the sequence.
    """

    def __init__(self, hidden_size: int, kind: str = "RMSNorm", eps: float = 1e-5) -> None:
        super().__init__()
        self.kind, self.eps, self.hidden_size = kind, eps, hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if kind == "LayerNorm" else None
        self.sequence_parallel_group: Group = None

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel_group is not None:
            w = copy_to_tensor_model_parallel_region(w, self.sequence_parallel_group)
            b = copy_to_tensor_model_parallel_region(b, self.sequence_parallel_group) if b is not None else None
        if self.kind == "RMSNorm":
            return rms_norm(x, w, self.eps)
        return F.layer_norm(x, (self.hidden_size,), w, b, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` ``[..., h]`` over its last dim, scaled by ``weight`` ``[h]``: ``F.rms_norm``."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotary_inv_freq(dim: int, base: float, dtype: torch.dtype, device: Optional[torch.device] = None,
                    scaling: Optional[GPTConfig] = None) -> Tensor:
    """RoPE inverse frequencies ``base^(-2i/dim)``, ``[dim/2]`` in ``dtype``.

    ``scaling``: a config with ``rope_scaling=True`` applies Llama-3.1's frequency-dependent scaling: wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``rope_scaling_factor``,
    shorter than ``original / high_freq_factor`` kept, and the band between interpolated smoothly.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=dtype) / dim))
    if scaling is None or not scaling.rope_scaling:
        return inv_freq
    factor, original = scaling.rope_scaling_factor, scaling.rope_scaling_original_max_position_embeddings
    low, high = scaling.rope_scaling_low_freq_factor, scaling.rope_scaling_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rotary_cos_sin(position_ids: Tensor, dim: int, base: float, dtype: torch.dtype,
                   scaling: Optional[GPTConfig] = None) -> tuple[Tensor, Tensor]:
    """RoPE tables for ``position_ids`` ``[s, b]``: ``cos, sin`` of shape ``[s, b, 1, dim]`` (halves layout) in
    ``dtype``, computed in float32 (float64 for a float64 ``dtype``). ``scaling``: see :func:`rotary_inv_freq`."""
    compute = torch.promote_types(dtype, torch.float32)
    inv_freq = rotary_inv_freq(dim, base, compute, position_ids.device, scaling)
    freqs = position_ids.to(compute).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[s, b, n, d]`` by RoPE (Megatron's non-interleaved "rotate half" convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SelfAttention(nn.Module):
    """Causal self-attention with GQA, computed by the kernel ``config.attention_backend`` names
    (:func:`~lightning_megatron.models.attention.causal_attention`: by default torch's own choice, which is cuDNN's
    fused attention for bf16 on an H200 with torch 2.11).

    ``linear_qkv`` packs queries, keys and values by query group, Megatron's layout: for each of the
    ``g`` groups, ``n/g`` query heads then one key and one value head, ``d`` channels each. A contiguous
    split of its output rows over TP is therefore a split over whole groups.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.heads_per_group = c.num_attention_heads // c.num_query_groups
        self.kv_channels = c.kv_channels
        self.rotary_base = c.rotary_base
        self.use_rope = c.position_embedding_type == "rope"
        self.attention_dropout = c.attention_dropout
        self.attention_backend = c.attention_backend
        qkv_out = c.num_query_groups * (self.heads_per_group + 2) * c.kv_channels
        self.linear_qkv = nn.Linear(c.hidden_size, qkv_out, bias=c.add_bias_linear)
        self.linear_proj = nn.Linear(c.num_attention_heads * c.kv_channels, c.hidden_size, bias=c.add_bias_linear)
        self.tp_fork: RngFork = _null_fork
        # Context parallel (set by the strategy): ``(q, k, v) -> out`` over the CP group, inputs
        # ``[b, n, s/cp, d]`` holding the load-balanced (zigzag) chunks of the sequence.
        self.context_parallel_attention: Optional[Callable[..., Tensor]] = None
        # Set by the strategy (delay_wgrad_compute): the CP attention runs the layer's delayed weight-gradient
        # GEMMs during its backward exchanges (it takes ``wgrad=``).
        self.delay_wgrad_compute = False

    def forward(self, x: Tensor, rotary: Optional[tuple[Tensor, Tensor]],
                wgrad: Optional[DeferredWgrad] = None, kv_cache: Optional[LayerKVCache] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        """``x``: ``[s(/tp under SP), b, h]`` -> same shape. ``wgrad``: delay ``linear_proj``'s weight gradient
        into it and hand it to the CP attention, which runs it (see :class:`DeferredWgrad`). ``kv_cache``: this
        layer's keys and values of the earlier positions (incremental decoding): ``x`` holds the positions that
        follow them, which attend to the cached ones and causally to each other; their keys and values are
        appended to the cache. ``document_ids``: ``[b, s]`` (this CP rank's tokens under CP), a token attends only
        to the earlier tokens of equal id (packed sequences; not with ``kv_cache``)."""
        q, k, v = self._split_heads(self.linear_qkv(x), rotary)
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids with a KV cache: generation runs one document per row; pass no "
                                 "document_ids")
            out = self.cached_attention(q, k, v, kv_cache)
        else:
            out = self.core_attention(q, k, v, wgrad, document_ids)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        return wgrad.linear(self.linear_proj, out) if wgrad is not None else self.linear_proj(out)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, wgrad: Optional[DeferredWgrad] = None,
                       document_ids: Optional[Tensor] = None) -> Tensor:
        """Causal ``softmax(q k^T / sqrt(d)) v`` with attention dropout (on the TP stream), over the CP group when
        set: ``q`` ``[b, n, s, d]``, ``k``/``v`` ``[b, g, s, d]`` -> ``[b, n, s, d]`` (Megatron's core attention:
        what selective recompute's ``"core_attn"`` recomputes). ``document_ids`` ``[b, s]``: also only within a
        document (:func:`~lightning_megatron.models.attention.document_attention`)."""
        dropout = self.attention_dropout if self.training else 0.0
        with self.tp_fork():
            if self.context_parallel_attention is not None:
                if dropout > 0.0:
                    raise NotImplementedError("attention_dropout > 0 is not supported with context parallelism yet")
                extra = {"wgrad": wgrad} if wgrad is not None else {}
                if document_ids is not None:
                    extra["document_ids"] = document_ids
                return self.context_parallel_attention(q, k, v, **extra)
            if document_ids is not None:
                return document_attention(q, k, v, document_ids, dropout)
            return causal_attention(q, k, v, dropout, self.attention_backend)

    def cached_attention(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: LayerKVCache) -> Tensor:
        """Attention of new positions ``q`` ``[b, n, s, d]`` (``k``/``v`` ``[b, g, s, d]``) to the cached ones and
        causally to each other (no dropout, no context parallelism): ``[b, n, s, d]``."""
        if self.context_parallel_attention is not None:
            raise ValueError("a KV cache (generation) is not supported with context parallelism (cp > 1): generate "
                             "under a layout with cp=1")
        past = kv_cache.length
        k, v = kv_cache.append(k, v)
        s = q.shape[2]
        mask = None
        if past > 0 and s > 1:   # new position i sees every cached position and new positions <= i
            mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0 and s > 1,
                                              enable_gqa=self.heads_per_group > 1)

    def _split_heads(self, qkv: Tensor, rotary: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """``linear_qkv``'s output ``[s, b, groups * (heads_per_group + 2) * d]`` (Megatron's per-group layout)
        -> ``q, k, v`` ``[s, b, heads, d]`` with RoPE applied to ``q`` and ``k``."""
        d, hpg = self.kv_channels, self.heads_per_group
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, -1, hpg + 2, d)
        q = qkv[:, :, :, :hpg].reshape(s, b, -1, d)
        k, v = qkv[:, :, :, hpg], qkv[:, :, :, hpg + 1]
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return q, k, v


class MLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``; SwiGLU packs ``[gate; up]`` in ``linear_fc1``
    (:func:`~lightning_megatron.models.swiglu.swiglu`, whose backward writes both halves' gradients in one pass).

    ``fc1_grad_amax``: None, or (SwiGLU only) a callable that SwiGLU's backward hands the largest absolute value of
    ``linear_fc1``'s output gradient, taken in the same pass (FP8's delayed recipe sets it to record that amax)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)
        self.fc1_grad_amax: Optional[Callable[[Tensor], None]] = None

    def forward(self, x: Tensor, wgrad: Optional[DeferredWgrad] = None) -> Tensor:
        """``wgrad``: delay both linears' weight gradients into it (see :class:`DeferredWgrad`)."""
        linear = wgrad.linear if wgrad is not None else (lambda module, t: module(t))
        h = linear(self.linear_fc1, x)
        if self.swiglu:
            h = swiglu(h, self.fc1_grad_amax)
        else:
            h = F.gelu(h)
        return linear(self.linear_fc2, h)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``; ``mlp`` is a
    :class:`MoELayer` when layer ``layer_number`` (global index) is a MoE layer of ``config``."""

    def __init__(self, config: GPTConfig, layer_number: int = 0) -> None:
        super().__init__()
        self.input_layernorm = Norm(config.hidden_size, config.normalization, config.norm_epsilon)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = Norm(config.hidden_size, config.normalization, config.norm_epsilon)
        if config.is_moe and config.is_moe_layer(layer_number):
            if config.add_bias_linear:
                raise ValueError("add_bias_linear=True is not supported with num_moe_experts (experts have no biases)")
            self.mlp = MoELayer(config.hidden_size, config.moe_config(), init_std=config.init_method_std)
        else:
            self.mlp = MLP(config)
        self.hidden_dropout = config.hidden_dropout
        self.hidden_fork: RngFork = _null_fork

    def _dropout(self, x: Tensor) -> Tensor:
        if self.hidden_dropout == 0.0 or not self.training:
            return x
        with self.hidden_fork():
            return F.dropout(x, self.hidden_dropout, True)

    def _deferred_wgrad(self) -> Optional[DeferredWgrad]:
        """With ``self_attention.delay_wgrad_compute`` and gradients on: a fresh :class:`DeferredWgrad` for
        ``linear_proj`` and the dense MLP's two linears (the CP attention's backward runs them)."""
        attention = self.self_attention
        if not (attention.delay_wgrad_compute and torch.is_grad_enabled()):
            return None
        linears = [self.self_attention.linear_proj]
        if isinstance(self.mlp, MLP):
            linears += [self.mlp.linear_fc1, self.mlp.linear_fc2]
        return DeferredWgrad(linears)

    def forward(self, x: Tensor, rotary: Optional[tuple[Tensor, Tensor]],
                kv_cache: Optional[LayerKVCache] = None, document_ids: Optional[Tensor] = None) -> Tensor:
        """``x`` ``[s(/tp under SP), b, h]`` -> same shape; ``kv_cache``, ``document_ids``: see
        :meth:`SelfAttention.forward`."""
        wgrad = self._deferred_wgrad()
        attention = (self.self_attention(self.input_layernorm(x), rotary, wgrad, document_ids=document_ids)
                     if kv_cache is None else self.self_attention(self.input_layernorm(x), rotary, kv_cache=kv_cache))
        x = x + self._dropout(attention)
        h = self.pre_mlp_layernorm(x)
        h = self.mlp(h, wgrad) if isinstance(self.mlp, MLP) else self.mlp(h)
        return x + self._dropout(h)


class Embedding(nn.Module):
    """Word (+ learned absolute position) embeddings, ``ids [s, b] -> [s(/tp under SP), b, h]``."""

    def __init__(self, config: GPTConfig, padded_vocab_size: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.scatter_group: Group = None  # set when SP needs a scatter after adding position embeddings

    def forward(self, ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        if self.scatter_group is not None:
            x = scatter_to_sequence_parallel_region(x, self.scatter_group)
        return x


class Decoder(nn.Module):
    """The layer stack (a ``ModuleDict`` keyed by global layer index, so names survive a pipeline split)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i) for i in range(config.num_layers)})
        self.final_layernorm = Norm(config.hidden_size, config.normalization, config.norm_epsilon)


class OutputLayer(nn.Module):
    """The LM head ``[s, b, h] -> [s, b, V_pad]``; holds no weight when tied to the word embeddings."""

    def __init__(self, hidden_size: int, padded_vocab_size: int, tied: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = hidden_size, padded_vocab_size
        self.weight = None if tied else nn.Parameter(torch.empty(padded_vocab_size, hidden_size))
        self.bias = None

    def forward(self, x: Tensor, weight: Optional[Tensor] = None) -> Tensor:
        return F.linear(x, self.weight if weight is None else weight)


VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
#: default position tensors (with their RoPE tables) a model keeps: one per shape, device and inference mode
KEPT_POSITIONS = 8
SCALED_INIT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight", "experts.weight2")


def _is_sharded_module(module: nn.Module) -> bool:
    """A module whose parameters are shards of larger global tensors (e.g. the experts of one EP rank)."""
    return hasattr(module, "global_shape") and hasattr(module, "shard_global")


def parameter_seed(seed: int, name: str) -> int:
    """Seed of parameter ``name``'s own generator: a function of the base seed and the name only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


class GPTModel(nn.Module):
    """GPT / LLaMA decoder. ``forward(tokens [b, s], position_ids [b, s] | None, labels [b, s] | None,
    document_ids [b, s] | None)`` (``document_ids``: packed sequences, attention stays inside each document).

    With ``labels`` returns the per-token loss ``[b, s]`` (float32; float64 in a float64 model); without, logits
    ``[b, s, V_pad/tp]`` (this rank's vocabulary slice under TP). Built on the meta device, it skips
    initialisation; call :meth:`init_weights` after materialising (the strategy does).
    """

    #: its layers can hand weight-gradient GEMMs to the CP attention's backward (``delay_wgrad_compute``)
    supports_delayed_wgrad = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config = config.resolved()   # plain ints in the layers: torch.compile guards on int subclasses
        self.config = config
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
        self.embedding = Embedding(config, self.padded_vocab_size)
        self.decoder = Decoder(config)
        tied = not config.untie_embeddings_and_output_weights
        self.output_layer = OutputLayer(config.hidden_size, self.padded_vocab_size, tied)
        self.tp_group: Group = None
        self.sequence_parallel = False
        self.embedding_fork: RngFork = _null_fork
        # the positions when none are given, and the RoPE tables of those positions: kept between steps (the same
        # tensors each step, so a layer's CUDA graph reads them where they are instead of copying them in)
        self._default_positions: Dict[tuple, Tensor] = {}
        self._rotary_tables: Dict[tuple, tuple] = {}
        if not self.embedding.word_embeddings.weight.is_meta:
            self.init_weights()

    # ---- tensor parallelism hooks ----
    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool) -> Dict[str, object]:
        """Name pattern -> TP style, for :func:`lightning_megatron.parallel.apply_tp`."""
        c = self.config
        padded = pad_vocab_size(c.vocab_size, tp, c.make_vocab_size_divisible_by)
        learned_pos = c.position_embedding_type == "learned_absolute"
        mlps = [layer.mlp for layer in self.decoder.layers.values()]
        plan: Dict[str, object] = {
            "embedding.word_embeddings": VocabParallelStyle(c.vocab_size, padded,
                                                            sequence_parallel and not learned_pos,
                                                            canonical_size=self.padded_vocab_size),
            "decoder.layers.*.self_attention.linear_qkv": ColumnParallelStyle(),
            "decoder.layers.*.self_attention.linear_proj": RowParallelStyle(),
            "output_layer": ColumnParallelStyle(vocab_size=c.vocab_size, padded_size=padded,
                                                tied=not c.untie_embeddings_and_output_weights,
                                                canonical_size=self.padded_vocab_size),
        }
        if any(isinstance(m, MLP) for m in mlps):
            plan["decoder.layers.*.mlp.linear_fc1"] = ColumnParallelStyle(stride=2 if c.swiglu else 1)
            plan["decoder.layers.*.mlp.linear_fc2"] = RowParallelStyle()
        if any(isinstance(m, MoELayer) and m.shared_experts is not None for m in mlps):
            # shared experts are split like the dense MLP; routed experts follow expert tensor parallelism
            plan["decoder.layers.*.mlp.shared_experts.linear_fc1"] = ColumnParallelStyle(stride=2 if c.swiglu else 1)
            plan["decoder.layers.*.mlp.shared_experts.linear_fc2"] = RowParallelStyle()
        if sequence_parallel:
            plan.update({
                "decoder.layers.*.input_layernorm": SequenceParallelNormStyle(),
                "decoder.layers.*.pre_mlp_layernorm": SequenceParallelNormStyle(),
                "decoder.final_layernorm": SequenceParallelNormStyle(),
            })
        return plan

    def set_context_parallel(self, attention_for_layer: Callable[[int], Callable[..., Tensor]],
                             delay_wgrad_for_layer: Optional[Callable[[int], bool]] = None) -> None:
        """Route every layer's core attention through ``attention_for_layer(global layer index)`` (CP). Layers
        where ``delay_wgrad_for_layer(index)`` is true delay their ``linear_proj`` / MLP weight gradients into that
        attention's backward (its callable must take ``wgrad=``: the a2a comm types)."""
        for key, layer in self.decoder.layers.items():
            attention = layer.self_attention
            attention.context_parallel_attention = attention_for_layer(int(key))
            attention.delay_wgrad_compute = bool(delay_wgrad_for_layer and delay_wgrad_for_layer(int(key)))

    def set_tensor_parallel(self, group: Group, sequence_parallel: bool,
                            tp_fork: Optional[RngFork] = None) -> None:
        """Record the TP group after ``apply_tp``: loss, embedding scatter and dropout streams use it.

        ``tp_fork``: context manager factory entering the per-TP-rank RNG stream (attention dropout always;
        hidden and embedding dropout under SP, where each rank holds different tokens).
        """
        self.tp_group, self.sequence_parallel = group, sequence_parallel
        fork = tp_fork or _null_fork
        if sequence_parallel and self.embedding.position_embeddings is not None:
            self.embedding.scatter_group = group
        self.embedding_fork = fork if sequence_parallel else _null_fork
        for layer in self.decoder.layers.values():
            layer.self_attention.tp_fork = fork
            layer.hidden_fork = fork if sequence_parallel else _null_fork
        for router in self._routers():
            # each TP rank routes its own part of the sequence: the replicated router weight's grad is summed
            router.sequence_parallel_group = group if sequence_parallel else None

    # ---- mixture of experts hooks
    def _routers(self) -> list:
        return [m for m in self.modules() if isinstance(m, TopKRouter)]

    def moe_layers(self) -> Dict[str, MoELayer]:
        """``{layer key: MoELayer}`` for the MoE layers this model (or pipeline stage) holds."""
        return {k: layer.mlp for k, layer in self.decoder.layers.items() if isinstance(layer.mlp, MoELayer)}

    def set_expert_parallel(self, ep_group: Group, etp_group: Group = None, ep_etp_group: Group = None) -> None:
        """Shard every MoE layer's experts over the expert-parallel groups (call on the meta device, before
        :meth:`init_weights`): EP rank ``r`` keeps experts ``[r*E/ep, (r+1)*E/ep)``, ETP ranks split their ffn dim.
        ``ep_etp_group``: the ep x etp block (all-gather dispatcher with etp > 1)."""
        for moe in self.moe_layers().values():
            moe.set_expert_parallel(ep_group, etp_group, ep_etp_group)

    def set_moe_token_groups(self, sequence_groups=(), batch_groups=()) -> None:
        """Where the rest of a micro-batch's tokens are, for the routers' global aux-loss statistics:
        ``sequence_groups`` hold other parts of the same sequences (cp; tp under SP), ``batch_groups`` other
        sequences (dp). See :meth:`lightning_megatron.moe.TopKRouter.set_token_groups`."""
        for router in self._routers():
            router.set_token_groups(sequence_groups, batch_groups)

    # ---- initialisation ----
    def _init_value(self, name: str, shape: tuple, seed: int, device: torch.device) -> Tensor:
        c = self.config
        if name.endswith("layernorm.weight"):
            return torch.ones(shape, device=device)
        if name.endswith(".bias"):
            return torch.zeros(shape, device=device)
        std = c.init_method_std
        if name.endswith(SCALED_INIT_SUFFIXES):
            std = std / math.sqrt(2.0 * c.num_layers)
        gen = torch.Generator(device=device)
        gen.manual_seed(parameter_seed(seed, name))
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    def tied_weight_readers(self) -> Dict[nn.Module, List[nn.Parameter]]:
        """``{output_layer: [word-embedding weight]}`` when the LM head is tied to the word embeddings and this
        (possibly pipeline-split) model holds both, else ``{}``: the head reads a weight the embedding owns."""
        head, embedding = self.output_layer, self.embedding
        if head is None or embedding is None or head.weight is not None:
            return {}
        return {head: [embedding.word_embeddings.weight]}

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """Initialise every parameter from ``seed`` (default ``torch.initial_seed()``), layout-independently.

        Megatron's scheme: normal(0, init_method_std) for weights, scaled by ``1/sqrt(2*num_layers)`` for the
        output projections (``linear_proj``, ``linear_fc2``, the experts' ``weight2``), ones for norm weights, zeros for biases and for
        padded vocabulary rows. Each parameter's global value is drawn whole and this rank keeps its shard.
        """
        seed = torch.initial_seed() if seed is None else seed
        for mod_name, module in self.named_modules():
            sharded = isinstance(module, TensorParallelModule) or _is_sharded_module(module)
            for pname, p in module.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                vocab = name in VOCAB_PARAMS
                if sharded:
                    shape = module.global_shape(pname)
                else:
                    shape = ((self.config.vocab_size,) + tuple(p.shape[1:])) if vocab else tuple(p.shape)
                full = self._init_value(name, shape, seed, p.device)
                if sharded:
                    local = module.shard_global(pname, full)
                else:
                    local = pad_rows(full, p.shape[0]) if vocab else full
                p.copy_(local.to(p.dtype))
        for router in self._routers():
            router.reset_buffers()

    # ---- forward, in pieces a pipeline stage can run separately ----
    def positions(self, tokens: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """Position ids ``[s, b]`` (``position_ids`` ``[b, s]`` transposed, or :meth:`default_positions`)."""
        if position_ids is not None:
            return position_ids.t()
        return self.default_positions(tokens.shape[1], tokens.shape[0], tokens.device)

    def default_positions(self, s: int, b: int, device: torch.device) -> Tensor:
        """``arange(s)`` expanded to ``[s, b]``, the positions when none are given: the same tensor for the same shape,
        device and inference mode (kept for the last few), so :meth:`rotary` keeps its tables for it too."""
        key = (s, b, device, torch.is_inference_mode_enabled())
        held = self._default_positions.get(key)
        if held is None:
            if len(self._default_positions) >= KEPT_POSITIONS:
                self._default_positions.clear()
                self._rotary_tables.clear()
            held = self._default_positions[key] = torch.arange(s, device=device).unsqueeze(1).expand(s, b)
        return held

    def embed(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """``tokens [b, s]`` -> hidden ``[s(/tp under SP), b, h]`` (with embedding dropout)."""
        x = self.embedding(tokens.t(), pos)
        if self.config.hidden_dropout > 0.0 and self.training:
            with self.embedding_fork():
                x = F.dropout(x, self.config.hidden_dropout, True)
        return x

    def rotary(self, pos: Tensor, like: Tensor) -> Optional[tuple[Tensor, Tensor]]:
        """RoPE tables for positions ``pos [s, b]`` in the compute dtype of ``like`` (None without RoPE). For
        :meth:`default_positions` they are computed once per dtype and kept with them."""
        c = self.config
        if c.position_embedding_type != "rope":
            return None
        dev = like.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else like.dtype
        default = None if torch.compiler.is_compiling() else next(
            (key for key, held in self._default_positions.items() if held is pos), None)
        if default is not None and (default, dtype) in self._rotary_tables:
            return self._rotary_tables[(default, dtype)]
        tables = rotary_cos_sin(pos, c.kv_channels, c.rotary_base, dtype, c if c.rope_scaling else None)
        if default is not None:
            # kept with the default positions; at a fixed address, which compiled layers (and their CUDA graphs) take
            # as it is, like a parameter
            for table in tables:
                torch._dynamo.mark_static_address(table)
            self._rotary_tables[(default, dtype)] = tables
        return tables

    def layer_keys(self) -> List[str]:
        """Keys (global indices) of the transformer layers this model (or pipeline rank) holds, in order."""
        return list(self.decoder.layers.keys())

    def run_layers(self, keys: Sequence[str], x: Tensor, rotary: Optional[tuple[Tensor, Tensor]],
                   document_ids: Optional[Tensor] = None) -> Tensor:
        """Run the consecutive layers ``keys`` in order on hidden ``x`` ``[s(/tp), b, h]`` -> same shape. The whole
        model and each pipeline stage run their layers through here (full activation recompute groups them).
        ``document_ids`` ``[b, s]`` (packed sequences): attention stays inside each document."""
        for key in keys:
            if document_ids is None:
                x = self.decoder.layers[key](x, rotary)
            else:
                x = self.decoder.layers[key](x, rotary, document_ids=document_ids)
        return x

    def run_layers_cached(self, keys: Sequence[str], x: Tensor, rotary: Optional[tuple[Tensor, Tensor]],
                          kv_cache: KVCache) -> Tensor:
        """:meth:`run_layers` for incremental decoding: each layer attends to its keys and values in ``kv_cache``
        and appends the new ones (inference only: activation recompute does not apply)."""
        for key in keys:
            x = self.decoder.layers[key](x, rotary, kv_cache=kv_cache.layer(key))
        return x

    def recompute_targets(self, name: str) -> List[RecomputeTarget]:
        """The calls one of Megatron's ``recompute_modules`` names covers here (see
        :mod:`lightning_megatron.parallel.recompute`): ``core_attn`` each attention's ``core_attention``,
        ``layernorm`` both norms of every layer, ``mlp`` the dense MLPs, ``moe`` the MoE layers,
        ``shared_experts`` their shared experts, ``moe_act`` the experts' activation; ``[]`` for any other name.
        The pre-MLP norm of an MoE layer feeds the router, the dispatcher and the shared experts (not a single
        consumer)."""
        layers = list(self.decoder.layers.values())
        moe = [layer.mlp for layer in layers if isinstance(layer.mlp, MoELayer)]
        if name == "core_attn":
            return [RecomputeTarget(layer.self_attention, "core_attention") for layer in layers]
        if name == "layernorm":
            return [target for layer in layers for target in (
                RecomputeTarget(layer.input_layernorm, "forward", single_consumer=True),
                RecomputeTarget(layer.pre_mlp_layernorm, "forward", single_consumer=isinstance(layer.mlp, MLP)))]
        if name == "mlp":
            return [RecomputeTarget(layer.mlp, "forward") for layer in layers if isinstance(layer.mlp, MLP)]
        if name == "moe":
            return [RecomputeTarget(m, "forward") for m in moe]
        if name == "shared_experts":
            return [RecomputeTarget(m.shared_experts, "forward") for m in moe if m.shared_experts is not None]
        if name == "moe_act":
            return [RecomputeTarget(m.experts, "activation", single_consumer=True) for m in moe]
        return []

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head: hidden ``[s(/tp), b, h]`` -> logits ``[s, b, V_pad/tp]``."""
        x = self.decoder.final_layernorm(x)
        shared = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        return self.output_layer(x, weight=shared)

    def per_token_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Cross-entropy of logits ``[s, b, V_pad/tp]`` against ``labels [b, s]``: ``[b, s]`` in float32 (float64
        for float64 logits)."""
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.config.vocab_size).t()

    def logits(self, tokens: Tensor, position_ids: Optional[Tensor] = None,
               kv_cache: Optional[KVCache] = None, document_ids: Optional[Tensor] = None) -> Tensor:
        """``tokens [b, s]`` (and ``position_ids [b, s]``) -> logits ``[s, b, V_pad/tp]``. ``kv_cache``: the
        tokens follow the positions cached there (see :meth:`run_layers_cached`). ``document_ids [b, s]``: packed
        sequences, a token attends only to the earlier tokens of its own document (see :meth:`run_layers`)."""
        pos = self.positions(tokens, position_ids)
        x = self.embed(tokens, pos)
        rotary = self.rotary(pos, x)
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids with a KV cache: generation runs one document per row")
            x = self.run_layers_cached(self.layer_keys(), x, rotary, kv_cache)
        elif document_ids is not None:
            x = self.run_layers(self.layer_keys(), x, rotary, document_ids.to(tokens.device))
        else:
            x = self.run_layers(self.layer_keys(), x, rotary)
        return self.head(x)

    def forward(self, tokens: Tensor, position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        logits = self.logits(tokens, position_ids, document_ids=document_ids)  # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1)
        return self.per_token_loss(logits, labels)
