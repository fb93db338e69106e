"""``StragglerMonitor`` on one GPU: its CUDA branch times each training batch with CUDA events (no sampler thread);
each report holds this rank's GPU time per step, above zero and at most the wall time per step, names no slow rank
alone, and the reports come every ``every_n_steps`` steps. (Naming a slow rank among several needs 2 GPUs; the CPU
tests cover it with gloo.)"""
from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy, StragglerMonitor
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config


def test_cuda_events_time_the_steps(measured) -> None:
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    monitor = StragglerMonitor(every_n_steps=2)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=MegatronStrategy(), max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[monitor])
    trainer.fit(new_module(cfg, 4), DataLoader(ListDataset(make_samples(cfg, 16)), batch_size=2))
    assert monitor._sampler is None   # the CUDA branch: events, no sampler thread
    assert [r["step"] for r in monitor.reports] == [2, 4], monitor.reports
    for report in monitor.reports:
        busy, step = report["busy_s"][0], report["step_s"][0]
        assert 0 < busy <= step * 1.05 and report["slow"] == [], report
    measured(busy_ms=1e3 * monitor.reports[-1]["busy_s"][0], step_ms=1e3 * monitor.reports[-1]["step_s"][0])
    assert torch.cuda.is_available()
