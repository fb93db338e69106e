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
from tests.parity import (SEED, ListDataset, assert_state_close, check_layout_matches_single_process, make_samples,
                          new_module, tiny_config, trainer_for)

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
        local = getattr(opt, "inner", opt)  # the optimizer over this rank's shard under the distributed optimizer
        states = local.state.values() if local is not None else []
        self.state = sum(v.numel() for s in states for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
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
    assert all(r["sharded"] == "DistributedOptimizer" for r in sharded_runs)
    assert sum(r["state"] for r in sharded_runs) == 2 * params
    assert all(0 < r["state"] < 2 * params * 0.75 for r in sharded_runs), [r["state"] for r in sharded_runs]
    # the checkpoint holds the whole state, name-keyed, as the plain optimizer's
    a = torch.load(plain, weights_only=True)
    b = torch.load(sharded, weights_only=True)
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


# ------------------------------------------------------------------------------------------- expert parallelism
EP_CASES = {
    # id: (world, strategy kwargs, config overrides, micro-batches per step, clip); dense states over dp x cp,
    # the routed experts' over edp
    "ep2xdp4-edp2": (4, dict(ep=2), {}, 1, 0.05),
    "ep2xdp2-edp1": (2, dict(ep=2), {}, 1, None),
    "ep2xtp2-sp-etp1-edp2": (4, dict(ep=2, tp=2, etp=1, sequence_parallel=True), {}, 1, 0.05),
    "ep2xpp2-expertbias": (4, dict(ep=2, pp=2), dict(moe_layer_freq=[1, 0], moe_router_score_function="sigmoid",
                                                   moe_router_enable_expert_bias=True,
                                                   moe_router_bias_update_rate=0.05), 2, 0.05),
}


@pytest.mark.parametrize("case", list(EP_CASES))
def test_distributed_optimizer_with_expert_parallel_matches_single_process(case):
    """Against the single-process MoE run of tests/test_parity_moe.py (aux losses scaled like the main loss):
    the loss and aux loss of every step within 1e-5, the final weights within 1e-5."""
    from tests.test_parity_moe import STEPS, moe_config, moe_layout_run, moe_reference

    world, kwargs, overrides, accumulate, clip = EP_CASES[case]
    cfg = moe_config(**overrides)
    dp = world // (kwargs.get("tp", 1) * kwargs.get("pp", 1))
    samples = make_samples(cfg, STEPS * accumulate * 2 * dp)
    ref_losses, ref_aux, ref_state = moe_reference(cfg, samples, 2 * dp, accumulate, clip)
    results = run_distributed(moe_layout_run, world, cfg, dict(kwargs, use_distributed_optimizer=True), samples, 2,
                              accumulate, clip)
    for r in results:
        assert len(r["losses"]) == STEPS
        for got, want in zip(r["losses"] + r["aux"], ref_losses + ref_aux):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["aux"], ref_losses, ref_aux)
    assert_state_close(results[0]["state"], ref_state)


class ExpertStateSize(pl.Callback):
    """Elements of optimizer state this rank holds for the routed experts and for the rest, and the parameters'."""

    def on_train_end(self, trainer, pl_module) -> None:
        from lightning_megatron.parallel.expert_parallel import expert_parameters

        experts = {id(p) for p in expert_parameters(pl_module)}
        opt = trainer.optimizers[0]
        # the distributed optimizer steps fragments of the parameters (each bucket's shard of this rank)
        owner = {id(f.tensor): f.param for f in getattr(opt, "fragments", [])}
        local = getattr(opt, "inner", opt)
        self.sizes = {"expert": 0, "dense": 0}
        for p, s in (local.state.items() if local is not None else []):
            kind = "expert" if id(owner.get(id(p), p)) in experts else "dense"
            self.sizes[kind] += sum(v.numel() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        self.params = {"expert": sum(p.numel() for p in pl_module.parameters() if id(p) in experts),
                       "dense": sum(p.numel() for p in pl_module.parameters() if id(p) not in experts)}
        self.kind = type(opt).__name__


def _train_and_save_moe(rank: int, world: int, kwargs: Dict[str, Any], samples, path: str):
    from tests.test_parity_moe import moe_config

    pl.seed_everything(SEED, verbose=False)
    module = new_module(moe_config(), 2)
    size = ExpertStateSize()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), 2, callbacks=[size])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    trainer.save_checkpoint(path)
    return {"sizes": size.sizes, "params": size.params, "kind": size.kind}


def test_expert_states_are_sharded_over_edp_and_checkpoints_match_the_plain_optimizer(tmp_path):
    """world 4, ep=2: dp x cp = 4 ranks share the dense parameters, edp = 2 ranks each expert. The dense states are
    split over 4 ranks, the experts' over the 2 ranks holding the same experts; the checkpoint equals the plain
    optimizer's."""
    from tests.test_parity_moe import moe_config

    samples = make_samples(moe_config(), 16)
    plain, sharded = str(tmp_path / "plain.ckpt"), str(tmp_path / "sharded.ckpt")
    kwargs = dict(ep=2)
    plain_runs = run_distributed(_train_and_save_moe, 4, kwargs, samples, plain)
    sharded_runs = run_distributed(_train_and_save_moe, 4, dict(kwargs, use_distributed_optimizer=True), samples,
                                   sharded)
    params = plain_runs[0]["params"]   # per rank: its experts (E / ep of them) and all dense parameters
    assert all(r["sizes"] == {k: 2 * v for k, v in params.items()} for r in plain_runs)
    assert all(r["kind"] == "DistributedOptimizer" for r in sharded_runs)
    # dense: the 4 ranks' shards add up to one copy; experts: ranks 0, 2 (ep rank 0) hold one copy of their experts
    assert sum(r["sizes"]["dense"] for r in sharded_runs) == 2 * params["dense"]
    assert all(0 < r["sizes"]["dense"] < 2 * params["dense"] * 0.5 for r in sharded_runs)
    mesh_edp = [[0, 2], [1, 3]]   # ranks with the same experts (ep is the inner dimension of the expert grid)
    for ranks in mesh_edp:
        assert sum(sharded_runs[r]["sizes"]["expert"] for r in ranks) == 2 * params["expert"], ranks
    a = torch.load(plain, weights_only=True)["optimizer_states"][0]
    b = torch.load(sharded, weights_only=True)["optimizer_states"][0]
    assert a["state"].keys() == b["state"].keys() and any("experts" in name for name in a["state"])
    for name, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][name][key]
            if isinstance(value, torch.Tensor):
                assert value.shape == other.shape, (name, key)
                assert torch.allclose(value.float(), other.float(), rtol=1e-5, atol=1e-8), (name, key)
            else:
                assert value == other, (name, key)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]


def _resume_and_save_moe(rank: int, world: int, kwargs: Dict[str, Any], samples, load: str, path: str):
    from tests.test_parity_moe import moe_config

    pl.seed_everything(SEED, verbose=False)
    trainer = trainer_for(world, MegatronStrategy(**kwargs), 2)
    trainer.fit(new_module(moe_config(), 2), DataLoader(ListDataset(samples), batch_size=2, shuffle=False),
                ckpt_path=load)
    trainer.save_checkpoint(path)
    return type(trainer.optimizers[0]).__name__


def test_expert_sharded_checkpoint_loads_back_into_the_shards(tmp_path):
    """A checkpoint of the expert-sharded optimizer (ep=2, world 4) loaded by the same layout puts every state back
    into its shard: saved again, it is the same checkpoint."""
    from tests.test_parity_moe import moe_config

    samples = make_samples(moe_config(), 16)
    first, again = str(tmp_path / "first.ckpt"), str(tmp_path / "again.ckpt")
    kwargs = dict(ep=2, use_distributed_optimizer=True)
    run_distributed(_train_and_save_moe, 4, kwargs, samples, first)
    kinds = run_distributed(_resume_and_save_moe, 4, kwargs, samples, first, again)
    assert kinds == ["DistributedOptimizer"] * 4
    a = torch.load(first, weights_only=True)["optimizer_states"][0]
    b = torch.load(again, weights_only=True)["optimizer_states"][0]
    assert a["state"].keys() == b["state"].keys()
    for name, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][name][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (name, key)
    assert a["param_groups"] == b["param_groups"]
