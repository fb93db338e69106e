"""What a Lightning user gets back and sees under MegatronStrategy (real gloo processes on CPU): a checkpoint written
by ``Trainer.fit`` restores the module through ``ParallelGPTModule.load_from_checkpoint``, and the model summary
(Lightning's ``ModelSummary`` callback) counts the whole model, not this rank's shards or pipeline stage."""
from __future__ import annotations

import logging
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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
