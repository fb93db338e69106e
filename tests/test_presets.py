"""The large presets' shapes: each is built as a ``GPTModel`` on the meta device (no memory) and its parameter
count compared with the published number, or, where none is exact, with a closed form written out here."""
from __future__ import annotations

import pytest
import torch

from lightning_megatron import GPTConfig, GPTModel


def llama_style_count(layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int) -> int:
    """RMSNorm, SwiGLU, GQA, no biases, untied embeddings: per layer q/o (h*h each), k/v (h*h*groups/heads
    each), the MLP's three h*ffn matrices and two norms; then the two vocab matrices and the final norm."""
    kv = hidden * groups // heads
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return layers * layer + 2 * vocab * hidden + hidden


PRESETS = {
    # id: (config, expected parameter count); the source of each number is above it
    # Meta's model card / Hugging Face safetensors metadata: 8,030,261,248 and 70,553,706,496.
    "llama3_8b": (GPTConfig.llama3_8b(), 8_030_261_248),
    "llama3_70b": (GPTConfig.llama3_70b(), 70_553_706_496),
    # Llama 3.1 8B has Llama 3 8B's shapes (RoPE scaling adds no parameters): 8,030,261,248.
    "llama3_1_8b": (GPTConfig.llama3_1_8b(), 8_030_261_248),
    # Mistral's Mixtral-8x7B (Hugging Face metadata): 46,702,792,704, routers included.
    "mixtral_8x7b": (GPTConfig.mixtral_8x7b(), 46_702_792_704),
    # GPT-3 175B: Narayanan et al. (2021), P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), which leaves out the
    # final LayerNorm (2h); V = 50257, s = 2048, l = 96, h = 12288 -> 174,604,234,752 + 24,576.
    "gpt3_175b": (GPTConfig.gpt3_175b(), 12 * 96 * 12288**2 + 13 * 96 * 12288 + (50257 + 2048) * 12288 + 2 * 12288),
    # The 1.3B benchmark model: no published count, the closed form above.
    "llama_1b_bench": (GPTConfig.llama_1b_bench(), llama_style_count(24, 2048, 16, 8, 5632, 32000)),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count(name):
    cfg, expected = PRESETS[name]
    with torch.device("meta"):
        model = GPTModel(cfg)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    # the model pads the vocabulary to a multiple of 128 (Megatron's rule); published counts do not
    padding = (model.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size
    vocab_matrices = 2 if cfg.untie_embeddings_and_output_weights else 1
    assert sum(p.numel() for p in params) - vocab_matrices * padding == expected
    assert cfg.num_parameters == expected


def test_llama3_8b_shapes():
    """Megatron's fused layouts at 8B: qkv packs 32 query heads and 8 key + 8 value heads of 128 channels, fc1
    packs SwiGLU's gate and up projections."""
    with torch.device("meta"):
        model = GPTModel(GPTConfig.llama3_8b())
    layer = model.decoder.layers["31"]
    assert layer.self_attention.linear_qkv.weight.shape == ((32 + 8 + 8) * 128, 4096)
    assert layer.self_attention.linear_proj.weight.shape == (4096, 32 * 128)
    assert layer.mlp.linear_fc1.weight.shape == (2 * 14336, 4096)
    assert layer.mlp.linear_fc2.weight.shape == (4096, 14336)
    assert model.embedding.word_embeddings.weight.shape == (128256, 4096)
    assert model.output_layer.weight.shape == (128256, 4096)
    assert len(model.decoder.layers) == 32
