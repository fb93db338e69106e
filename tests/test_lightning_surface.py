"""What a Lightning user gets back and sees under MegatronStrategy (real gloo processes on CPU): a checkpoint written
by ``Trainer.fit`` restores the module through ``ParallelGPTModule.load_from_checkpoint``; the model summary
(Lightning's ``ModelSummary`` callback) counts the whole model, not this rank's shards or pipeline stage; a Hugging
Face checkpoint imported by ``python -m lightning_megatron.hf import`` trains through
``examples/pretrain_gpt.py --load``, and the docs/hf.md snippet runs as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from torch.utils.data import DataLoader

from lightning_megatron import GPTModel, MegatronStrategy, ParallelGPTModule
from tests._dist import run_distributed
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for

LAYOUTS = {
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
}


# ------------------------------------------------------------------------------------- load_from_checkpoint
def fit_and_save(rank: int, world: int, cfg, strategy_kwargs: Dict[str, Any], samples, dirpath: str):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, 2)
    accumulate = 2 if strategy_kwargs.get("pp", 1) > 1 else 1
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 2, precision="32-true",
                          accumulate_grad_batches=accumulate,
                          callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0)])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    return state if rank == 0 else None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_from_checkpoint_restores_the_module(tmp_path, layout):
    """``ParallelGPTModule.load_from_checkpoint(last.ckpt)`` of a checkpoint a real ``Trainer.fit`` wrote under tp2 +
    SP and pp2: the module comes back in one process with the run's config and hyper-parameters and exactly the
    trained weights (the saved hyper-parameters hold the config as a dict; ``__init__`` takes it)."""
    cfg = tiny_config(num_query_groups=4)
    samples = make_samples(cfg, 16)
    trained = run_distributed(fit_and_save, 2, cfg, LAYOUTS[layout], samples, str(tmp_path))[0]
    module = ParallelGPTModule.load_from_checkpoint(tmp_path / "last.ckpt")
    assert module.config == cfg
    assert (module.hparams.lr, module.hparams.weight_decay, module.hparams.lr_decay_iters) == (1e-3, 0.1, 2)
    assert isinstance(module.model, GPTModel)
    state = module.state_dict()
    assert state.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(state[key], value), key
    reference = new_module(cfg, 2)
    reference.configure_model()
    assert not torch.equal(state["model.embedding.word_embeddings.weight"],
                           reference.state_dict()["model.embedding.word_embeddings.weight"])   # trained, not fresh


# ------------------------------------------------------------------------------------- the model summary
class RecordedSummary(ModelSummary):
    """Lightning's ``ModelSummary`` callback, recording on rank 0 what it prints (its table and totals)."""

    printed: List[Dict[str, Any]] = []

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **kwargs) -> None:
        RecordedSummary.printed.append(dict(table=dict(summary_data), total=total_parameters,
                                            trainable=trainable_parameters, size_mb=model_size))


def summary_run(rank: int, world: int, cfg, strategy_kwargs: Dict[str, Any], samples, max_depth: int):
    pl.seed_everything(SEED, verbose=False)
    RecordedSummary.printed = []
    accumulate = 2 if strategy_kwargs.get("pp", 1) > 1 else 1
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1, precision="32-true",
                          accumulate_grad_batches=accumulate, callbacks=[RecordedSummary(max_depth=max_depth)])
    trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    return RecordedSummary.printed


SUMMARY_CASES = {   # name: (world, strategy kwargs, config overrides)
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True), dict(num_query_groups=4)),
    "pp2": (2, dict(pp=2), {}),
    "pp2-tied": (2, dict(pp=2), dict(untie_embeddings_and_output_weights=False)),
    "ep2": (2, dict(ep=2), dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)),
    "dp2": (2, dict(), {}),
}


@pytest.mark.parametrize("case", list(SUMMARY_CASES))
def test_model_summary_counts_the_whole_model(case):
    """Lightning's ``ModelSummary`` callback under tp2 + SP, pp2 (untied and tied embeddings), ep2 and dp2 prints the
    parameter count of the whole model, the count Lightning's DDP prints for the same module (the plain model's),
    in the totals and in the ``model`` row, and the size estimate from it; before, tp2's rank 0 printed its half and a
    pipeline stage its own layers. ``max_depth=2`` rows count their modules' full parameters over all stages."""
    world, kwargs, overrides = SUMMARY_CASES[case]
    cfg = tiny_config(**overrides)
    results = run_distributed(summary_run, world, cfg, kwargs, make_samples(cfg, 8), 2)
    plain = new_module(cfg, 1)
    plain.configure_model()
    params = dict(plain.named_parameters())
    whole = sum(p.numel() for p in params.values())
    assert all(r == [] for r in results[1:])   # printed on rank 0 only
    (printed,) = results[0]
    assert printed["total"] == printed["trainable"] == whole, (printed["total"], whole)
    assert abs(printed["size_mb"] - whole * 4e-6) < 1e-9
    rows = dict(zip(printed["table"]["Name"], printed["table"]["Params"]))
    assert rows["model"] == get_human_readable_count(whole), rows
    for row in ("model.embedding", "model.decoder"):
        want = sum(p.numel() for k, p in params.items() if k.startswith(row + "."))
        assert rows[row] == get_human_readable_count(want), (row, rows)


# ------------------------------------------------------------------------------------- Hugging Face checkpoints
ROOT = Path(__file__).resolve().parents[1]
HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)   # transformers' default rms_norm_eps: 1e-6
#: the pretrain_gpt.py flags of that model
HF_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "128", "--max-position-embeddings", "64",
            "--norm-epsilon", "1e-6", "--vocab-size", "256"]


def save_tiny_llama(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE)).save_pretrained(str(path))


def run_script(cmd: List[str], cwd: Path, timeout: int = 300) -> str:
    env = dict(os.environ, HOME=str(cwd / "home"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return log


def test_hf_import_trains_through_pretrain_gpt_load(tmp_path):
    """``python -m lightning_megatron.hf import`` writes a checkpoint of weights only (no optimizer state, no
    iteration); ``examples/pretrain_gpt.py --load`` of it (tp=2 + SP, the model's flags) starts from those weights at
    iteration 0 instead of resuming (before: ``KeyError: 'pytorch-lightning_version'``). With a learning rate of 0 the
    weights after 3 steps are the imported ones exactly; fresh ones would differ."""
    from lightning_megatron.hf.__main__ import main

    save_tiny_llama(tmp_path / "src")
    assert main(["import", str(tmp_path / "src"), str(tmp_path / "llama.ckpt"), "--seq-length", "32"]) == 0
    log = run_script([sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), *HF_FLAGS, "--seq-length", "32",
                      "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
                      "--eval-interval", "3", "--eval-iters", "1", "--lr", "0", "--min-lr", "0", "--load", "llama.ckpt",
                      "--save", "ckpt"], tmp_path)
    assert "training starts from these weights at iteration 0 with a fresh optimizer" in log, log[-3000:]
    imported = torch.load(tmp_path / "llama.ckpt", weights_only=False)["state_dict"]
    trained = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert trained["global_step"] == 3
    assert trained["state_dict"].keys() == imported.keys()
    for key, value in imported.items():
        assert torch.equal(trained["state_dict"][key], value), key


HF_SNIPPET = re.compile(r"## Start from a Hugging Face checkpoint\n\n```python\n(.*?)^```", re.S | re.M)


def test_hf_docs_snippet_runs(tmp_path):
    """The first snippet of docs/hf.md, run as a script as written, with only the checkpoint directory (a tiny Llama
    saved by transformers here) and the GPUs (CPU processes) replaced: it fine-tunes under tp=2 x pp=2 and
    ``export_hf`` writes a directory transformers loads, with the fine-tuned weights."""
    transformers = pytest.importorskip("transformers")
    code = HF_SNIPPET.search((ROOT / "docs" / "hf.md").read_text(encoding="utf-8")).group(1)
    replaced = code.replace('"Meta-Llama-3.1-8B/"', repr(str(tmp_path / "src"))).replace(
        'accelerator="gpu"', 'accelerator="cpu"').replace("seq_length=8192", "seq_length=32")
    assert replaced.count(repr(str(tmp_path / "src"))) == 1 and 'accelerator="cpu"' in replaced, code
    save_tiny_llama(tmp_path / "src")
    (tmp_path / "snippet.py").write_text(replaced, encoding="utf-8")
    run_script([sys.executable, "snippet.py"], tmp_path, timeout=600)
    source = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "src"))
    tuned = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "finetuned"))
    weight = "model.layers.0.mlp.down_proj.weight"
    a, b = source.state_dict()[weight], tuned.state_dict()[weight]
    assert a.shape == b.shape and not torch.equal(a, b) and torch.allclose(a, b, atol=0.05)   # fine-tuned, a little
