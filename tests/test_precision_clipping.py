"""Gradient clipping under bf16-mixed with a fused optimizer (what ParallelGPTModule builds on CUDA).

Lightning's MixedPrecision refuses to clip for any optimizer that "handles unscaling" (fused AdamW), although
bf16-mixed has no scaler to unscale with. MegatronStrategy lifts that refusal for bf16 only. The CPU has a
fused AdamW too, so the GPU path is reproduced here: a fused run must clip exactly like a foreach run.
"""
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from tests.parity import SEED, ListDataset, collate, make_samples, new_module, tiny_config, trainer_for


def _adamw(fused: bool):
    class AdamW(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            kwargs["fused"] = fused or None
            super().__init__(params, **kwargs)

    return AdamW


def _train(monkeypatch, fused: bool, precision: str, clip: float):
    cfg = tiny_config()
    samples = make_samples(cfg, 8)
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, 3)
    with monkeypatch.context() as m:  # ParallelGPTModule builds torch.optim.AdamW in configure_optimizers
        m.setattr(torch.optim, "AdamW", _adamw(fused))
        trainer = trainer_for(1, MegatronStrategy(), 3, precision=precision, gradient_clip_val=clip)
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=4, collate_fn=collate))
    return trainer.optimizers[0], {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_bf16_mixed_clips_with_fused_optimizer_like_foreach(monkeypatch):
    clip = 1e-3  # far below the gradient norm, so every step is clipped
    opt_fused, fused = _train(monkeypatch, True, "bf16-mixed", clip)
    assert getattr(opt_fused, "_step_supports_amp_scaling", False), "the fused optimizer was not used"
    _, foreach = _train(monkeypatch, False, "bf16-mixed", clip)
    _, unclipped = _train(monkeypatch, False, "bf16-mixed", 0.0)
    for k in fused:
        torch.testing.assert_close(fused[k], foreach[k], rtol=1e-5, atol=1e-6)
    assert any((foreach[k] - unclipped[k]).abs().max() > 1e-4 for k in foreach), "clipping had no effect"
