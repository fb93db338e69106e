"""Weight names and layouts: our full (tp=1, pp=1) parameters <-> Hugging Face Llama / Mistral / Mixtral tensors.

Ours packs ``linear_qkv`` by query group (for each group its query heads, then its key head, then its value
head: :func:`qkv_rows`), ``linear_fc1`` as ``[gate; up]`` and the experts as ``weight1 [E, h, 2f]`` (gate then up
columns) / ``weight2 [E, f, h]``; HF keeps ``q/k/v_proj``, ``gate/up/down_proj`` and, per expert, ``w1`` (gate),
``w3`` (up), ``w2`` (down) as ``nn.Linear`` weights (transformers 5 holds them fused in memory as
``mlp.experts.gate_up_proj [E, 2f, h]`` / ``down_proj [E, h, f]`` and reads either form).
"""
from __future__ import annotations

from typing import Callable, Dict, List, TypeVar

import torch
from torch import Tensor

from lightning_megatron.models.config import GPTConfig

T = TypeVar("T")


def qkv_rows(config: GPTConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Row indices into ``linear_qkv``'s output for the query heads, key heads and value heads, in head order.

    Group ``g`` owns rows ``[g*(r+2)*d, (g+1)*(r+2)*d)`` with ``r = heads/groups``: its ``r`` query heads (global
    query heads ``g*r .. g*r+r-1``), then its key head, then its value head, ``d = kv_channels`` rows each. Query
    head ``i`` attends with key/value head ``i // r``, the grouping HF's ``repeat_kv`` uses.
    """
    d, groups = config.kv_channels, config.num_query_groups
    r = config.num_attention_heads // groups
    q, k, v = [], [], []
    for g in range(groups):
        base = g * (r + 2) * d
        for j in range(r):
            q.extend(range(base + j * d, base + (j + 1) * d))
        k.extend(range(base + r * d, base + (r + 1) * d))
        v.extend(range(base + (r + 1) * d, base + (r + 2) * d))
    return torch.tensor(q), torch.tensor(k), torch.tensor(v)


def to_hf(params: Dict[str, Tensor], config: GPTConfig, fused_experts: bool = True) -> Dict[str, Tensor]:
    """Our full parameters (tp=1 names and layout, vocabulary padded or not) -> HF ``*ForCausalLM`` tensors.

    Differentiable (row selections and transposes only). Only the first ``vocab_size`` embedding / output rows are
    kept; with tied embeddings there is no ``lm_head.weight``. ``fused_experts``: Mixtral experts as
    transformers 5's in-memory ``mlp.experts.gate_up_proj`` / ``down_proj`` (and ``mlp.gate``); otherwise as the
    checkpoint files hold them, ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` (and ``block_sparse_moe.gate``).
    """
    V, f = config.vocab_size, config.ffn_hidden_size
    q_rows, k_rows, v_rows = qkv_rows(config)
    out = {"model.embed_tokens.weight": params["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": params["decoder.final_layernorm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = params["output_layer.weight"][:V]
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = params[ours + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = params[ours + "pre_mlp_layernorm.weight"]
        moe = config.is_moe and config.is_moe_layer(i)
        for suffix in ("weight", "bias") if config.add_bias_linear else ("weight",):
            qkv = params[ours + "self_attention.linear_qkv." + suffix]
            for proj, rows in (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", v_rows)):
                out[f"{hf}self_attn.{proj}.{suffix}"] = qkv[rows]
            out[f"{hf}self_attn.o_proj.{suffix}"] = params[ours + "self_attention.linear_proj." + suffix]
            if moe:
                continue
            fc1 = params[ours + "mlp.linear_fc1." + suffix]
            out[f"{hf}mlp.gate_proj.{suffix}"] = fc1[:f]
            out[f"{hf}mlp.up_proj.{suffix}"] = fc1[f:]
            out[f"{hf}mlp.down_proj.{suffix}"] = params[ours + "mlp.linear_fc2." + suffix]
        if not moe:
            continue
        w1, w2 = params[ours + "mlp.experts.weight1"], params[ours + "mlp.experts.weight2"]
        if fused_experts:
            out[hf + "mlp.gate.weight"] = params[ours + "mlp.router.weight"]
            out[hf + "mlp.experts.gate_up_proj"] = w1.transpose(1, 2)
            out[hf + "mlp.experts.down_proj"] = w2.transpose(1, 2)
            continue
        out[hf + "block_sparse_moe.gate.weight"] = params[ours + "mlp.router.weight"]
        fe = config.moe_ffn_hidden_size
        for e in range(w1.shape[0]):
            experts = f"{hf}block_sparse_moe.experts.{e}."
            out[experts + "w1.weight"] = w1[e, :, :fe].t()
            out[experts + "w3.weight"] = w1[e, :, fe:].t()
            out[experts + "w2.weight"] = w2[e].t()
    return out


# ------------------------------------------------------------------------------------------ HF -> ours, lazily
class Lazy:
    """A tensor in our layout assembled from HF tensors on demand: :meth:`read` reads only the rows/columns of the
    stored tensors that a box (one ``slice`` with step 1 per dimension) of it needs."""

    shape: tuple

    def read(self, box: tuple) -> Tensor:
        raise NotImplementedError

    def read_all(self) -> Tensor:
        return self.read(tuple(slice(0, n) for n in self.shape))


class Stored(Lazy):
    """Tensor ``name`` of the checkpoint, read through ``get_slice(name)`` (safetensors)."""

    def __init__(self, name: str, get_slice: Callable[[str], object]) -> None:
        self.name, self._slice = name, get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, box: tuple) -> Tensor:
        return self._slice[box]


class Transposed(Lazy):
    """The last two dims of ``base`` swapped."""

    def __init__(self, base: Lazy) -> None:
        self.base = base
        self.shape = base.shape[:-2] + (base.shape[-1], base.shape[-2])

    def read(self, box: tuple) -> Tensor:
        return self.base.read(box[:-2] + (box[-1], box[-2])).transpose(-1, -2)


class Rows(Lazy):
    """Rows ``[start, stop)`` of ``base`` (dim 0)."""

    def __init__(self, base: Lazy, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= base.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) are outside a tensor of shape {base.shape}")
        self.base, self.start = base, start
        self.shape = (stop - start,) + base.shape[1:]

    def read(self, box: tuple) -> Tensor:
        first = box[0]
        return self.base.read((slice(self.start + first.start, self.start + first.stop),) + box[1:])


class Cat(Lazy):
    """``torch.cat(parts, dim)``."""

    def __init__(self, parts: List[Lazy], dim: int) -> None:
        self.parts, self.dim = parts, dim
        shape = list(parts[0].shape)
        for p in parts[1:]:
            if len(p.shape) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(p.shape, shape)) if i != dim):
                raise ValueError(f"cannot concatenate shapes {[q.shape for q in parts]} along dim {dim}")
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = tuple(shape)

    def read(self, box: tuple) -> Tensor:
        lo, hi = box[self.dim].start, box[self.dim].stop
        pieces, offset = [], 0
        for p in self.parts:
            size = p.shape[self.dim]
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                sub = list(box)
                sub[self.dim] = slice(a - offset, b - offset)
                pieces.append(p.read(tuple(sub)))
            offset += size
        return torch.cat(pieces, dim=self.dim)


class Stack(Lazy):
    """``torch.stack(parts)`` (a new dim 0)."""

    def __init__(self, parts: List[Lazy]) -> None:
        self.parts = parts
        self.shape = (len(parts),) + parts[0].shape

    def read(self, box: tuple) -> Tensor:
        return torch.stack([self.parts[i].read(box[1:]) for i in range(box[0].start, box[0].stop)])


class PaddedRows(Lazy):
    """``base`` with zero rows appended up to ``rows`` (vocabulary padding)."""

    def __init__(self, base: Lazy, rows: int) -> None:
        self.base = base
        self.shape = (max(rows, base.shape[0]),) + base.shape[1:]

    def read(self, box: tuple) -> Tensor:
        first, real = box[0], self.base.shape[0]
        top = self.base.read((slice(first.start, min(first.stop, real)),) + box[1:]) if first.start < real else None
        zeros = max(0, first.stop - max(first.start, real))
        if zeros == 0:
            return top
        shape = (zeros,) + tuple(s.stop - s.start for s in box[1:])
        pad = torch.zeros(shape, dtype=top.dtype if top is not None else torch.float32)
        return pad if top is None else torch.cat([top, pad], dim=0)


def from_hf(config: GPTConfig, names: set, get_slice: Callable[[str], object]) -> Dict[str, Callable[[], Lazy]]:
    """Our full parameter name -> a builder of its :class:`Lazy` from the HF checkpoint tensors ``names`` (opened
    through ``get_slice``). Reads Mixtral experts in either form (per-expert ``w1/w2/w3`` or fused)."""
    c = config
    d, r = c.kv_channels, c.num_attention_heads // c.num_query_groups

    def stored(name: str) -> Lazy:
        if name not in names:
            raise KeyError(f"the Hugging Face checkpoint has no tensor {name!r}, which a model of this config needs "
                           "(is config.json the one of these weights?)")
        return Stored(name, get_slice)

    def qkv(prefix: str, suffix: str) -> Lazy:
        q, k, v = (stored(f"{prefix}self_attn.{p}_proj.{suffix}") for p in "qkv")
        parts: List[Lazy] = []
        for g in range(c.num_query_groups):
            parts += [Rows(q, g * r * d, (g + 1) * r * d), Rows(k, g * d, (g + 1) * d), Rows(v, g * d, (g + 1) * d)]
        return Cat(parts, 0)

    out: Dict[str, Callable[[], Lazy]] = {
        "embedding.word_embeddings.weight": lambda: stored("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": lambda: stored("model.norm.weight"),
    }
    if c.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = lambda: stored("lm_head.weight")
    for i in range(c.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[ours + "input_layernorm.weight"] = lambda hf=hf: stored(hf + "input_layernorm.weight")
        out[ours + "pre_mlp_layernorm.weight"] = lambda hf=hf: stored(hf + "post_attention_layernorm.weight")
        moe = c.is_moe and c.is_moe_layer(i)
        for suffix in ("weight", "bias") if c.add_bias_linear else ("weight",):
            out[f"{ours}self_attention.linear_qkv.{suffix}"] = lambda hf=hf, s=suffix: qkv(hf, s)
            out[f"{ours}self_attention.linear_proj.{suffix}"] = lambda hf=hf, s=suffix: stored(
                f"{hf}self_attn.o_proj.{s}")
            if not moe:
                out[f"{ours}mlp.linear_fc1.{suffix}"] = lambda hf=hf, s=suffix: Cat(
                    [stored(f"{hf}mlp.gate_proj.{s}"), stored(f"{hf}mlp.up_proj.{s}")], 0)
                out[f"{ours}mlp.linear_fc2.{suffix}"] = lambda hf=hf, s=suffix: stored(f"{hf}mlp.down_proj.{s}")
        if not moe:
            continue
        fused = f"{hf}mlp.experts.gate_up_proj" in names
        if fused:
            out[ours + "mlp.router.weight"] = lambda hf=hf: stored(hf + "mlp.gate.weight")
            out[ours + "mlp.experts.weight1"] = lambda hf=hf: Transposed(stored(hf + "mlp.experts.gate_up_proj"))
            out[ours + "mlp.experts.weight2"] = lambda hf=hf: Transposed(stored(hf + "mlp.experts.down_proj"))
            continue
        experts = [f"{hf}block_sparse_moe.experts.{e}." for e in range(c.num_moe_experts)]
        out[ours + "mlp.router.weight"] = lambda hf=hf: stored(hf + "block_sparse_moe.gate.weight")
        out[ours + "mlp.experts.weight1"] = lambda ex=experts: Stack(
            [Cat([Transposed(stored(e + "w1.weight")), Transposed(stored(e + "w3.weight"))], 1) for e in ex])
        out[ours + "mlp.experts.weight2"] = lambda ex=experts: Stack([Transposed(stored(e + "w2.weight")) for e in ex])
    return out
