"""``GPTConfig`` from and to a Hugging Face ``config.json`` of ``LlamaForCausalLM``, ``MistralForCausalLM`` or
``MixtralForCausalLM`` (plain dicts: ``transformers`` is not needed to convert)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Union

from lightning_megatron.models.config import GPTConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral"}
#: ``rms_norm_eps`` of each ``transformers`` config class when ``config.json`` leaves it out (ours is 1e-5)
DEFAULT_RMS_NORM_EPS = {"llama": 1e-6, "mistral": 1e-6, "mixtral": 1e-5}
DEFAULT_ROPE_THETA = {"llama": 10000.0, "mistral": 10000.0, "mixtral": 1e6}
#: the default training length when config.json's context is longer (override with seq_length=...)
DEFAULT_SEQ_LENGTH = 4096

PathLike = Union[str, "os.PathLike[str]"]


def read_hf_config(path: PathLike) -> Dict[str, Any]:
    """``config.json`` of the checkpoint directory ``path`` (or the file itself) as a dict."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist: pass a Hugging Face checkpoint directory holding config.json")
    with open(file) as f:
        return json.load(f)


def model_type(hf: Dict[str, Any]) -> str:
    """``"llama"``, ``"mistral"`` or ``"mixtral"`` from ``architectures`` / ``model_type`` (ValueError otherwise)."""
    for arch in hf.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    kind = hf.get("model_type")
    if kind in ARCHITECTURES.values():
        return kind
    raise ValueError(f"unsupported Hugging Face model (architectures={hf.get('architectures')}, model_type="
                     f"{kind!r}): lightning_megatron.hf converts {sorted(ARCHITECTURES)}")


def _rope(hf: Dict[str, Any], kind: str) -> Dict[str, Any]:
    """The RoPE fields of GPTConfig from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params.update(hf.get("rope_scaling") or {})
        params["rope_theta"] = hf.get("rope_theta", DEFAULT_ROPE_THETA[kind])
    theta = float(params["rope_theta"])
    if theta != int(theta):
        raise ValueError(f"rope_theta={theta} is not an integer: GPTConfig.rotary_base is an int")
    out: Dict[str, Any] = {"rotary_base": int(theta)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]),
                   rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported: GPTConfig has plain RoPE and Llama-3.1's "
                         "scaling ('llama3')")
    return out


def config_from_hf(hf: Union[PathLike, Dict[str, Any]], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face Llama / Mistral / Mixtral ``config.json`` (a dict, the file or its
    directory); ``overrides`` replace any field (e.g. ``seq_length``, ``make_vocab_size_divisible_by``).

    GQA (``num_key_value_heads``), ``head_dim``, RoPE base and Llama-3.1 scaling, ``rms_norm_eps`` (the
    ``transformers`` class default when absent: 1e-6 for Llama and Mistral, 1e-5 for Mixtral, where ours is
    1e-5), tied embeddings, biases, and Mixtral's experts / top-k / aux-loss coefficient are mapped.
    ``seq_length`` is ``max_position_embeddings`` capped at 4096 and at Mistral's ``sliding_window`` (our attention
    is full causal: equal to Mistral's while sequences fit the window). Raises ValueError for a model these
    fields cannot express (another activation, unequal attention / MLP biases, another RoPE type).
    """
    if not isinstance(hf, dict):
        hf = read_hf_config(hf)
    kind = model_type(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported: GPTConfig's gated MLP is SwiGLU (silu)")
    bias = bool(hf.get("attention_bias", False))
    if kind == "llama" and bool(hf.get("mlp_bias", False)) != bias:
        raise ValueError(f"attention_bias={bias} and mlp_bias={hf.get('mlp_bias')} differ: GPTConfig has one "
                         "add_bias_linear for both")
    heads = hf["num_attention_heads"]
    max_positions = int(hf.get("max_position_embeddings", 2048))
    seq_length = min(max_positions, DEFAULT_SEQ_LENGTH)
    if hf.get("sliding_window"):
        seq_length = min(seq_length, int(hf["sliding_window"]))
    fields: Dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=seq_length, max_position_embeddings=max_positions,
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS[kind])),
        position_embedding_type="rope", swiglu=True, add_bias_linear=bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)), hidden_dropout=0.0,
        **_rope(hf, kind))
    if kind == "mixtral":
        fields.update(num_moe_experts=hf.get("num_local_experts", 8), moe_router_topk=hf.get("num_experts_per_tok", 2),
                      moe_ffn_hidden_size=hf["intermediate_size"], moe_router_load_balancing_type="aux_loss",
                      moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                      moe_router_score_function="softmax", moe_router_pre_softmax=False)
    fields.update(overrides)
    return GPTConfig(**fields)


def _check_exportable(config: GPTConfig) -> None:
    c = config
    problems = []
    if c.normalization != "RMSNorm":
        problems.append(f"normalization={c.normalization!r} (needs 'RMSNorm')")
    if c.position_embedding_type != "rope":
        problems.append(f"position_embedding_type={c.position_embedding_type!r} (needs 'rope')")
    if not c.swiglu:
        problems.append("swiglu=False (needs SwiGLU)")
    if c.is_moe:
        if c.add_bias_linear:
            problems.append("add_bias_linear=True with experts")
        if c.moe_router_score_function != "softmax" or c.moe_router_pre_softmax:
            problems.append("a router other than Mixtral's (softmax over the top-k logits)")
        if c.moe_shared_expert_intermediate_size or c.moe_router_enable_expert_bias:
            problems.append("shared experts / expert bias")
        if not all(c.is_moe_layer(i) for i in range(c.num_layers)):
            problems.append(f"moe_layer_freq={c.moe_layer_freq!r} (Mixtral has experts in every layer)")
    if problems:
        raise ValueError("this GPTConfig has no Llama / Mixtral counterpart in transformers: " + "; ".join(problems))


def config_to_hf(config: GPTConfig, architecture: Optional[str] = None, dtype: str = "float32") -> Dict[str, Any]:
    """A ``config.json`` dict for ``config``: ``MixtralForCausalLM`` for a MoE config, else ``LlamaForCausalLM``
    (or ``architecture``, e.g. ``"MistralForCausalLM"``). RoPE is written both as transformers 5's
    ``rope_parameters`` and as ``rope_theta`` / ``rope_scaling``. Raises ValueError for a config without a
    counterpart (LayerNorm, learned positions, GELU, MoE options Mixtral lacks)."""
    _check_exportable(config)
    c = config
    architecture = architecture or ("MixtralForCausalLM" if c.is_moe else "LlamaForCausalLM")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r} is not one of {sorted(ARCHITECTURES)}")
    kind = ARCHITECTURES[architecture]
    if c.is_moe != (kind == "mixtral"):
        raise ValueError(f"architecture={architecture!r} does not fit a {'MoE' if c.is_moe else 'dense'} GPTConfig")
    if c.add_bias_linear and kind != "llama":
        raise ValueError(f"add_bias_linear=True has no {architecture} counterpart: export as LlamaForCausalLM")
    scaling = None
    if c.rope_scaling:
        scaling = {"rope_type": "llama3", "factor": c.rope_scaling_factor,
                   "low_freq_factor": c.rope_scaling_low_freq_factor,
                   "high_freq_factor": c.rope_scaling_high_freq_factor,
                   "original_max_position_embeddings": c.rope_scaling_original_max_position_embeddings}
    out: Dict[str, Any] = {
        "architectures": [architecture], "model_type": kind, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.moe_ffn_hidden_size if c.is_moe else c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups, "head_dim": c.kv_channels, "hidden_act": "silu",
        "max_position_embeddings": max(c.max_position_embeddings, c.seq_length), "rms_norm_eps": c.norm_epsilon,
        "rope_theta": float(c.rotary_base), "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(c.rotary_base)} if scaling is None
        else {**scaling, "rope_theta": float(c.rotary_base)},
        "tie_word_embeddings": not c.untie_embeddings_and_output_weights, "attention_dropout": c.attention_dropout,
        "initializer_range": c.init_method_std, "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
    }
    if kind == "llama":
        out.update(attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear)
    else:
        out.update(sliding_window=None)
    if kind == "mixtral":
        out.update(num_local_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk,
                   router_aux_loss_coef=c.moe_aux_loss_coeff, output_router_logits=False, router_jitter_noise=0.0)
    return out
