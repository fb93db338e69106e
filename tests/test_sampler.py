"""Data sharding by data-parallel rank under MegatronStrategy, with a real Lightning Trainer on 4 gloo processes.

tp=2 x dp=2: TP peers (ranks 0, 1 and 2, 3) must see identical batches, the two data-parallel groups
disjoint ones that together cover the data, and ``distributed_sampler_kwargs`` must be
``{"num_replicas": dp, "rank": dp_rank}``.
"""
from __future__ import annotations

from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from tests._dist import run_distributed
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for

STEPS, MICRO_BATCH, WORLD, TP = 2, 2, 4, 2


class BatchRecorder(pl.Callback):
    def __init__(self) -> None:
        self.batches: List[List[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch["index"].tolist())


def _sampler_worker(rank: int, world: int) -> Dict[str, Any]:
    from lightning_megatron import MegatronStrategy

    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config(num_layers=1)
    samples = make_samples(cfg, STEPS * MICRO_BATCH * (world // TP))
    for i, s in enumerate(samples):
        s["index"] = i
    recorder = BatchRecorder()
    trainer = trainer_for(world, MegatronStrategy(tp=TP), STEPS, callbacks=[recorder])
    trainer.fit(new_module(cfg, STEPS), DataLoader(ListDataset(samples), batch_size=MICRO_BATCH, shuffle=True))
    mesh = trainer.strategy.mesh
    return {"batches": recorder.batches, "sampler_kwargs": trainer.strategy.distributed_sampler_kwargs,
            "dp_rank": mesh.rank("dp"), "tp_rank": mesh.rank("tp"), "global_rank": trainer.global_rank}


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_distributed(_sampler_worker, WORLD)


def test_tp_peers_share_batches_dp_groups_split_data(results):
    assert [r["global_rank"] for r in results] == [0, 1, 2, 3]
    assert [(r["dp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert len(r["batches"]) == STEPS and all(len(b) == MICRO_BATCH for b in r["batches"]), r["batches"]
    assert results[0]["batches"] == results[1]["batches"]
    assert results[2]["batches"] == results[3]["batches"]
    seen0 = {i for b in results[0]["batches"] for i in b}
    seen1 = {i for b in results[2]["batches"] for i in b}
    assert not seen0 & seen1, (results[0]["batches"], results[2]["batches"])
    assert seen0 | seen1 == set(range(STEPS * MICRO_BATCH * WORLD // TP))


def test_distributed_sampler_kwargs(results):
    for r in results:
        assert r["sampler_kwargs"] == {"num_replicas": 2, "rank": r["global_rank"] // TP}
