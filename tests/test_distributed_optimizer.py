"""``MegatronStrategy(use_distributed_optimizer=True)`` (Megatron's distributed optimizer, ZeRO-1 over dp x cp):
the same training as the single-process run, the states really sharded, and checkpoints equal to the unsharded
optimizer's (so they load under any layout, sharded or not)."""
from __future__ import annotations

from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from tests._dist import run_distributed
from tests.parity import (SEED, ListDataset, check_layout_matches_single_process, make_samples, new_module,
                          tiny_config, trainer_for)

CASES = {
    # id: (world, strategy kwargs, config overrides, micro-batches per step, clip)
    "dp2": (2, dict(), {}, 1, 0.05),
    "cp2xdp2": (4, dict(cp=2), {}, 1, None),
    "tp2xdp2-sp": (4, dict(tp=2, sequence_parallel=True), {}, 1, 0.05),
    "pp2xdp2": (4, dict(pp=2), {}, 2, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_optimizer_matches_single_process(case):
    world, kwargs, overrides, accumulate, clip = CASES[case]
    check_layout_matches_single_process(world, dict(kwargs, use_distributed_optimizer=True),
                                        tiny_config(**overrides), accumulate, clip)


class LocalStateSize(pl.Callback):
    """Elements of optimizer state this rank holds, and the parameters' elements, after training."""

    def on_train_end(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]
        local = getattr(opt, "optim", opt)  # the shard's own optimizer under the distributed optimizer
        self.state = sum(v.numel() for s in local.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
        self.params = sum(p.numel() for p in pl_module.parameters())


def _train_and_save(rank: int, world: int, kwargs: Dict[str, Any], samples, path: str):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(tiny_config(), 2)
    size = LocalStateSize()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), 2, callbacks=[size])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    trainer.save_checkpoint(path)
    return {"state": size.state, "params": size.params, "sharded": type(trainer.optimizers[0]).__name__}


def test_states_are_sharded_and_checkpoints_match_the_plain_optimizer(tmp_path):
    samples = make_samples(tiny_config(), 8)
    plain, sharded = str(tmp_path / "plain.ckpt"), str(tmp_path / "sharded.ckpt")
    plain_runs = run_distributed(_train_and_save, 2, dict(), samples, plain)
    sharded_runs = run_distributed(_train_and_save, 2, dict(use_distributed_optimizer=True), samples, sharded)
    # Adam keeps two tensors per parameter: the plain optimizer all of them on each rank, the sharded one a part
    params = plain_runs[0]["params"]
    assert all(r["state"] == 2 * params for r in plain_runs)
    assert all(r["sharded"] == "ZeroRedundancyOptimizer" for r in sharded_runs)
    assert sum(r["state"] for r in sharded_runs) == 2 * params
    assert all(0 < r["state"] < 2 * params * 0.75 for r in sharded_runs), [r["state"] for r in sharded_runs]
    # the checkpoint holds the whole state, name-keyed, as the plain optimizer's
    a = torch.load(plain, weights_only=False)
    b = torch.load(sharded, weights_only=False)
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) > 0
    for name, entry in sa["state"].items():
        for key, value in entry.items():
            other = sb["state"][name][key]
            if isinstance(value, torch.Tensor):
                assert torch.allclose(value.float(), other.float(), rtol=1e-5, atol=1e-8), (name, key)
            else:
                assert value == other, (name, key)
    assert [g["params"] for g in sa["param_groups"]] == [g["params"] for g in sb["param_groups"]]
    assert [g["lr"] for g in sa["param_groups"]] == pytest.approx([g["lr"] for g in sb["param_groups"]])
    for k, v in a["state_dict"].items():
        assert torch.allclose(v, b["state_dict"][k], rtol=1e-5, atol=1e-7), k


def test_distributed_optimizer_with_expert_parallel_is_refused():
    with pytest.raises(ValueError, match=r"use_distributed_optimizer=True with ep=2 is not supported yet"):
        MegatronStrategy(ep=2, use_distributed_optimizer=True)
