"""Transformer Engine's FP8 GEMMs under ``MegatronStrategy(compile=True)``, one GPU (skipped without
``transformer_engine``): the compiled run trains every transformer-layer linear through TE (delayed scaling, hybrid
format), its losses follow the eager TE run's, and the layers are compiled with TE's GEMMs left out of the graphs.
"""
from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronPrecision, MegatronStrategy
from lightning_megatron.precision.fp8 import TransformerEngineGemm, transformer_engine_available
from tests.parity import SEED, ListDataset, LossRecorder, make_samples, new_module, tiny_config, trainer_for

STEPS = 6

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not transformer_engine_available(),
                                reason="needs CUDA and transformer_engine (see shared/te/README.md to bring it)")


def _fit(compile_: bool):
    """``STEPS`` steps of a small model (FP8 needs dimensions that are multiples of 16); returns the losses and
    the strategy."""
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      seq_length=64, vocab_size=256)
    strategy = MegatronStrategy(compile=compile_)
    plugin = MegatronPrecision("bf16-mixed", fp8="hybrid", fp8_recipe="delayed", fp8_backend="te")
    losses = LossRecorder()
    trainer = trainer_for(1, strategy, STEPS, accelerator="gpu", plugins=[plugin], callbacks=[losses])
    # one batch seen every step: the loss must fall (random tokens never seen twice would not)
    data = DataLoader(ListDataset(make_samples(cfg, 4) * STEPS), batch_size=4, pin_memory=True)
    trainer.fit(new_module(cfg, STEPS), data)
    return losses.losses, strategy


def test_te_fp8_gemms_train_under_compile_like_eager(measured):
    eager, _ = _fit(False)
    compiled, strategy = _fit(True)
    fp8 = strategy.parallelized.fp8
    gemms = [m.fp8_gemm for m in strategy.parallelized.module.modules() if hasattr(m, "fp8_gemm")]
    facts = dict(backend=fp8.config.backend if fp8 else None, converted=len(fp8.converted) if fp8 else 0,
                 gemms=len(gemms), through_te=sum(isinstance(g, TransformerEngineGemm) and g._linear is not None
                                                  for g in gemms), compiled=compiled, eager=eager)
    assert facts["backend"] == "te" and facts["converted"] == facts["gemms"] == facts["through_te"] > 0, facts
    assert all(math.isfinite(x) for x in compiled) and compiled[-1] < compiled[0] - 0.1, facts
    worst = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
    measured(max_rel_loss_diff=worst, steps=STEPS)
    assert worst < 2e-2, facts
