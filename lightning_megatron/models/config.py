"""``GPTConfig``: the model's shape, with Megatron-LM's field names, and published presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Optional

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


@dataclass
class GPTConfig:
    """Decoder-only transformer shape (GPT / LLaMA style), Megatron's ``TransformerConfig`` names.

    ``num_query_groups=None`` means multi-head attention (= heads); ``ffn_hidden_size=None`` means
    ``4*hidden_size``; ``kv_channels=None`` means ``hidden_size // num_attention_heads``.
    ``make_vocab_size_divisible_by``: the embedding is padded to a multiple of this times tp (Megatron's
    rule); padded logits are masked out of the loss, so padding never changes the numbers.
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
    swiglu: bool = True
    add_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set kv_channels explicitly"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
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
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with some fields changed (derived fields recomputed unless given)."""
        return replace(self, **changes)

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
        return L * layer + emb + pos + norm

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
