"""``GPTModel`` against independent references, in float64: Hugging Face ``transformers`` models and closed forms.

Part 1 builds tiny random models, maps our weights onto the matching ``transformers`` model (``LlamaForCausalLM``,
``MistralForCausalLM``, ``MixtralForCausalLM``, ``GPT2LMHeadModel``) and compares logits, the per-token loss and
the gradient of every parameter. The weight mapping (``*_to_hf`` below) is written with differentiable ops
(row selections, transposes), and the reference runs the HF model on the mapped tensors through
``torch.func.functional_call``; so the reference gradient with respect to *our* parameters is the chain rule
through the mapping (the mapping's transpose applied to HF's gradients: the Q/K/V packing is undone, tied
embeddings collect both uses, padded vocabulary rows get zero). Position ids are not ``arange`` in every case
(shuffled and gapped rows), so a model that ignored them, or used ``arange``, fails.

What makes HF a float64 reference (``_float64_faithful``): HF's RMSNorm and Mixtral's router softmax cast to
float32 as a mixed-precision safeguard, which in a float64 model is a downcast; the reference replaces those
forwards with the same formulas without the cast. Attention runs through HF's ``sdpa`` path (the eager path
softmaxes in float32), with an explicit all-ones ``attention_mask`` (without one and without a KV cache, HF
reads non-consecutive ``position_ids`` as packed sequences and masks across them). HF computes its RoPE tables in
float32 and casts them up; ours are float64 in a float64 model, so the reference's rotary embedding runs HF's formula
in float64 (``_rotary_forward``).

MoE options that have no HF Mixtral counterpart and so are not compared here: ``moe_router_pre_softmax`` (Mixtral
renormalises the top-k probabilities), sigmoid scores and the expert bias, ``seq_aux_loss``, the z-loss,
capacity factors / token dropping (Mixtral is dropless) and the shared expert (HF's Qwen2-MoE one is gated).
The aux loss is not taken from HF's ``load_balancing_loss_func`` for the gradient: HF accumulates it in float32
and pools all layers' statistics before multiplying (Megatron sums per-layer losses), and HF's tokens fraction is
not divided by top-k. The reference is the Switch formula per layer in float64 (``_switch_aux_loss``), checked
against HF's function for one layer at float32 precision.

Part 2 checks the pieces against closed forms: RoPE, the norms, the Q/K/V split and the LR schedule.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor
from torch.func import functional_call

from lightning_megatron.hf import qkv_rows, to_hf
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.gpt import GPTModel, Norm, SelfAttention, apply_rotary, rotary_cos_sin
from lightning_megatron.models.module import megatron_lr_lambda

F64 = torch.float64
LOGITS_RTOL = 1e-12   # max |diff| / max |ref| of the logits
LOSS_RTOL = 1e-12     # max relative error of the per-token loss
GRAD_RTOL = 1e-10     # max |diff| / max |ref| of each parameter's gradient


# ----------------------------------------------------------------------------------------------- weights
def randomize_(model: GPTModel, seed: int) -> GPTModel:
    """Fill every parameter with random values of a useful size (in place; returns ``model``).

    Matrices and embeddings ``N(0, 1/fan_in)`` (logits of order one), norm weights ``1 + N(0, 0.2)``, biases
    ``N(0, 0.1)``; padded vocabulary rows are random too, so a model that let them into the softmax would fail.
    The default initialisation (ones, zeros) would leave the norm weights and biases unchecked.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=F64)
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                experts = name.endswith(("experts.weight1", "experts.weight2"))  # [E, in, out]
                fan_in = p.shape[-2] if experts else p.shape[-1]
                p.copy_(noise / math.sqrt(fan_in))
    return model


def build_ours(config: GPTConfig, seed: int = 0) -> GPTModel:
    """A float64 ``GPTModel`` with random weights (dropout off, train mode so routers attach their aux losses)."""
    return randomize_(GPTModel(config).to(F64), seed).train()


def llama_to_hf(params: Dict[str, Tensor], config: GPTConfig) -> Dict[str, Tensor]:
    """Our parameters -> ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``MixtralForCausalLM`` parameters: the
    project's mapping (:func:`lightning_megatron.hf.to_hf`, differentiable), with the experts as transformers 5
    holds them in memory (``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    return to_hf(params, config, fused_experts=True)


def gpt2_to_hf(params: Dict[str, Tensor], config: GPTConfig) -> Dict[str, Tensor]:
    """Our parameters -> ``GPT2LMHeadModel`` parameters (LayerNorm, GELU, biases, learned positions, tied).

    GPT-2's ``Conv1D`` stores ``[in, out]`` (our ``nn.Linear`` weights transposed); ``c_attn`` packs all query
    heads, then all key heads, then all value heads, which :func:`qkv_rows` picks out of ``linear_qkv``
    (multi-head attention: one query head per group).
    """
    V = config.vocab_size
    rows = torch.cat(qkv_rows(config))
    out = {"transformer.wte.weight": params["embedding.word_embeddings.weight"][:V],
           "transformer.wpe.weight": params["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": params["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": params["decoder.final_layernorm.bias"]}
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for suffix in ("weight", "bias"):
            out[f"{hf}ln_1.{suffix}"] = params[ours + "input_layernorm." + suffix]
            out[f"{hf}ln_2.{suffix}"] = params[ours + "pre_mlp_layernorm." + suffix]
        pairs = (("attn.c_attn", "self_attention.linear_qkv"), ("attn.c_proj", "self_attention.linear_proj"),
                 ("mlp.c_fc", "mlp.linear_fc1"), ("mlp.c_proj", "mlp.linear_fc2"))
        for hf_name, our_name in pairs:
            weight, bias = params[f"{ours}{our_name}.weight"], params[f"{ours}{our_name}.bias"]
            if hf_name == "attn.c_attn":
                weight, bias = weight[rows], bias[rows]
            out[f"{hf}{hf_name}.weight"] = weight.t()
            out[f"{hf}{hf_name}.bias"] = bias
    return out


# ----------------------------------------------------------------------------------------------- HF models
def _rmsnorm_forward(self, x: Tensor) -> Tensor:
    """HF's RMSNorm formula without its float32 cast."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _mixtral_router_forward(self, hidden_states: Tensor):
    """``MixtralTopKRouter.forward`` without its float32 cast: softmax, top-k, renormalise."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(torch.softmax(router_logits, dim=-1), self.top_k, dim=-1)
    return router_logits, top_value / top_value.sum(dim=-1, keepdim=True), top_index


def _rotary_forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """HF's default RoPE ``forward`` (``cos, sin`` ``[b, s, head_dim]``) with the inverse frequencies and the
    angles in float64 instead of float32."""
    base = float(self.config.rope_parameters["rope_theta"])
    dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=F64, device=x.device) / dim))
    freqs = position_ids[..., None].to(F64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _float64_faithful(model: torch.nn.Module) -> torch.nn.Module:
    """Cast an HF model to float64 and swap the forwards that compute in float32 (see the module docstring)."""
    model = model.to(F64).eval()
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = _rmsnorm_forward.__get__(module)
        elif name.endswith("RotaryEmbedding"):
            assert module.rope_type == "default", module.rope_type
            module.forward = _rotary_forward.__get__(module)
        elif name == "MixtralTopKRouter":
            module.forward = _mixtral_router_forward.__get__(module)
    return model


def _llama_kwargs(config: GPTConfig) -> dict:
    c = config
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_query_groups,
                head_dim=c.kv_channels, rms_norm_eps=c.norm_epsilon, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": float(c.rotary_base)},
                tie_word_embeddings=not c.untie_embeddings_and_output_weights, hidden_act="silu",
                attention_dropout=0.0, attn_implementation="sdpa")


def hf_llama(config: GPTConfig) -> torch.nn.Module:
    return _float64_faithful(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        intermediate_size=config.ffn_hidden_size, attention_bias=config.add_bias_linear,
        mlp_bias=config.add_bias_linear, **_llama_kwargs(config))))


def hf_mistral(config: GPTConfig, sliding_window: Optional[int]) -> torch.nn.Module:
    return _float64_faithful(transformers.MistralForCausalLM(transformers.MistralConfig(
        intermediate_size=config.ffn_hidden_size, sliding_window=sliding_window, **_llama_kwargs(config))))


def hf_mixtral(config: GPTConfig) -> torch.nn.Module:
    return _float64_faithful(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=config.moe_ffn_hidden_size, num_local_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk, router_jitter_noise=0.0, sliding_window=None,
        experts_implementation="eager", **_llama_kwargs(config))))


def hf_gpt2(config: GPTConfig) -> torch.nn.Module:
    c = config
    return _float64_faithful(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size, activation_function="gelu",
        layer_norm_epsilon=c.norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")))


def _switch_aux_loss(router_logits: Tensor, topk: int, coeff: float) -> Tensor:
    """Switch-Transformer load balancing of one layer, Megatron's normalisation: ``coeff * E * sum_e f_e P_e``
    with ``f_e`` the fraction of the ``T * topk`` routed slots that go to expert ``e`` and ``P_e`` the mean
    softmax probability of ``e``; ``router_logits [T, E]``."""
    T, E = router_logits.shape
    probs = torch.softmax(router_logits, dim=-1)
    chosen = torch.topk(probs, topk, dim=-1).indices
    fraction = torch.bincount(chosen.reshape(-1), minlength=E).to(probs.dtype) / (T * topk)
    return coeff * E * (fraction * probs.mean(0)).sum()


# ----------------------------------------------------------------------------------------------- comparison
def make_batch(config: GPTConfig, batch: int = 3, seq: int = 12, seed: int = 1) -> Dict[str, Tensor]:
    """Tokens, next-token labels, per-token loss weights and position ids ``[b, s]``: row 0 ``arange``,
    row 1 increasing with gaps, row 2 a shuffled permutation (offset by 3); all ``< 4*seq``."""
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
    positions = [torch.arange(seq), torch.randperm(4 * seq, generator=gen)[:seq].sort().values,
                 torch.randperm(seq, generator=gen) + 3]
    pos = torch.stack([positions[i % 3] for i in range(batch)])
    return {"tokens": stream[:, :-1], "labels": stream[:, 1:], "position_ids": pos,
            "weights": torch.rand(batch, seq, generator=gen, dtype=F64)}


def _rel(diff: Tensor, ref: Tensor) -> float:
    return (diff.abs().max() / ref.abs().max().clamp_min(1e-300)).item()


ToHF = Callable[[Dict[str, Tensor], GPTConfig], Dict[str, Tensor]]


def compare_with_hf(ours: GPTModel, hf: torch.nn.Module, to_hf: ToHF, batch: Dict[str, Tensor],
                    moe_aux: bool = False) -> Dict[str, float]:
    """Logits, per-token loss and every parameter gradient of ``ours`` against ``hf`` run on ``to_hf(ours)``.

    The scalar differentiated on both sides is ``sum(weights * per_token_loss)`` (plus, with ``moe_aux``, each
    MoE layer's :func:`_switch_aux_loss` on the reference side; ours attaches its aux loss through autograd with
    gradient scale 1). Asserts the tolerances above and returns the measured worst errors.
    """
    config = ours.config
    V = config.vocab_size
    tokens, labels, pos, w = batch["tokens"], batch["labels"], batch["position_ids"], batch["weights"]
    for router in ours._routers():
        router.aux_loss_scale = 1.0

    # ours: the training path (per-token loss from labels), and the logits path
    ours.zero_grad(set_to_none=True)
    loss = ours(tokens, pos, labels)
    our_aux = [m.router.aux_losses.get("aux_loss") for m in ours.moe_layers().values()]
    (loss * w).sum().backward()
    with torch.no_grad():
        logits = ours(tokens, pos)

    # reference: HF on the mapped weights, differentiated with respect to copies of our parameters
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in ours.named_parameters()}
    mapped = to_hf(leaves, config)
    hf_names = {n for n, _ in hf.named_parameters()}
    assert set(mapped) == hf_names, f"mapping misses {hf_names - set(mapped)}, extra {set(mapped) - hf_names}"
    extra = {"output_router_logits": True} if moe_aux else {}
    out = functional_call(hf, mapped, args=(), kwargs=dict(input_ids=tokens, position_ids=pos, use_cache=False,
                                                           attention_mask=torch.ones_like(tokens), **extra))
    ref_logits = out.logits
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)
    objective = (ref_loss * w).sum()
    if moe_aux:
        ref_aux = [_switch_aux_loss(z, config.moe_router_topk, config.moe_aux_loss_coeff) for z in out.router_logits]
        objective = objective + sum(ref_aux)
    objective.backward()

    errors = {"logits": _rel(logits[..., :V] - ref_logits, ref_logits),
              "loss": ((loss - ref_loss).abs() / ref_loss.abs()).max().item()}
    assert logits.dtype == F64 and loss.dtype == F64
    assert errors["logits"] < LOGITS_RTOL, errors
    assert errors["loss"] < LOSS_RTOL, errors
    if moe_aux:
        errors["aux"] = max(abs(a.item() - r.item()) / r.item() for a, r in zip(our_aux, ref_aux))
        assert errors["aux"] < LOSS_RTOL, errors
    grad_errors = {}
    for name, p in ours.named_parameters():
        ref = leaves[name].grad
        assert p.grad is not None and ref is not None, name
        grad_errors[name] = _rel(p.grad - ref, ref)
    worst = max(grad_errors, key=grad_errors.get)
    errors["grad"] = grad_errors[worst]
    assert errors["grad"] < GRAD_RTOL, f"{worst}: {grad_errors[worst]:.3g}"
    return errors


# --------------------------------------------------------------------------------------------- HF cases
LLAMA_CASES = {
    # GQA 4 heads / 2 groups, untied, vocab padded 100 -> 128
    "gqa-untied": dict(num_query_groups=2, vocab_size=100, make_vocab_size_divisible_by=64),
    # MQA, tied embeddings, kv_channels != hidden / heads, biases on every linear, another RoPE base and eps
    "mqa-tied-bias": dict(num_query_groups=1, kv_channels=24, untie_embeddings_and_output_weights=False,
                          add_bias_linear=True, rotary_base=500000, norm_epsilon=1e-6),
    # plain multi-head attention, 3 layers
    "mha": dict(num_layers=3, num_query_groups=4, ffn_hidden_size=96),
}


def _tiny(**overrides) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=96, seq_length=12, make_vocab_size_divisible_by=32)
    base.update(overrides)
    return GPTConfig(**base)


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_matches_hf(case):
    config = _tiny(**LLAMA_CASES[case])
    compare_with_hf(build_ours(config), hf_llama(config), llama_to_hf, make_batch(config))


@pytest.mark.parametrize("sliding_window", [None, 64])
def test_mistral_matches_hf(sliding_window):
    """Mistral is LLaMA plus a sliding window: off, or longer than the sequence (our attention is full causal)."""
    config = _tiny(num_query_groups=2, rotary_base=1000000)
    compare_with_hf(build_ours(config, seed=3), hf_mistral(config, sliding_window), llama_to_hf,
                    make_batch(config, seed=4))


@pytest.mark.parametrize("aux_loss_coeff", [0.0, 1e-2])
def test_mixtral_matches_hf(aux_loss_coeff):
    """Top-2 of 4 SwiGLU experts in every layer, softmax over the top-k logits (= Mixtral's renormalised top-k of
    the full softmax), dropless; with and without the load-balancing loss in the gradient."""
    config = _tiny(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=aux_loss_coeff,
                   moe_router_load_balancing_type="aux_loss")
    batch = make_batch(config, batch=4, seq=16, seed=5)
    compare_with_hf(build_ours(config, seed=6), hf_mixtral(config), llama_to_hf, batch, moe_aux=aux_loss_coeff > 0)


def test_switch_aux_loss_matches_hf_convention():
    """Our reference aux formula is HF's ``load_balancing_loss_func`` for one layer times ``coeff / topk`` (HF's
    token fraction counts top-k slots per token, Megatron's per routed slot); HF sums in float32."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    hf = load_balancing_loss_func((logits,), num_experts=6, top_k=2)
    assert abs(_switch_aux_loss(logits, 2, 0.3).item() - 0.3 / 2 * hf.item()) < 1e-6 * hf.item()


def test_gpt2_style_matches_hf():
    """LayerNorm, GELU (swiglu=False), add_bias_linear, learned absolute positions, tied embeddings."""
    config = _tiny(num_query_groups=4, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                   position_embedding_type="learned_absolute", max_position_embeddings=48,
                   untie_embeddings_and_output_weights=False, vocab_size=90, make_vocab_size_divisible_by=16)
    compare_with_hf(build_ours(config, seed=7), hf_gpt2(config), gpt2_to_hf, make_batch(config, seed=8))


def test_vocab_parallel_loss_path_in_float64():
    """The cross-entropy that tensor parallelism uses (run here on one rank: its max / sum-exp / target-logit
    arithmetic and hand-written backward, padded columns masked) against ``F.cross_entropy`` in float64."""
    from lightning_megatron.parallel.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

    gen = torch.Generator().manual_seed(3)
    V, V_pad = 50, 64
    logits = (3 * torch.randn(4, 5, V_pad, generator=gen, dtype=F64)).requires_grad_(True)
    target = torch.randint(0, V, (4, 5), generator=gen)
    w = torch.rand(4, 5, generator=gen, dtype=F64)
    loss = _VocabParallelCrossEntropy.apply(logits, target, None, V)
    (grad,) = torch.autograd.grad((loss * w).sum(), logits)
    ref_logits = logits.detach()[..., :V].requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, V), target.reshape(-1), reduction="none").view(4, 5)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), ref_logits)
    assert loss.dtype == F64
    torch.testing.assert_close(loss, ref, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad[..., :V], ref_grad, rtol=0, atol=1e-15)
    assert (grad[..., V:] == 0).all()


# ------------------------------------------------------------------------------------------- closed forms
def _inv_freq(dim: int, base: float) -> Tensor:
    return torch.tensor([base ** (-2.0 * i / dim) for i in range(dim // 2)], dtype=F64)


def test_rotary_rotates_each_pair_by_position_times_frequency():
    """Channel pair ``(i, i + d/2)`` of a head at position ``p`` is rotated by the angle ``p * base^(-2i/d)``."""
    s, b, n, d, base = 7, 2, 3, 16, 10000.0
    gen = torch.Generator().manual_seed(0)
    pos = torch.stack([torch.tensor([0, 1, 2, 5, 11, 30, 63]), torch.tensor([40, 3, 17, 0, 8, 9, 2])], dim=1)
    x = torch.randn(s, b, n, d, generator=gen, dtype=F64)
    out = apply_rotary(x, *rotary_cos_sin(pos, d, base, F64))
    angle = (pos.to(F64)[:, :, None] * _inv_freq(d, base))[:, :, None, :]  # [s, b, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    want = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)
    # float64 tables for a float64 dtype: measured max error 1.1e-16 (4.6e-16 relative on the pair norms)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    pair_norm = lambda t: t[..., : d // 2] ** 2 + t[..., d // 2:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(x), rtol=1e-12, atol=0)
    assert (out[0, 0] == x[0, 0]).all()  # position 0: identity


def test_rotary_scores_depend_only_on_relative_position():
    """``rope(q, m) . rope(k, n)`` is a function of ``m - n``, and it does change with ``m - n``."""
    d, base = 32, 10000.0
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, d, generator=gen, dtype=F64).unbind(0)

    def score(m: int, n: int) -> float:
        pos = torch.tensor([[m], [n]])
        cos, sin = rotary_cos_sin(pos, d, base, F64)
        x = torch.stack([q, k]).view(2, 1, 1, d)
        rq, rk = apply_rotary(x, cos, sin).view(2, d)
        return float(rq @ rk)

    for m, n in [(5, 2), (9, 9), (3, 8)]:
        for shift in (1, 7, 40):
            assert abs(score(m + shift, n + shift) - score(m, n)) < 1e-12   # measured <= 1.8e-15
    assert abs(score(5, 2) - score(5, 4)) > 1e-2
    assert abs(score(0, 0) - float(q @ k)) < 1e-12


def test_rotary_tables_of_the_default_positions_are_kept_at_a_fixed_address():
    """Without position ids the model's RoPE tables are computed once and the same tensors are used at every forward
    (per dtype; inference mode keeps its own beside them), marked as fixed addresses for compiled layers (a layer's CUDA graph then
    reads them where they are, as it does a parameter); given position ids, fresh tables. The values are the formula's
    either way, so a step's numbers do not change."""
    from lightning_megatron import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               vocab_size=64, seq_length=16))
    tokens = torch.zeros(2, 16, dtype=torch.long)
    x = torch.zeros(16, 2, 32)
    pos = model.positions(tokens)
    first = model.rotary(pos, x)
    assert model.positions(tokens) is pos and model.rotary(model.positions(tokens), x) is first
    assert all(hasattr(t, "_dynamo_static_input_type") for t in first)
    want = rotary_cos_sin(torch.arange(16).unsqueeze(1).expand(16, 2), 8, model.config.rotary_base, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(first, want))
    assert model.rotary(pos, x.double()) is not first                 # another dtype: its own tables
    with torch.inference_mode():
        inference = model.rotary(model.positions(tokens), x)
    assert inference is not first and all(t.is_inference() for t in inference)
    assert model.rotary(model.positions(tokens), x) is first            # kept beside the inference ones
    given = tokens.new_tensor([list(range(16))] * 2)
    assert model.rotary(model.positions(tokens, given), x) is not model.rotary(model.positions(tokens, given), x)
    assert model.positions(torch.zeros(3, 16, dtype=torch.long)) is not pos   # another batch size


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norm_matches_formula(kind):
    h, eps = 24, 1e-5
    gen = torch.Generator().manual_seed(2)
    norm = Norm(h, kind, eps).to(F64)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(h, generator=gen, dtype=F64))
        if norm.bias is not None:
            norm.bias.copy_(torch.randn(h, generator=gen, dtype=F64))
    x = 3.0 * torch.randn(5, 2, h, generator=gen, dtype=F64) + 1.5
    if kind == "RMSNorm":
        want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * norm.weight
    else:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
        want = (x - mean) / torch.sqrt(var + eps) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("heads,groups", [(4, 2), (6, 3), (4, 1), (4, 4)])
def test_split_heads_matches_per_group_indexing(heads, groups):
    """``SelfAttention._split_heads`` against :func:`qkv_rows`' per-group layout, on distinct values."""
    config = GPTConfig(hidden_size=8 * heads, num_attention_heads=heads, num_query_groups=groups, kv_channels=5)
    attention = SelfAttention(config)
    s, b, d = 3, 2, config.kv_channels
    width = groups * (heads // groups + 2) * d
    qkv = torch.arange(s * b * width, dtype=F64).view(s, b, width)
    q, k, v = attention._split_heads(qkv, None)
    q_rows, k_rows, v_rows = qkv_rows(config)
    assert q.shape == (s, b, heads, d) and k.shape == v.shape == (s, b, groups, d)
    assert torch.equal(q, qkv[..., q_rows].view(s, b, heads, d))
    assert torch.equal(k, qkv[..., k_rows].view(s, b, groups, d))
    assert torch.equal(v, qkv[..., v_rows].view(s, b, groups, d))
    # query head i shares key head i // (heads/groups): explicitly, for head 0 of the last group
    r = heads // groups
    base = (groups - 1) * (r + 2) * d
    assert torch.equal(q[:, :, (groups - 1) * r], qkv[..., base: base + d])
    assert torch.equal(k[:, :, groups - 1], qkv[..., base + r * d: base + (r + 1) * d])


def test_lr_schedule_closed_forms():
    """Warmup ``(step+1)/W``; after it, decay from ``lr`` to ``min_lr`` at ``decay_iters``; ``min_lr`` after."""
    lr, min_lr, W, D = 2.0, 0.2, 4, 14

    def at(step, style, warmup=W, decay=D):
        return megatron_lr_lambda(step, lr, min_lr, warmup, decay, style) * lr

    for style in ("cosine", "linear", "constant"):
        for step in range(W):
            assert at(step, style) == pytest.approx(lr * (step + 1) / W, rel=1e-15)
    for step in range(W, D):
        ratio = (step - W) / (D - W)
        cosine = min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))
        assert at(step, "cosine") == pytest.approx(cosine, rel=1e-14)
        assert at(step, "linear") == pytest.approx(lr - (lr - min_lr) * ratio, rel=1e-14)
        assert at(step, "constant") == lr
    # hand values: half way through the decay cosine and linear agree (both at the mid point)
    assert at(9, "cosine") == pytest.approx(1.1, rel=1e-14) and at(9, "linear") == pytest.approx(1.1, rel=1e-14)
    assert at(W, "cosine") == pytest.approx(lr, rel=1e-15)
    for step in (D, D + 1, 10 * D):
        assert at(step, "cosine") == pytest.approx(min_lr, rel=1e-15)
        assert at(step, "linear") == pytest.approx(min_lr, rel=1e-15)
        assert at(step, "constant") == lr
    # no warmup; no decay horizon
    assert at(0, "cosine", warmup=0) == lr
    assert at(5, "linear", warmup=0) == pytest.approx(lr - (lr - min_lr) * 5 / D, rel=1e-14)
    assert at(100, "cosine", decay=None) == lr
    with pytest.raises(ValueError, match="lr_decay_style"):
        megatron_lr_lambda(W + 1, lr, min_lr, W, D, "exponential")


def test_default_position_ids_are_left_out_on_the_host_and_give_the_same_loss():
    """A batch whose ``position_ids`` are ``arange(s)`` in every row loses them before it reaches the device (the
    model's default positions are those numbers, and its RoPE tables for them are kept); other positions stay. The
    loss is the same bit for bit either way."""
    from lightning_megatron import GPTConfig, GPTModel
    from lightning_megatron.models.module import without_default_positions

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    arange = torch.arange(16).expand(2, 16)
    batch = {"tokens": tokens, "labels": tokens, "position_ids": arange.clone()}
    assert "position_ids" not in without_default_positions(batch) and "position_ids" in batch
    shifted = dict(batch, position_ids=arange + 1)
    assert without_default_positions(shifted) is shifted
    one_row_off = dict(batch, position_ids=torch.stack([torch.arange(16), torch.arange(16).flip(0)]))
    assert without_default_positions(one_row_off) is one_row_off
    assert without_default_positions([tokens]) == [tokens]
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               vocab_size=64, seq_length=16))
    assert torch.equal(model(tokens, arange.clone(), tokens), model(tokens, None, tokens))
