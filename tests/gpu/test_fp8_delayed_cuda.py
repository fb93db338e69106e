"""The FP8 delayed recipe (torch backend) under ``compile=True`` on one GPU:

- the layers compile once, with histories (the first step runs them eagerly): as many dynamo graphs as tensorwise;
- the compiled run's losses are those of the eager run, to FP8-and-bf16 round-off;
- after the first step the per-step amax update reads nothing on the host: steps 2-4 make no synchronising CUDA call
  (``torch.cuda.set_sync_debug_mode("warn")``, as in ``test_nonfinite_device.py``).
"""
from __future__ import annotations

from typing import Dict, List

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronPrecision, MegatronStrategy
from tests.gpu.test_nonfinite_device import _SyncWatch
from tests.parity import SEED, ListDataset, StepLossRecorder, make_samples, new_module, tiny_config

STEPS = 6


def _fit(recipe: str, compile_: bool, callbacks: List[pl.Callback]) -> Dict[str, object]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config(hidden_size=64, ffn_hidden_size=128, seq_length=32)
    recorder = StepLossRecorder(1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=MegatronStrategy(compile=compile_),
                         plugins=[MegatronPrecision("bf16-mixed", fp8="hybrid", fp8_recipe=recipe, fp8_backend="torch")],
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[*callbacks, recorder])
    data = DataLoader(ListDataset(make_samples(cfg, 4 * STEPS)), batch_size=4, pin_memory=True)
    trainer.fit(new_module(cfg, STEPS, adamw="bf16_moments"), data)
    return dict(losses=recorder.losses, graphs=counters["stats"]["unique_graphs"],
                histories=trainer.strategy.parallelized.fp8.state_dict())


def test_compiled_delayed_recipe_compiles_once_matches_eager_and_never_synchronises(measured):
    watch = _SyncWatch()
    compiled = _fit("delayed", True, [watch])
    tensorwise = _fit("tensorwise", True, [])
    eager = _fit("delayed", False, [])
    worst = max(abs(a - b) / b for a, b in zip(compiled["losses"], eager["losses"]))
    measured(loss_vs_eager=worst, sync_calls=float(len(watch.seen)), graphs=float(compiled["graphs"]))
    assert compiled["graphs"] == tensorwise["graphs"], (compiled["graphs"], tensorwise["graphs"])
    assert worst < 2e-2, (compiled["losses"], eager["losses"])
    assert compiled["histories"] and all(bool((h[:, :1] > 0).all()) for h in compiled["histories"].values())
    assert watch.seen == [], "\n".join(watch.seen)
