"""What a Lightning user gets back and sees under MegatronStrategy (real gloo processes on CPU): a checkpoint written
by ``Trainer.fit`` restores the module through ``ParallelGPTModule.load_from_checkpoint``, and the model summary
(Lightning's ``ModelSummary`` callback) counts the whole model, not this rank's shards or pipeline stage."""
from __future__ import annotations

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
