"""The distributed optimizer over the buffers of bf16 parameters (:mod:`lightning_megatron.parallel.param_buffer.optimizer`):
the fp32 main parameters and the optimizer states sharded over data parallel, the bf16 parameters all-gathered.

* The sharded step is the unsharded step, bit for bit: final weights and optimizer states of dp2 with
  ``use_distributed_optimizer=True`` equal dp2 without it (plain SGD and the library's AdamW; with and without
  remainders; with ``overlap_param_gather``), and the optimizer really is the sharded one; another optimizer
  (RMSprop) falls back to ``ZeroRedundancyOptimizer`` over whole main parameters, with the same result.
* Static bytes per parameter on each rank, counted from the tensors themselves at dp = 1, 2 and 4 (bf16 parameters,
  fp32 main gradients during a step, main-parameter shards, Adam moments), equal Megatron's ``2 + 4 + 12 / dp``
  (remainders: ``2 + 4 + 10 / dp``), as the planner's memory model counts them.
* Checkpoints hold the whole, layout-independent state: a sharded run's checkpoint equals the unsharded run's, and a
  sharded run resumed from the unsharded run's checkpoint continues as the unsharded run does.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronPrecision, MegatronStrategy, ParallelGPTModule
from tests._dist import run_distributed, run_each
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for

BF16 = dict(precision="bf16-mixed", params_dtype=torch.bfloat16, store_param_remainders=False)
BF16_REM = dict(BF16, store_param_remainders=True)
STEPS = 2


class StaticBytes(pl.Callback):
    """The bytes this rank holds per parameter of its model part, by kind, from the tensors themselves: bf16
    parameters, fp32 main gradients and main parameters (or remainders) before the first optimizer step (gradients
    reduced, main gradients whole), the optimizer's states after it."""

    def __init__(self) -> None:
        self.bytes: Dict[str, float] = {}

    @staticmethod
    def _size(t: Optional[torch.Tensor]) -> int:
        return t.numel() * t.element_size() if t is not None else 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.bytes:
            return
        main = trainer.strategy.parallelized.main_params
        params, size = sum(p.numel() for p in main.params), self._size
        self.bytes = {
            "params": sum(size(b.compute) for b in main.buckets) / params,
            # fp32 main gradients, or in a step nothing accumulates or reduces (dp = 1) the bf16 gradients kept
            "grads": (sum(size(b.grad) for b in main.buckets) + sum(size(p.grad) for p in main.params
                                                                     if main.direct)) / params,
            # fp32 parameters are their own main parameters: nothing more
            "main": 0.0 if main.keeps_dtype else sum(
                size(b.remainder) if b.remainder is not None else size(b.main_shard if b.shard is not None else b.main)
                for b in main.buckets) / params,
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "optimizer" in self.bytes:
            return
        opt = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        inner = getattr(opt, "inner", opt)
        states = inner.state.values() if inner is not None else []
        params = sum(p.numel() for p in trainer.strategy.parallelized.main_params.params)
        self.bytes["optimizer"] = sum(self._size(v) for s in states for v in s.values()
                                      if isinstance(v, torch.Tensor) and v.dim() > 0) / params


class RMSpropModule(ParallelGPTModule):
    """:class:`ParallelGPTModule` trained by ``torch.optim.RMSprop``: not one of the optimizers the buffers' shards
    take (:data:`~lightning_megatron.parallel.param_buffer.optimizer.ELEMENTWISE_OPTIMIZERS`), so the distributed
    optimizer falls back to ``ZeroRedundancyOptimizer`` over whole fp32 main parameters."""

    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def shard_run(rank: int, world: int, strategy: Dict[str, Any], precision: Dict[str, Any], optimizer: Optional[str],
              steps: int = STEPS, load: Optional[str] = None, save: Optional[str] = None) -> Dict[str, Any]:
    """One rank: the tiny model, ``steps`` steps of micro-batch 2 per rank; the final weights (rank 0), the whole
    optimizer state as a checkpoint holds it (rank 0), the optimizer's class and the static bytes."""
    cfg = tiny_config(num_query_groups=4)
    pl.seed_everything(SEED, verbose=False)
    module = RMSpropModule(cfg) if optimizer == "rmsprop" else new_module(cfg, steps, optimizer)
    counted = StaticBytes()
    trainer = trainer_for(world, MegatronStrategy(**strategy), steps, callbacks=[counted],
                          plugins=[MegatronPrecision(**precision)])
    samples = make_samples(cfg, 2 * world * steps)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False), ckpt_path=load)
    if save is not None:
        trainer.save_checkpoint(save)
    final = trainer.strategy.lightning_module_state_dict()
    opt = trainer.strategy.optimizer_state(trainer.optimizers[0])
    return {"final": {k: v.detach().cpu().clone() for k, v in final.items()} if rank == 0 else None,
            "optimizer": opt if rank == 0 else None, "kind": type(trainer.optimizers[0]).__name__,
            "sharded": trainer.strategy.parallelized.main_params.sharded, "bytes": counted.bytes}


def _equal_states(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k].double() - b[k].double()).abs().max()))


def _equal_optimizer(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys()
    for name, entry in a["state"].items():
        assert entry.keys() == b["state"][name].keys(), name
        for key, value in entry.items():
            other = b["state"][name][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
            else:
                assert value == other, (name, key)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]


CASES = {
    # name: (precision, optimizer, extra strategy options)
    "sgd": (BF16, "sgd", {}),
    "sgd-remainders": (BF16_REM, "sgd", {}),
    "adamw": (BF16, None, {}),
    "adamw-remainders-param-gather": (BF16_REM, None, dict(overlap_param_gather=True, overlap_grad_reduce=True)),
    "adamw-bf16-moments": (BF16, "bf16_moments", {}),
    # grad_reduce_in_bf16: the sharded run's main gradients are bf16 buffers (accumulated and averaged in bf16), the
    # unsharded run's fp32 buffers communicated in bf16: the same numbers at one micro-batch per step
    "sgd-bf16-reduce": (BF16, "sgd", dict(grad_reduce_in_bf16=True)),
    "adamw-remainders-bf16-reduce-overlaps": (BF16_REM, None, dict(grad_reduce_in_bf16=True, overlap_grad_reduce=True,
                                                                    overlap_param_gather=True)),
    # another optimizer: ZeroRedundancyOptimizer over whole fp32 main parameters, broadcasts overlapped
    "rmsprop-fallback-param-gather": (BF16_REM, "rmsprop", dict(overlap_param_gather=True)),
}


@pytest.fixture(scope="module")
def runs() -> Dict[str, Any]:
    cases = []
    for name, (precision, optimizer, extra) in CASES.items():
        plain = {k: v for k, v in extra.items() if k != "overlap_param_gather"}
        cases.append((f"{name}/plain", ({**plain}, precision, optimizer)))
        cases.append((f"{name}/sharded", ({**extra, "use_distributed_optimizer": True}, precision, optimizer)))
    return run_distributed(run_each, 2, shard_run, cases)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_step_equals_the_unsharded_step_bit_for_bit(runs, case: str) -> None:
    plain, sharded = runs[f"{case}/plain"], runs[f"{case}/sharded"]
    assert not isinstance(plain, str), plain
    assert not isinstance(sharded, str), sharded
    if CASES[case][1] == "rmsprop":
        assert sharded["kind"] == "ZeroRedundancyOptimizer" and not sharded["sharded"], sharded["kind"]
    else:
        assert sharded["kind"] == "DistributedOptimizer" and sharded["sharded"], (sharded["kind"], sharded["sharded"])
    assert not plain["sharded"]
    _equal_states(sharded["final"], plain["final"])
    _equal_optimizer(sharded["optimizer"], plain["optimizer"])
    # and the weights moved: the comparison is not between two untouched models
    assert any(not torch.equal(sharded["final"][k], plain["final"][k] * 0 + plain["final"][k].mean())
               for k in plain["final"])


def _bytes_at(world: int, precision: Dict[str, Any], bf16_grads: bool = False) -> Dict[str, float]:
    strategy = dict(use_distributed_optimizer=True) if world > 1 else {}
    if bf16_grads:
        strategy["grad_reduce_in_bf16"] = True
    out = run_distributed(shard_run, world, strategy, precision, None, 1)
    for r in out:
        assert not isinstance(r, str), r
    return out[0]["bytes"]


@pytest.mark.parametrize("remainders, bf16_grads", [(False, False), (True, False), (False, True)],
                         ids=["fp32-main", "remainders", "bf16-grads"])
def test_static_bytes_per_parameter_follow_megatrons_formula(remainders: bool, bf16_grads: bool) -> None:
    """2 (bf16 parameter) + 4 (fp32 main gradient) + (4 main parameter + 8 Adam moments) / dp; with remainders the
    main parameter's 4 bytes are the bf16 parameter's 2 plus a 2-byte remainder: 2 + 4 + 10 / dp. Counted from the
    tensors on rank 0 (the buckets' padding to a multiple of dp is the only slack). At dp = 1 a step of one
    micro-batch keeps the backward's bf16 gradients (2 bytes) instead of fp32 main gradients (4): 2 less. With
    ``grad_reduce_in_bf16`` the sharded runs' main gradients are bf16 buffers: ``2 + 2 + 12 / dp``."""
    from lightning_megatron.planner.memory import static_bytes_per_param

    precision = BF16_REM if remainders else BF16
    for dp in (1, 2, 4):
        measured = _bytes_at(dp, precision, bf16_grads)
        total = sum(measured.values())
        formula = static_bytes_per_param(params_dtype="bf16", distributed_optimizer=True, dp=dp,
                                         store_param_remainders=remainders, grad_reduce_in_bf16=bf16_grads)
        grads = 2 if bf16_grads and dp > 1 else 4
        assert formula == pytest.approx(2 + grads + (10 if remainders else 12) / dp)
        direct = 2 if dp == 1 else 0   # the bf16 gradients kept where nothing reduces them
        assert total == pytest.approx(formula - direct, rel=2e-3), (dp, measured)
        assert measured["grads"] == pytest.approx(grads - direct), (dp, measured)


@pytest.mark.parametrize("bf16_grads", [False, True], ids=["fp32-grads", "bf16-grads"])
def test_fp32_parameters_shard_in_place_with_megatrons_bytes(bf16_grads: bool) -> None:
    """fp32 parameters are their own main parameters: 4 (parameter) + 4 (gradient) + 8 (Adam moments) / dp, the run
    stepped in the buffer itself (no fp32 copy). With ``grad_reduce_in_bf16`` the gradient buffers stay fp32
    (``p.grad`` is a view of them) and bf16 copies are communicated. Counted from the tensors on rank 0 at
    dp = 1, 2, 4, and the planner's formula the same."""
    from lightning_megatron.planner.memory import static_bytes_per_param

    for dp in (1, 2, 4):
        measured = _bytes_at(dp, dict(precision="bf16-mixed"), bf16_grads)
        formula = static_bytes_per_param(params_dtype="fp32", distributed_optimizer=True, dp=dp,
                                         grad_reduce_in_bf16=bf16_grads)
        assert formula == pytest.approx(4 + 4 + 8 / dp)
        assert measured["main"] == 0.0 and measured["params"] == pytest.approx(4, rel=2e-3), (dp, measured)
        assert sum(measured.values()) == pytest.approx(formula, rel=2e-3), (dp, measured)


def test_checkpoints_are_whole_and_resume_into_the_shards(tmp_path) -> None:
    """A sharded run's checkpoint equals the unsharded run's (the whole, name-keyed state); a sharded run resumed
    from the unsharded one's checkpoint ends where the unsharded run resumed from it ends."""
    plain_ckpt, sharded_ckpt = str(tmp_path / "plain.ckpt"), str(tmp_path / "sharded.ckpt")
    dist = dict(use_distributed_optimizer=True)
    cases = [("plain", ({}, BF16, None, 1, None, plain_ckpt)),
             ("sharded", (dist, BF16, None, 1, None, sharded_ckpt)),
             ("plain-resumed", ({}, BF16, None, 2, plain_ckpt, None)),
             ("sharded-resumed", (dist, BF16, None, 2, plain_ckpt, None))]
    out = run_distributed(run_each, 2, shard_run, cases)[0]
    for r in out.values():
        assert not isinstance(r, str), r
    a, b = torch.load(plain_ckpt, weights_only=True), torch.load(sharded_ckpt, weights_only=True)
    _equal_states(b["state_dict"], a["state_dict"])
    _equal_optimizer(b["optimizer_states"][0], a["optimizer_states"][0])
    assert out["sharded-resumed"]["kind"] == "DistributedOptimizer"
    _equal_states(out["sharded-resumed"]["final"], out["plain-resumed"]["final"])
    _equal_optimizer(out["sharded-resumed"]["optimizer"], out["plain-resumed"]["optimizer"])
