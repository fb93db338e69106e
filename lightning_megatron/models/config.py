"""``GPTConfig``: the model's shape, with Megatron-LM's field names, and published presets."""
from __future__ import annotations

import functools
import numbers
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, List, Optional, Union

from lightning_megatron.utils.keywords import check_keywords
from lightning_megatron.moe.config import MoEConfig, moe_layer_pattern

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
#: fields filled in from others when not given (``None``): recomputed by ``replace`` unless given there
DERIVED_FIELDS = ("num_query_groups", "ffn_hidden_size", "kv_channels", "max_position_embeddings",
                  "moe_ffn_hidden_size")


class _Derived(int):
    """An int that ``GPTConfig`` filled in itself (a derived size). It behaves as the int it is; only
    ``replace`` (ours or ``dataclasses.replace``) tells it from a value the user gave, and recomputes it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)

    __str__ = __repr__


#: sizes that must be integers >= 1 (the derived ones are checked once filled in)
POSITIVE_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length", "rotary_base",
                  "make_vocab_size_divisible_by")
#: annotation -> (accepted types, what the error says)
_FIELD_TYPES = {"int": (numbers.Integral, "an integer"), "bool": (bool, "True or False"),
                "float": (numbers.Real, "a number"), "str": (str, "a string")}


def check_field_types(config: Any) -> None:
    """Raise ValueError for a field of the dataclass ``config`` whose value does not match its annotation
    (``int``, ``bool``, ``float``, ``str``, or ``Optional`` of one; a bool is not taken as a number, nor a string
    such as ``'64'`` as an int). Other annotations are left to the field's own checks."""
    for f in fields(config):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        optional = kind.startswith("Optional[")
        kind = kind[len("Optional["):-1] if optional else kind
        if not f.init or kind not in _FIELD_TYPES:
            continue
        value = getattr(config, f.name)
        if value is None and optional:
            continue
        types, what = _FIELD_TYPES[kind]
        if not isinstance(value, types) or (kind != "bool" and isinstance(value, bool)):
            raise ValueError(f"{f.name}={value!r} must be {'None or ' if optional else ''}{what}, got "
                             f"{type(value).__name__}")


def _derive(value: Any, derived: int) -> Any:
    """``value`` when it was given (not None and not filled in by a previous config), else ``derived``."""
    return _Derived(derived) if value is None or isinstance(value, _Derived) else value


#: Megatron's ``--attention-backend`` values (:mod:`lightning_megatron.models.attention` says what each computes with)
ATTENTION_BACKENDS = ("auto", "fused", "flash", "unfused", "local")


@dataclass
class GPTConfig:
    """Decoder-only transformer shape (GPT / LLaMA style), Megatron's ``TransformerConfig`` names.

    ``num_query_groups=None`` means multi-head attention (= heads); ``ffn_hidden_size=None`` means
    ``4*hidden_size``; ``kv_channels=None`` means ``hidden_size // num_attention_heads``;
    ``max_position_embeddings=None`` means ``seq_length``. These derived sizes (:data:`DERIVED_FIELDS`) are
    recomputed by :meth:`replace` and ``dataclasses.replace`` unless given there or at construction.
    ``make_vocab_size_divisible_by``: the embedding is padded to a multiple of this times tp (Megatron's
    rule); padded logits are masked out of the loss, so padding never changes the numbers.

    Mixture of experts (Megatron's ``--num-experts`` / ``moe_*`` options; ``num_moe_experts=None`` = dense):
    ``moe_layer_freq`` (int ``N``: layer ``i`` is MoE when ``i % N == 0``, or a 0/1 list of length
    ``num_layers``), ``moe_router_topk``, ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``),
    ``moe_router_score_function`` (``"softmax"`` / ``"sigmoid"``), ``moe_router_pre_softmax``,
    ``moe_router_load_balancing_type`` (``"aux_loss"`` / ``"seq_aux_loss"`` / ``"none"``), ``moe_aux_loss_coeff``,
    ``moe_z_loss_coeff``, ``moe_router_enable_expert_bias`` + ``moe_router_bias_update_rate`` (aux-loss-free
    balancing), ``moe_expert_capacity_factor`` (None = dropless) with ``moe_token_drop_policy``
    (``"probs"`` / ``"position"``), ``moe_shared_expert_intermediate_size``, ``moe_grouped_gemm``,
    ``moe_token_dispatcher_type`` (``"alltoall"`` / ``"allgather"``). See :class:`lightning_megatron.moe.MoEConfig`.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    vocab_size: int = 256
    seq_length: int = 64
    max_position_embeddings: Optional[int] = None
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    # Llama-3.1 RoPE scaling (Megatron's ``--use-rope-scaling`` / ``--rope-scaling-factor``; the band limits of
    # Meta's recipe as fields): see :func:`lightning_megatron.models.gpt.rotary_inv_freq`
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    swiglu: bool = True
    add_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # the kernel of the causal self-attention (Megatron's ``--attention-backend``, :data:`ATTENTION_BACKENDS`; ``auto``:
    # torch's own dispatch): see :mod:`lightning_megatron.models.attention`
    attention_backend: str = "auto"
    make_vocab_size_divisible_by: int = 128
    # ---- mixture of experts (Megatron's names; the defaults are MoEConfig's, which moe_config() builds)
    num_moe_experts: Optional[int] = None
    moe_layer_freq: Union[int, List[int]] = 1
    moe_router_topk: int = MoEConfig.moe_router_topk
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_score_function: str = MoEConfig.moe_router_score_function
    moe_router_pre_softmax: bool = MoEConfig.moe_router_pre_softmax
    moe_router_load_balancing_type: str = MoEConfig.moe_router_load_balancing_type
    moe_aux_loss_coeff: float = MoEConfig.moe_aux_loss_coeff
    moe_z_loss_coeff: Optional[float] = MoEConfig.moe_z_loss_coeff
    moe_router_enable_expert_bias: bool = MoEConfig.moe_router_enable_expert_bias
    moe_router_bias_update_rate: float = MoEConfig.moe_router_bias_update_rate
    moe_expert_capacity_factor: Optional[float] = MoEConfig.moe_expert_capacity_factor
    moe_token_drop_policy: str = MoEConfig.moe_token_drop_policy
    moe_shared_expert_intermediate_size: Optional[int] = MoEConfig.moe_shared_expert_intermediate_size
    moe_grouped_gemm: bool = MoEConfig.moe_grouped_gemm
    moe_token_dispatcher_type: str = MoEConfig.moe_token_dispatcher_type

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in POSITIVE_SIZES:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        self.num_query_groups = _derive(self.num_query_groups, self.num_attention_heads)
        self.ffn_hidden_size = _derive(self.ffn_hidden_size, 4 * self.hidden_size)
        if self.kv_channels is None or isinstance(self.kv_channels, _Derived):
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set kv_channels explicitly"
                )
            self.kv_channels = _Derived(self.hidden_size // self.num_attention_heads)
        self.max_position_embeddings = _derive(self.max_position_embeddings, self.seq_length)
        for name, rule in (("num_query_groups", "None means num_attention_heads"),
                           ("ffn_hidden_size", "None means 4 * hidden_size; 0 would train without MLP"),
                           ("kv_channels", "None means hidden_size // num_attention_heads"),
                           ("max_position_embeddings", "None means seq_length")):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 or None ({rule})")
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"seq_length={self.seq_length} is larger than max_position_embeddings={self.max_position_embeddings}: "
                "learned absolute position embeddings hold one row per position; raise max_position_embeddings "
                "(None follows seq_length) or shorten seq_length"
            )
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if self.rope_scaling and not (self.rope_scaling_factor >= 1.0 and 0 < low < high
                                      and self.rope_scaling_original_max_position_embeddings >= 1):
            raise ValueError(
                f"rope_scaling=True needs rope_scaling_factor >= 1 (got {self.rope_scaling_factor}), "
                f"rope_scaling_original_max_position_embeddings >= 1 (got "
                f"{self.rope_scaling_original_max_position_embeddings}) and 0 < rope_scaling_low_freq_factor < "
                f"rope_scaling_high_freq_factor (got {low}, {high}); Llama-3.1's values are 8, 8192, 1, 4")
        if self.norm_epsilon <= 0:
            raise ValueError(f"norm_epsilon={self.norm_epsilon} must be > 0")
        if self.init_method_std < 0:
            raise ValueError(f"init_method_std={self.init_method_std} must be >= 0")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is not one of {ATTENTION_BACKENDS}: 'auto' (torch's "
                "choice), 'fused' (cuDNN's fused attention), 'flash', 'unfused' / 'local' (the explicit softmax)")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups="
                f"{self.num_query_groups}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r} is not one of {NORMALIZATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r} is not one of {POSITION_EMBEDDINGS}"
            )
        if self.num_moe_experts is not None:
            self.moe_ffn_hidden_size = _derive(self.moe_ffn_hidden_size, self.ffn_hidden_size)
            self.moe_config()  # validates the moe_* fields (ValueError naming the field)
            moe_layer_pattern(self)

    # ---- mixture of experts
    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (global index, from 0) has a MoE MLP (``moe_layer_freq``)."""
        return bool(moe_layer_pattern(self)[layer])

    def moe_config(self) -> MoEConfig:
        """The ``moe_*`` fields as a :class:`MoEConfig` (raises ValueError for a dense config)."""
        if self.num_moe_experts is None:
            raise ValueError("moe_config() needs num_moe_experts (this GPTConfig is dense)")
        shared = {f.name: getattr(self, f.name) for f in fields(MoEConfig) if f.name != "gated_linear_unit"}
        return MoEConfig(**shared, gated_linear_unit=self.swiglu)

    def to_dict(self) -> Dict[str, Any]:
        """Every field as plain Python values (derived sizes as the ints they are)."""
        return {k: int(v) if isinstance(v, _Derived) else v for k, v in asdict(self).items()}

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with some fields changed. The derived sizes (:data:`DERIVED_FIELDS`: ``kv_channels``,
        ``ffn_hidden_size``, ``num_query_groups``, ``max_position_embeddings``, ``moe_ffn_hidden_size``) are
        recomputed from the new fields unless given in ``changes`` or at construction (``dataclasses.replace``
        does the same)."""
        check_keywords("GPTConfig.replace", changes, [f.name for f in fields(self) if f.init])
        return replace(self, **changes)

    def resolved(self) -> "GPTConfig":
        """A copy whose derived sizes are plain ``int`` values (``is_derived`` is False for every field), what a
        model is built from: the marker type of a derived size is an ``int`` subclass, which ``torch.compile``
        treats as a user object in the layers that read it (guards on it at every call)."""
        copy = replace(self)
        for name in DERIVED_FIELDS:
            value = getattr(copy, name)
            if isinstance(value, _Derived):
                object.__setattr__(copy, name, int(value))
        return copy

    def is_derived(self, name: str) -> bool:
        """Whether field ``name`` was filled in by the config (and ``replace`` will recompute it)."""
        return isinstance(getattr(self, name), _Derived)

    @property
    def num_parameters(self) -> int:
        """Parameter count of the unpadded model (embedding counted once when tied)."""
        h, f, v, L = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_layers
        q = self.num_attention_heads * self.kv_channels
        kv = self.num_query_groups * self.kv_channels
        norm = h * (2 if self.normalization == "LayerNorm" else 1)
        attn = h * (q + 2 * kv) + q * h
        mlp = h * f * (3 if self.swiglu else 2)
        bias = (q + 2 * kv + h + f * (2 if self.swiglu else 1) + h) if self.add_bias_linear else 0
        layer = attn + mlp + 2 * norm + bias
        emb = v * h * (2 if self.untie_embeddings_and_output_weights else 1)
        pos = self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0
        total = L * layer + emb + pos + norm
        if self.is_moe:  # MoE layers: router + E experts + shared expert instead of the dense MLP
            glu = 3 if self.swiglu else 2
            moe = (self.num_moe_experts * h * (1 + glu * self.moe_ffn_hidden_size)
                   + glu * h * (self.moe_shared_expert_intermediate_size or 0))
            dense_mlp = mlp + ((f * (2 if self.swiglu else 1) + h) if self.add_bias_linear else 0)
            total += sum(moe_layer_pattern(self)) * (moe - dense_mlp)
        return total

    # ---- presets (shapes as published) ----
    @classmethod
    def tiny(cls, **overrides: Any) -> "GPTConfig":
        """A tiny LLaMA-style model for tests and CPU runs (2 layers, hidden 64, GQA 4/2)."""
        base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=256, seq_length=64, rotary_base=10000)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def llama3_8b(cls, **overrides: Any) -> "GPTConfig":
        """Meta Llama 3 8B: 32 layers, hidden 4096, 32 heads / 8 KV groups, SwiGLU 14336, vocab 128256."""
        base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                    ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, rotary_base=500000,
                    normalization="RMSNorm", swiglu=True, untie_embeddings_and_output_weights=True)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def llama3_1_8b(cls, **overrides: Any) -> "GPTConfig":
        """Meta Llama 3.1 8B: Llama 3 8B with RoPE scaling (factor 8, low/high frequency factors 1/4, original
        context 8192) and a 131072-token context (``max_position_embeddings``)."""
        base = dict(max_position_embeddings=131072, rope_scaling=True, rope_scaling_factor=8.0,
                    rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                    rope_scaling_original_max_position_embeddings=8192)
        base.update(overrides)
        return cls.llama3_8b(**base)

    @classmethod
    def llama3_70b(cls, **overrides: Any) -> "GPTConfig":
        """Meta Llama 3 70B: 80 layers, hidden 8192, 64 heads / 8 KV groups, SwiGLU 28672, vocab 128256."""
        base = dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                    ffn_hidden_size=28672, vocab_size=128256, seq_length=8192, rotary_base=500000,
                    normalization="RMSNorm", swiglu=True, untie_embeddings_and_output_weights=True)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def gpt3_175b(cls, **overrides: Any) -> "GPTConfig":
        """GPT-3 175B: 96 layers, hidden 12288, 96 heads, GELU 49152, learned positions, LayerNorm, tied."""
        base = dict(num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=49152,
                    vocab_size=50257, seq_length=2048, normalization="LayerNorm",
                    position_embedding_type="learned_absolute", swiglu=False, add_bias_linear=True,
                    untie_embeddings_and_output_weights=False, init_method_std=0.006)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def llama_1b_bench(cls, **overrides: Any) -> "GPTConfig":
        """The 1.3B LLaMA-style benchmark model of ``benchmarks/`` and the peer baselines."""
        base = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                    ffn_hidden_size=5632, vocab_size=32000, seq_length=2048, rotary_base=500000)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny_moe(cls, **overrides: Any) -> "GPTConfig":
        """A tiny Mixtral-style MoE for tests and CPU runs: 2 layers, hidden 64, 4 experts top-2 (SwiGLU 64)."""
        base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=256, seq_length=64, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                    moe_aux_loss_coeff=1e-2)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def mixtral_8x7b(cls, **overrides: Any) -> "GPTConfig":
        """Mixtral 8x7B: 32 layers, hidden 4096, 32 heads / 8 KV groups, 8 SwiGLU experts of 14336, top-2,
        vocab 32000, RoPE base 1e6, aux loss 1e-2 (Megatron's Mixtral example), grouped GEMM, all-to-all."""
        base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                    ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                    rotary_base=1000000, normalization="RMSNorm", swiglu=True,
                    untie_embeddings_and_output_weights=True, num_moe_experts=8, moe_router_topk=2,
                    moe_ffn_hidden_size=14336, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                    moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
        base.update(overrides)
        return cls(**base)

    @classmethod
    def mixtral_small_bench(cls, **overrides: Any) -> "GPTConfig":
        """Mixtral-shaped benchmark model: 8 layers, hidden 2048, 16 heads / 8 KV groups, 8 SwiGLU experts of
        5632, top-2, vocab 32000, seq 2048, grouped GEMM, all-to-all dispatcher, aux loss 1e-2."""
        base = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                    ffn_hidden_size=5632, vocab_size=32000, seq_length=2048, rotary_base=1000000,
                    num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=5632, moe_aux_loss_coeff=1e-2,
                    moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
        base.update(overrides)
        return cls(**base)


def _checked_init(init: Any) -> Any:
    @functools.wraps(init)   # keeps the dataclass signature visible to inspect.signature
    def __init__(self: GPTConfig, *args: Any, **kwargs: Any) -> None:
        check_keywords("GPTConfig", kwargs, [f.name for f in fields(GPTConfig) if f.init])
        init(self, *args, **kwargs)

    return __init__


GPTConfig.__init__ = _checked_init(GPTConfig.__init__)  # type: ignore[method-assign]
