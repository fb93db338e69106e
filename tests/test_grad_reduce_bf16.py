"""The data-parallel gradient reduction (DDP over dp x cp): its own averaging hook by default, in bf16 with
``MegatronStrategy(grad_reduce_in_bf16=True)``.

The gradients of the first optimizer step, read on every rank just before the step, are compared with the
single-process gradients of the same global batch: with the option they carry bf16 round-off (above float32's
and below 1e-2 relative), without it they match to float32 round-off. Covered: DDP over dp (its comm hook),
DDP over dp x cp, and the pipeline path (pp x dp: the flattened reduction after the schedule)."""
from __future__ import annotations

from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from tests._dist import run_distributed
from tests.parity import (SEED, ListDataset, collate, lightning_train_order, make_samples, new_module, tiny_config,
                          trainer_for)

STEPS = 2


class FirstStepGrads(pl.Callback):
    """Gradients of the module's parameters just before the first optimizer step."""

    def __init__(self) -> None:
        self.grads: Dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def _rank_grads(rank: int, world: int, strategy_kwargs: Dict[str, Any], samples, micro_batch: int, accumulate: int):
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    module = new_module(cfg, STEPS)
    grads = FirstStepGrads()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), STEPS, callbacks=[grads],
                          accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    return grads.grads


def _reference_grads(samples, global_batch: int, accumulate: int) -> Dict[str, torch.Tensor]:
    pl.seed_everything(SEED, verbose=False)
    module = new_module(tiny_config(), STEPS)
    module.configure_model()
    order = lightning_train_order(len(samples))
    for micro in range(accumulate):
        batch = collate([samples[i] for i in order[micro * global_batch:(micro + 1) * global_batch]])
        loss_sum, count = module.loss_sum_and_count(batch)
        (loss_sum / count / accumulate).backward()
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


CASES = {
    # id: (world, strategy kwargs, data-parallel size, micro-batches per step)
    "dp2": (2, dict(), 2, 1),
    "cp2xdp2": (4, dict(cp=2), 2, 1),
    "pp2xdp2": (4, dict(pp=2), 2, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grad_reduce_in_bf16(case):
    world, kwargs, dp, accumulate = CASES[case]
    micro_batch = 2
    samples = make_samples(tiny_config(), STEPS * accumulate * micro_batch * dp)
    ref = _reference_grads(samples, micro_batch * dp, accumulate)
    for bf16, low, high in ((False, 0.0, 1e-5), (True, 1e-5, 1e-2)):
        results = run_distributed(_rank_grads, world, dict(kwargs, grad_reduce_in_bf16=bf16), samples, micro_batch,
                                  accumulate)
        worst = 0.0
        for grads in results:
            assert grads, "no gradients recorded"
            for name, g in grads.items():
                want = ref[name]
                err = float((g - want).norm() / want.norm().clamp_min(1e-12))
                assert err < high, f"{case} bf16={bf16} {name}: relative error {err:.2e} >= {high}"
                worst = max(worst, err)
        assert worst > low, f"{case} bf16={bf16}: gradients match float32 ({worst:.2e}); no bf16 reduction happened"


class BackwardDivisions(pl.Callback):
    """``aten::div_`` and ``aten::mul`` calls from the first training batch's start to its optimizer step (forward,
    backward and the data-parallel reduction), and the dense buckets of the parameters' buffer."""

    def __init__(self) -> None:
        self.prof, self.scalings, self.buckets, self.params = None, -1, 0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.scalings = sum(e.count for e in self.prof.key_averages() if e.key in ("aten::div_", "aten::mul"))
            self.buckets = sum(not b.expert for b in trainer.strategy.parallelized.main_params.buckets)
            self.params = sum(1 for p in pl_module.parameters() if p.requires_grad)
            self.prof = None


def _rank_divisions(rank: int, world: int, strategy_kwargs: Dict[str, Any], samples):
    pl.seed_everything(SEED, verbose=False)
    probe = BackwardDivisions()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1, callbacks=[probe])
    trainer.fit(new_module(tiny_config(), 1), DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    return probe.scalings, probe.buckets, probe.params


def test_the_buffer_averages_per_bucket_not_per_parameter():
    """The data-parallel average divides each bucket of the buffer once (gloo has no AVG), not every parameter's
    gradient in a kernel of its own (what torch DDP without a hook does: 2.9 ms of a 280 ms step of the 1.3B model
    at cp=2 on H200)."""
    samples = make_samples(tiny_config(), 4)
    (alone, _, _), = run_distributed(_rank_divisions, 1, {}, samples[:2])   # the forward and backward's own
    for scalings, buckets, params in run_distributed(_rank_divisions, 2, {}, samples):
        assert params > 4 and 1 <= buckets < params, (buckets, params)
        assert alone <= scalings <= alone + buckets, f"{scalings} divisions at dp2, {alone} at dp1, {buckets} buckets"
