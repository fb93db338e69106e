"""Mixed precision under several processes: bf16-mixed and fp16 ("16-mixed", with its loss scaler) under
MegatronStrategy against the single-process run of the same model, data, optimizer and precision
(:func:`tests.parity.reference_loop` under CPU autocast, with a ``GradScaler`` for fp16).

Low precision makes a layout differ from one process by its own round-off: a row-parallel GEMM rounds each
rank's partial sum to bf16 before the reduction, and bf16 round-off (2**-8 relative) is of the size of the
distance between the bf16 and the float32 runs of this tiny model. So the bands below (measured on CPU with
torch 2.13, set 3-5x above) cannot tell bf16 from float32 by the numbers; they catch what is wrong beyond
round-off: a lost, doubled or mis-scaled reduction, a shard in the wrong place, a missed fp16 unscale. That
the layout does compute in the low precision is checked directly (the dtype of an MLP output), and that the
weights stay float32 (master weights) too. Three quantities are compared:

- the loss of every optimizer step;
- the gradients of the first optimizer step (TP shards gathered; unscaled, before clipping);
- the final weights after 3 AdamW steps. AdamW's first steps move each weight by about ``lr * sign(grad)``, so
  a weight whose gradient is near zero flips with any round-off: the weight error is the loosest of the three,
  and the gradients are the sharp check of the gradient path.

The precision is asked for as a Lightning user does: Lightning's own ``MixedPrecision`` plugin, the one
``Trainer(precision="16-mixed" | "bf16-mixed")`` builds (on CPU Lightning turns the string ``"16-mixed"`` into bf16,
so the tests pass the plugin). ``MegatronStrategy`` runs it as ``MegatronPrecision`` of the same name: fp16 under
pp = 2, and an overflow on one tensor-parallel rank skipping the step on every rank, work as with that plugin.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.checkpoint.state_dict import tensor_parallel_owners
from tests._dist import run_distributed
from tests.parity import (
    AUTOCAST_DTYPES,
    SEED,
    ListDataset,
    StepLossRecorder,
    make_samples,
    new_module,
    precision_plugins,
    reference_loop,
    tiny_config,
    trainer_for,
)

STEPS = 3
ACCUMULATE = 2
MICRO_BATCH = 2
CLIP = 0.05


class ComputeDtype(pl.Callback):
    """The dtype of the ``linear_fc1`` output of this rank's first layer in the first training forward."""

    def __init__(self) -> None:
        self.dtype: Optional[torch.dtype] = None

    def on_train_start(self, trainer, pl_module) -> None:
        fc1 = next(iter(pl_module.model.decoder.layers.values())).mlp.linear_fc1

        def record(module, args, output) -> None:
            if self.dtype is None:
                self.dtype = output.dtype

        fc1.register_forward_hook(record)


class FirstStepFullGrads(pl.Callback):
    """Full (TP-gathered, pipeline stages merged) gradients just before the first optimizer step: after the fp16
    unscaling, before clipping (Lightning calls ``on_before_optimizer_step`` between the two). Collective over
    each TP group and the pipeline group."""

    def __init__(self) -> None:
        self.grads: Optional[Dict[str, torch.Tensor]] = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.grads is not None:
            return
        owners = tensor_parallel_owners(pl_module)
        grads = {}
        for name, p in pl_module.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.detach()
            if name in owners:
                module, pname = owners[name]
                g = module.gather_global(pname, g)
            grads[name] = g.cpu().clone()
        if trainer.strategy.parallel_config.pp > 1:
            parts: List[Optional[Dict[str, torch.Tensor]]] = [None] * trainer.strategy.mesh.size("pp")
            torch.distributed.all_gather_object(parts, grads, group=trainer.strategy.mesh.group("pp"))
            grads = {k: v for part in parts for k, v in part.items()}
        self.grads = grads


def precision_run(rank: int, world: int, cfg, strategy_kwargs: Dict[str, Any], samples, precision: str):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    recorder, grads, dtype = StepLossRecorder(ACCUMULATE), FirstStepFullGrads(), ComputeDtype()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), STEPS, callbacks=[recorder, grads, dtype],
                          gradient_clip_val=CLIP, accumulate_grad_batches=ACCUMULATE,
                          plugins=precision_plugins(precision))
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=MICRO_BATCH, shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    assert type(trainer.precision_plugin).__name__ == "MegatronPrecision", trainer.precision_plugin
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {"losses": recorder.losses, "grads": grads.grads, "state": state if rank == 0 else None,
            "scale": scaler.get_scale() if scaler is not None else None, "compute_dtype": dtype.dtype}


def relative_errors(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """``||a - e|| / ||e||`` per tensor (same keys and shapes required)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    out = {}
    for k, e in expected.items():
        assert actual[k].shape == e.shape, (k, actual[k].shape, e.shape)
        out[k] = ((actual[k].float() - e.float()).norm() / e.float().norm().clamp(min=1e-12)).item()
    return out


# id: (world, strategy kwargs, config overrides, precision, (loss band, first-step grad band, final weight band)).
# Measured (loss / grads / weights, largest relative error over steps and tensors), and for scale the float32 run
# against the same low-precision reference:
#   bf16-tp2-sp  9.8e-6 / 5.9e-3 / 6.4e-3     float32 run: 1.3e-5 / 6.6e-3 / 1.0e-2
#   bf16-dp2     6.6e-6 / 2.5e-3 / 3.1e-3     float32 run: 1.9e-5 / 6.4e-3 / 9.5e-3
#   fp16-dp2     8.1e-7 / 3.1e-4 / 3.9e-4     float32 run: 5.8e-6 / 9.1e-4 / 3.4e-3
#   fp16-tp2-sp  1.3e-6 / 7.3e-4 / 3.7e-3     float32 run: 8.9e-7 / 7.9e-4 / 2.4e-3
BF16_BANDS = (5e-5, 2e-2, 2e-2)
CASES = {
    "bf16-tp2-sp": (2, dict(tp=2, sequence_parallel=True), dict(num_query_groups=4), "bf16-mixed", BF16_BANDS),
    "bf16-dp2": (2, dict(), {}, "bf16-mixed", BF16_BANDS),
    "fp16-dp2": (2, dict(), {}, "16-mixed", (5e-6, 2e-3, 2e-3)),
    "fp16-tp2-sp": (2, dict(tp=2, sequence_parallel=True), dict(num_query_groups=4), "16-mixed", (5e-6, 3e-3, 1.5e-2)),
    "fp16-pp2": (2, dict(pp=2), {}, "16-mixed", (5e-6, 2e-3, 2e-3)),
}
@pytest.mark.parametrize("case", list(CASES))
def test_mixed_precision_matches_single_process(case):
    world, kwargs, overrides, precision, (loss_band, grad_band, weight_band) = CASES[case]
    cfg = tiny_config(**overrides)
    model_parallel = kwargs.get("tp", 1) * kwargs.get("pp", 1)
    global_batch = MICRO_BATCH * (world // model_parallel)
    samples = make_samples(cfg, STEPS * ACCUMULATE * global_batch)
    ref = reference_loop(cfg, samples, STEPS, global_batch, CLIP, accumulate=ACCUMULATE, precision=precision)
    ref_steps = [sum(ref["losses"][i * ACCUMULATE:(i + 1) * ACCUMULATE]) / ACCUMULATE for i in range(STEPS)]
    results = run_distributed(precision_run, world, cfg, kwargs, samples, precision)
    for r in results:
        assert r["compute_dtype"] == AUTOCAST_DTYPES[precision], r["compute_dtype"]
        assert len(r["losses"]) == STEPS, r["losses"]
        for got, want in zip(r["losses"], ref_steps):
            assert abs(got - want) <= loss_band * abs(want), (r["losses"], ref_steps)
        # fp16: the same loss scale on every rank as in the reference (no step overflowed in either)
        assert r["scale"] == (ref["scales"][-1] if ref["scales"] else None), (r["scale"], ref["scales"])
    grad_err = relative_errors(results[0]["grads"], ref["first_grads"])
    assert max(grad_err.values()) <= grad_band, sorted(grad_err.items(), key=lambda kv: -kv[1])[:3]
    state = results[0]["state"]
    assert all(v.dtype == torch.float32 for v in state.values()), {k: v.dtype for k, v in state.items()}
    weight_err = relative_errors(state, ref["state"])
    assert max(weight_err.values()) <= weight_band, sorted(weight_err.items(), key=lambda kv: -kv[1])[:3]


# ------------------------------------------------------------------------------------- fp16 overflow on one rank
class OverflowOnOneRank(pl.Callback):
    """In the first step's backward, put an inf into global rank ``rank``'s shard of a TP-sharded gradient (layer
    0's ``linear_fc1`` weight), as an fp16 overflow in that rank's weight-gradient GEMM would: nothing reduces a
    TP-sharded weight gradient over TP, so only that rank sees it. Runs before the loss scaler's unscale."""

    def __init__(self, rank: int) -> None:
        self.rank, self.done = rank, False

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and not self.done:
            pl_module.model.decoder.layers["0"].mlp.linear_fc1.weight.grad[0, 0] = float("inf")
            self.done = True


def overflow_run(rank: int, world: int, cfg, strategy_kwargs: Dict[str, Any], samples):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, 1)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1, callbacks=[OverflowOnOneRank(world - 1)],
                          accumulate_grad_batches=ACCUMULATE, plugins=precision_plugins("16-mixed"))
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=MICRO_BATCH, shuffle=False))
    local = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"full": trainer.strategy.lightning_module_state_dict(), "local": local,
            "scale": trainer.precision_plugin.scaler.get_scale()}


def test_fp16_overflow_on_one_tp_rank_skips_the_step_on_every_rank():
    cfg = tiny_config(num_query_groups=4)
    samples = make_samples(cfg, ACCUMULATE * MICRO_BATCH)
    initial = reference_loop(cfg, samples, 1, MICRO_BATCH, stop_after=0)["state"]
    results = run_distributed(overflow_run, 2, cfg, dict(tp=2, sequence_parallel=True), samples)
    # every rank skipped the step: its weights are the initial ones and its scale halved (GradScaler's backoff)
    assert [r["scale"] for r in results] == [2.0 ** 15] * 2, [r["scale"] for r in results]
    for r in results:
        for k, v in r["full"].items():
            assert torch.equal(v, initial[k]), k
