"""Hugging Face interop and generation against ``transformers`` itself, on tiny random models saved by
``transformers`` (sharded safetensors with an index) into temporary directories.

One spawn of 2 gloo processes runs the distributed cases (``run_each``): Llama imported under tp=2 with sequence
parallelism (logits equal to HF's, greedy generation equal to HF's, 5 training steps, export, HF loads the export
with logits equal to ours), Mixtral the same under ep=2, Llama with tied embeddings imported under pp=2 (logits and
greedy generation). The single-process cases: Mistral and Llama-3.1 RoPE scaling round trips, generation, config
mapping and errors, the command line.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
import transformers
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, GPTModel, MegatronStrategy, ParallelGPTModule
from lightning_megatron.hf import HFCheckpointLoader, config_from_hf, config_to_hf, export_hf, load_hf_weights
from lightning_megatron.models.generation import sample_next_token
from tests._dist import run_distributed, run_each
from tests.parity import ListDataset, trainer_for

V, SEQ = 100, 16
SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
ATOL, RTOL = 2e-5, 1e-4   # float32 logits of order one


def hf_model(kind: str, tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """A tiny random HF model; weights ``N(0, 1/fan_in)`` and norm weights ``1 + N(0, 0.2)`` (logits of order one,
    so a wrong head / group / expert mapping shows) instead of HF's 0.02-std initialisation."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=tied, **SHAPE))
    elif kind == "llama3.1":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_parameters=rope, rms_norm_eps=1e-5,
                                                                       **SHAPE))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **SHAPE))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                           **SHAPE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model.eval()


def save(kind: str, path: str, tied: bool = False) -> torch.nn.Module:
    model = hf_model(kind, tied)
    model.save_pretrained(path, max_shard_size="20KB")   # several files and an index
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return model


def tokens(batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, V, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, attention_mask=torch.ones_like(ids)).logits


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                          pad_token_id=0)


def our_config(path: str) -> GPTConfig:
    return config_from_hf(path, seq_length=SEQ, make_vocab_size_divisible_by=16)   # padded: 112 (tp1), 128 (tp2)


# ------------------------------------------------------------------------------------------ distributed
class Probe(pl.Callback):
    """At the start of fit, after the loader: this rank's logits of ``ids`` and a greedy continuation."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.out: Dict[str, Any] = {}

    def on_fit_start(self, trainer, module) -> None:
        self.out["before"] = local_logits(module, self.ids)
        self.out["generated"] = module.generate(self.ids[:, :5], 6)


@torch.no_grad()
def local_logits(module: ParallelGPTModule, ids: torch.Tensor) -> torch.Tensor:
    module.model.eval()
    out = module.model.logits(ids).transpose(0, 1).clone()   # [b, s, V_pad/tp]
    module.model.train()
    return out


def train_samples(n: int) -> list:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (SEQ + 1,), generator=g)
        out.append({"tokens": ids[:-1], "labels": ids[1:]})
    return out


def import_train_export(rank, world, src, dst, layout):
    """Import under ``layout`` (the loader callback), probe, train 5 steps, probe, export."""
    pl.seed_everything(1, verbose=False)
    module = ParallelGPTModule(our_config(src), lr=1e-2, weight_decay=0.0)
    probe = Probe(tokens())
    trainer = trainer_for(world, MegatronStrategy(**layout), 5, callbacks=[HFCheckpointLoader(src), probe],
                          precision="32-true")   # compared with the float32 Hugging Face model
    trainer.fit(module, DataLoader(ListDataset(train_samples(10)), batch_size=1))
    probe.out["after"] = local_logits(module, tokens())
    export_hf(module, dst)
    return probe.out


def import_pipeline(rank, world, src, dst, layout):
    """Import under pp=2 (the loader at predict start): predicted logits and a greedy continuation; export."""
    pl.seed_everything(1, verbose=False)
    module = ParallelGPTModule(our_config(src))
    trainer = trainer_for(world, MegatronStrategy(**layout), 1, callbacks=[HFCheckpointLoader(src)],
                          precision="32-true")   # compared with the float32 Hugging Face model
    ids = tokens()
    [logits] = trainer.predict(module, DataLoader(ListDataset([{"tokens": t} for t in ids]), batch_size=2))
    out = {"logits": logits, "generated": module.generate(ids[:, :5], 6)}
    export_hf(module, dst)   # the stages' tensors merged over the pipeline group
    return out


class LoadStateDictAtStart(pl.Callback):
    """At train start, after setup: the module's own ``load_state_dict`` of the state the strategy reports (its
    tensors scaled by 1.5 and rounded to bf16, so that the written values are exact in the bf16 copies)."""

    def __init__(self) -> None:
        self.written: Dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, module) -> None:
        state = {k: (v.detach().float() * 1.5).to(torch.bfloat16) for k, v in module.state_dict().items()}
        module.load_state_dict({k: v.to(module.state_dict()[k].dtype) for k, v in state.items()})
        self.written = {k: v.float().clone() for k, v in state.items()}


def import_bf16_params(rank, world, src, layout, how):
    """bf16 parameters (``MegatronPrecision(params_dtype=torch.bfloat16)``): weights written after setup (``how``:
    ``"loader"``, the HF loader callback; ``"load_state_dict"``, the module's own) and then 2 AdamW steps at
    ``lr=1e-9``: this rank's local fp32 main parameters after them, and what was written."""
    from lightning_megatron import MegatronPrecision

    pl.seed_everything(1, verbose=False)
    module = ParallelGPTModule(our_config(src), lr=1e-9, min_lr=1e-9, weight_decay=0.0)
    writer = HFCheckpointLoader(src) if how == "loader" else LoadStateDictAtStart()
    trainer = trainer_for(world, MegatronStrategy(**layout), 2, callbacks=[writer],
                          plugins=[MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16)])
    trainer.fit(module, DataLoader(ListDataset(train_samples(8)), batch_size=1))
    with trainer.strategy.parallelized.main_params.main_view():
        local = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    reference = None
    if how == "loader":   # the same checkpoint read into an unparallelised float32 model of this rank's layout
        model = ParallelGPTModule(our_config(src))
        model.configure_model()
        load_hf_weights(model, src)
        reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"local": local, "written": getattr(writer, "written", None), "reference": reference}


def run_case(rank, world, fn, *args):
    return fn(rank, world, *args)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    models = {"llama": save("llama", str(root / "llama")), "mixtral": save("mixtral", str(root / "mixtral")),
              "tied": save("llama", str(root / "tied"), tied=True)}
    cases = [
        ("llama-tp2", (import_train_export, str(root / "llama"), str(root / "llama-out"),
                       dict(tp=2, sequence_parallel=True))),
        ("mixtral-ep2", (import_train_export, str(root / "mixtral"), str(root / "mixtral-out"), dict(ep=2))),
        ("tied-pp2", (import_pipeline, str(root / "tied"), str(root / "tied-out"),
                      dict(pp=2, pipeline_schedule="gpipe"))),
        ("bf16p-pp2-loader", (import_bf16_params, str(root / "llama"), dict(pp=2, pipeline_schedule="gpipe"),
                              "loader")),
        ("bf16p-dp2-loader", (import_bf16_params, str(root / "llama"), dict(), "loader")),
        ("bf16p-tp2-load_state_dict", (import_bf16_params, str(root / "llama"), dict(tp=2, sequence_parallel=True),
                                       "load_state_dict")),
    ]
    results = run_distributed(run_each, 2, run_case, cases)
    return {"root": root, "models": models, "results": results}


def _result(distributed, name: str) -> list:
    per_rank = [r[name] for r in distributed["results"]]
    for r in per_rank:
        assert not isinstance(r, str), r   # a traceback
    return per_rank


def _check_round_trip(distributed, case: str, kind: str, vocab_slices: bool) -> None:
    ranks = _result(distributed, case)
    ref = distributed["models"][kind]
    ids = tokens()
    full = (lambda key: torch.cat([r[key] for r in ranks], dim=-1)) if vocab_slices else (lambda key: ranks[0][key])
    if not vocab_slices:   # every rank holds the whole model
        for r in ranks[1:]:
            torch.testing.assert_close(r["before"], ranks[0]["before"], atol=ATOL, rtol=RTOL)
    before, after = full("before"), full("after")
    assert before.shape[-1] > V   # padded vocabulary rows exist on our side ...
    torch.testing.assert_close(before[..., :V], hf_logits(ref, ids), atol=ATOL, rtol=RTOL)
    want = hf_greedy(ref, ids[:, :5], 6)
    for r in ranks:
        assert torch.equal(r["generated"], want), (r["generated"], want)
    assert (after[..., :V] - before[..., :V]).abs().max() > 1e-2   # 5 steps changed the model
    out = os.path.join(distributed["root"], f"{kind}-out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.vocab_size == V   # ... and are not exported
    torch.testing.assert_close(after[..., :V], hf_logits(exported, ids), atol=ATOL, rtol=RTOL)


def test_llama_tp2_import_train_export(distributed):
    """tp=2 with sequence parallelism: each rank reads its rows / columns (vocabulary padded to 128); logits and
    greedy generation equal HF's; after 5 steps the export loads in transformers with logits equal to ours."""
    _check_round_trip(distributed, "llama-tp2", "llama", vocab_slices=True)


def test_mixtral_ep2_import_train_export(distributed):
    """ep=2 (dp=2): each rank reads its two experts; the same round trip."""
    _check_round_trip(distributed, "mixtral-ep2", "mixtral", vocab_slices=False)


def test_pp2_import_and_generate(distributed):
    """pp=2 with tied embeddings (the last stage reads the word embeddings too): predicted logits and greedy
    generation (activations passed between the stages, tokens broadcast from the last) equal HF's; the export
    (stages merged) reloads with HF's logits and tied embeddings."""
    ranks = _result(distributed, "tied-pp2")
    ref, ids = distributed["models"]["tied"], tokens()
    for r in ranks:
        torch.testing.assert_close(r["logits"][..., :V], hf_logits(ref, ids), atol=ATOL, rtol=RTOL)
        assert torch.equal(r["generated"], hf_greedy(ref, ids[:, :5], 6))
    exported = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(distributed["root"], "tied-out"))
    assert exported.config.tie_word_embeddings
    torch.testing.assert_close(hf_logits(exported.eval(), ids), hf_logits(ref, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["bf16p-pp2-loader", "bf16p-dp2-loader"])
def test_import_with_bf16_parameters_survives_the_optimizer_steps(distributed, case):
    """bf16 parameters: the loader writes the fp32 main parameters (not only the bf16 copies, which the first
    optimizer step would overwrite with the main parameters of the random initialisation); after 2 steps at
    lr=1e-9 every main parameter equals the imported float32 tensor (pp=2: each stage its own; dp=2: whole)."""
    for r in _result(distributed, case):
        local, ref = r["local"], r["reference"]
        assert local, "no parameters compared"
        for k, v in local.items():
            want = ref[k] if ref[k].shape == v.shape else None
            assert want is not None, (k, v.shape, ref[k].shape)
            assert (v - want).abs().max() <= 1e-6, (k, float((v - want).abs().max()))


def test_load_state_dict_with_bf16_parameters_survives_the_optimizer_steps(distributed):
    """bf16 parameters under tp=2 + SP: the module's own ``load_state_dict`` in the compute view writes the bf16
    copies, which become the main parameters (a load_state_dict post-hook); the steps at lr=1e-9 keep them."""
    for r in _result(distributed, "bf16p-tp2-load_state_dict"):
        assert r["written"]
        for k, v in r["local"].items():
            assert (v - r["written"][k]).abs().max() <= 1e-6, (k, float((v - r["written"][k]).abs().max()))


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("kind", ["mistral", "llama3.1"])
def test_single_process_round_trip_and_generate(kind, tmp_path):
    """Mistral, and Llama-3.1 RoPE scaling (original context 8 < 16 positions, so all three frequency bands are
    used): logits, greedy generation with the KV cache, export, reload."""
    ref = save(kind, str(tmp_path / "src"))
    config = our_config(str(tmp_path / "src"))
    assert config.rope_scaling == (kind == "llama3.1")
    module = ParallelGPTModule(config)
    module.configure_model()
    load_hf_weights(module, tmp_path / "src")
    ids = tokens()
    with torch.no_grad():
        ours = module.eval()(ids)[..., :V]
    torch.testing.assert_close(ours, hf_logits(ref, ids), atol=ATOL, rtol=RTOL)
    assert torch.equal(module.generate(ids[:, :4], 10), hf_greedy(ref, ids[:, :4], 10))
    export_hf(module, tmp_path / "out", architecture="MistralForCausalLM" if kind == "mistral" else None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == type(ref).__name__
    torch.testing.assert_close(hf_logits(back, ids), ours, atol=ATOL, rtol=RTOL)


def test_kv_cache_matches_full_forward():
    """Decoding one token at a time with the cache gives the full forward's logits at every position, and a
    sample never picks a padded vocabulary id even where the padded logits are the largest."""
    from lightning_megatron.models.kv_cache import KVCache

    config = GPTConfig.tiny(vocab_size=90, make_vocab_size_divisible_by=64, num_layers=2)
    module = ParallelGPTModule(config)
    module.configure_model()
    model = module.model.eval()
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.logits(ids)
        cache = KVCache()
        first = model.logits(ids[:, :5], kv_cache=cache)
        rest = [model.logits(ids[:, i:i + 1], torch.full((2, 1), i), kv_cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat([first] + rest), full, atol=1e-5, rtol=1e-5)
    logits = torch.zeros(3, 90)
    assert (sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(0)) < 90).all()
    with torch.no_grad():
        model.output_layer.weight[90:] = 100.0   # padded rows would win every argmax
    assert (module.generate(ids[:, :3], 4)[:, 3:] < 90).all()


def test_sampling_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next_token(logits, 1.0, top_k=2, generator=g).tolist()) == {0, 1}
    # top_p 0.7: softmax = [.64, .24, .09, ...]: the nucleus is {0, 1}
    assert set(sample_next_token(logits, 1.0, top_p=0.7, generator=g).tolist()) == {0, 1}
    assert set(sample_next_token(logits, 1.0, top_p=0.5, generator=g).tolist()) == {0}
    assert set(sample_next_token(logits, 1.0, generator=g).tolist()) == {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="temperature"):
        ParallelGPTModule(GPTConfig.tiny()).generate(torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1.0)


def test_config_mapping(tmp_path):
    """The epsilon default of each transformers class, GQA, head_dim, tied embeddings, RoPE scaling, Mixtral's
    router fields; config_to_hf inverts it; unsupported configs are refused by name."""
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
          "num_hidden_layers": 3, "intermediate_size": 96, "vocab_size": 500, "max_position_embeddings": 131072,
          "rope_theta": 500000.0, "tie_word_embeddings": True,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}
    c = config_from_hf(hf)
    assert (c.norm_epsilon, c.num_query_groups, c.kv_channels, c.rotary_base) == (1e-6, 2, 8, 500000)
    assert c.rope_scaling and c.rope_scaling_factor == 8.0 and not c.untie_embeddings_and_output_weights
    assert c.seq_length == 4096 and c.max_position_embeddings == 131072
    back = config_from_hf(config_to_hf(c))
    assert back.to_dict() == c.to_dict()
    assert config_from_hf({**hf, "architectures": ["MixtralForCausalLM"]}).norm_epsilon == 1e-5
    mixtral = config_from_hf({**hf, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                              "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02})
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_aux_loss_coeff) == (8, 2, 0.02)
    assert config_from_hf(config_to_hf(mixtral)).to_dict() == mixtral.to_dict()
    assert GPTConfig.llama3_1_8b().rope_scaling and GPTConfig.llama3_1_8b().max_position_embeddings == 131072
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**hf, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="unsupported Hugging Face model"):
        config_from_hf({**hf, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="normalization='LayerNorm'"):
        config_to_hf(GPTConfig.tiny(normalization="LayerNorm"))
    ref = save("llama", str(tmp_path / "llama"))
    wrong = ParallelGPTModule(our_config(str(tmp_path / "llama")).replace(ffn_hidden_size=64))
    wrong.configure_model()
    with pytest.raises(ValueError, match="linear_fc1.weight"):
        load_hf_weights(wrong, tmp_path / "llama")
    del ref


def test_command_line_import_export(tmp_path, capsys):
    """``python -m lightning_megatron.hf import`` then ``export``: transformers loads the result with the source's
    logits (Mixtral: per-expert tensors both ways); a missing directory is one error line, exit code 2."""
    from lightning_megatron.hf.__main__ import main

    ref = save("mixtral", str(tmp_path / "src"))
    assert main(["import", str(tmp_path / "src"), str(tmp_path / "m.ckpt"), "--seq-length", "16"]) == 0
    state = torch.load(tmp_path / "m.ckpt", weights_only=False)
    assert state["hyper_parameters"]["config"]["num_moe_experts"] == 4
    assert main(["export", str(tmp_path / "m.ckpt"), str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = tokens()
    torch.testing.assert_close(hf_logits(back, ids), hf_logits(ref, ids), atol=ATOL, rtol=RTOL)
    capsys.readouterr()
    assert main(["import", str(tmp_path / "missing"), str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err and "Traceback" not in err


def test_missing_safetensors_is_a_clear_error(monkeypatch, tmp_path):
    """Without the optional package the error names it and the extra to install."""
    from lightning_utilities.core.imports import RequirementCache

    import lightning_megatron.hf._require as require

    monkeypatch.setattr(require, "SAFETENSORS", RequirementCache("safetensors-not-installed-here"))
    with pytest.raises(ModuleNotFoundError, match=r"lightning-megatron\[hf\]"):
        load_hf_weights(GPTModel(GPTConfig.tiny()), tmp_path)
