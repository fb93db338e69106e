"""Megatron's bf16 (``MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16)``): bf16 parameters, fp32 main
parameters in the optimizer, fp32 gradient accumulation (:mod:`lightning_megatron.parallel.param_buffer.buffer`).

Units: the main gradient accumulates in fp32 (where bf16 accumulation stalls), the views switch as documented.
Training (one spawn of 1 process, one of 2): bf16 parameters follow the autocast bf16 run and the fp32 run within
bf16 tolerance over 20 steps; accumulate_grad_batches=2 equals one micro-batch twice the size; tp2+SP, pp2 (also
with tied embeddings), ep2 (MoE), dp2 and dp2 with the distributed optimizer match the one-process bf16-parameter run; a
checkpoint holds fp32 main parameters, resumes exactly and loads into the default fp32 path. The FP8 delayed
recipe's amax histories are in checkpoints too: its resume is exact. A step nothing accumulates, reduces or clips
keeps its bf16 gradients (no fp32 main gradients) with the same result bit for bit (one process, and tp2 on two);
dp2 and tp2+SP, whose finaliser reduces gradients, do not; a second gradient in such a step falls back to fp32.
With the fp32 main parameters as remainders (``store_param_remainders=True``) direct steps and steps through the
main view are the same run bit for bit, checkpoints resume bit for bit, and tp2+SP, pp2 and dp2 with the
distributed optimizer match the one-process run with remainders.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from functools import lru_cache
from typing import Any, Dict, Iterator, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_megatron import MegatronPrecision, MegatronStrategy
from lightning_megatron.parallel.param_buffer.buffer import MainParams
from tests._dist import run_distributed, run_each
from tests.test_fp8 import learnable_samples
from tests.parity import (
    SEED,
    ListDataset,
    StepLossRecorder,
    make_samples,
    new_module,
    plugin_layout_run,
    tiny_config,
    trainer_for,
    weight_change_errors,
)

BF16P = dict(precision="bf16-mixed", params_dtype=torch.bfloat16, store_param_remainders=False)
BF16P_REM = dict(BF16P, store_param_remainders=True)
FP8_DELAYED = dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
                   fp8_amax_compute_algo="max", fp8_backend="torch")


# ---------------------------------------------------------------------------------------------- units
def test_main_grad_accumulates_in_fp32_where_bf16_stalls():
    """300 micro-batches each adding a gradient of 1 + 2**-7: fp32 accumulation gives 300 * (1 + 2**-7) exactly; a
    bf16 ``.grad`` would stall at 256 (bf16 has 8 bits of mantissa)."""
    lin = nn.Linear(4, 1, bias=False)
    main = MainParams(lin)
    assert lin.weight.dtype == torch.bfloat16 and main.main_param(lin.weight).dtype == torch.float32
    x = torch.full((1, 4), 1 + 2 ** -7, dtype=torch.bfloat16)
    for _ in range(300):
        lin(x).sum().backward()
        assert lin.weight.grad is None   # moved into the main gradient at once
    want = torch.full((1, 4), 300 * (1 + 2 ** -7))
    assert torch.equal(main.main_grad(lin.weight), want)
    bf16 = torch.zeros(1, 4, dtype=torch.bfloat16)
    for _ in range(300):
        bf16 += x
    assert not torch.equal(bf16.float(), want)    # what bf16 accumulation would have given
    main.to_main()
    assert lin.weight.dtype == torch.float32 and lin.weight.grad is main.main_grad(lin.weight)


def test_views_switch_and_the_optimizer_steps_fp32_main_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    start = lin.weight.detach().clone()
    main = MainParams(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=2 ** -20)   # an update far below bf16's resolution of the weights
    opt.register_step_post_hook(main.optimizer_hook)
    lin(torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
    main.to_main()
    grad = lin.weight.grad.clone()
    opt.step()
    assert not main.in_main_view and lin.weight.dtype == torch.bfloat16 and lin.weight.grad is None
    # the fp32 main parameter moved by exactly lr * grad; the bf16 copy is its rounding
    assert torch.equal(main.main_param(lin.weight), start - 2 ** -20 * grad)
    assert torch.equal(lin.weight.detach(), main.main_param(lin.weight).to(torch.bfloat16))
    with main.main_view():
        assert lin.state_dict()["weight"].dtype == torch.float32
        lin.load_state_dict({"weight": torch.ones(16, 16), "bias": torch.zeros(16)})
    assert torch.equal(lin.weight.detach(), torch.ones(16, 16, dtype=torch.bfloat16))
    assert torch.equal(main.main_param(lin.weight), torch.ones(16, 16))


def test_params_dtype_is_validated():
    with pytest.raises(ValueError, match="bf16-mixed"):
        MegatronPrecision("16-mixed", params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="params_dtype"):
        MegatronPrecision("bf16-mixed", params_dtype=torch.float16)
    assert MegatronPrecision("bf16-mixed", params_dtype=torch.float32).params_dtype is None
    with pytest.raises(ValueError, match="applied by MegatronStrategy"):   # another strategy would ignore it
        MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16).connect(nn.Linear(2, 2), [], [])


# ---------------------------------------------------------------------------------------------- training
LONG_STEPS, STEPS, ACCUMULATE = 20, 3, 2


def _checkpoint_run(rank: int, world: int, cfg, samples, path: str, precision=BF16P,
                    strategy_kwargs: Optional[Dict[str, Any]] = None, adamw: Optional[str] = None) -> Dict[str, Any]:
    """bf16 parameters: 4 steps uninterrupted; 2 steps, save, resume to 4; the checkpoint into the fp32 path.
    ``samples`` are one micro-batch: every step (and epoch) sees the same data, however the resumed run counts
    epochs. ``adamw``: the optimizer kind (:func:`tests.parity.new_module`); ``resumed_opt_dtypes`` are the dtypes of
    the resumed run's optimizer states, by state name."""
    resumed_opt: Dict[str, torch.dtype] = {}

    def fit(steps: int, precision: Dict[str, Any], ckpt=None, save=None, max_steps=None):
        pl.seed_everything(SEED, verbose=False)
        module = new_module(cfg, steps, adamw)
        recorder = StepLossRecorder(1)

        trainer = trainer_for(world, MegatronStrategy(**(strategy_kwargs or {})), max_steps or steps, callbacks=[recorder],
                              plugins=[MegatronPrecision(**precision)])
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2), ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        if ckpt is not None:
            resumed_opt.update({k: v.dtype for s in trainer.optimizers[0].state.values() for k, v in s.items()})
        state = {k: v.detach().cpu().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
        state.update({f"fp8:{k}": v for k, v in trainer.precision_plugin.state_dict().get("fp8_amax_history",
                                                                                          {}).items()})
        return recorder.losses, state

    whole, whole_state = fit(4, precision)
    first, _ = fit(4, precision, save=path, max_steps=2)
    rest, resumed_state = fit(4, precision, ckpt=path)
    resumed_opt_dtypes = dict(resumed_opt)
    if strategy_kwargs:   # a sharded directory: the resume is what is checked
        return {"whole": whole, "first": first, "rest": rest, "whole_state": whole_state,
                "resumed_state": resumed_state, "resumed_opt_dtypes": resumed_opt_dtypes}
    ckpt = torch.load(path, weights_only=False, map_location="cpu")
    fp32, _ = fit(4, dict(precision="32-true"), ckpt=path) if "fp8" not in precision else (None, None)
    return {"whole": whole, "first": first, "rest": rest, "whole_state": whole_state, "resumed_state": resumed_state,
            "ckpt_dtypes": {k: v.dtype for k, v in ckpt["state_dict"].items()},
            "opt_dtypes": {k: v.dtype for s in ckpt["optimizer_states"][0]["state"].values() for k, v in s.items()},
            "fp32_resumed": fp32, "ckpt_fp8": ckpt.get("MegatronPrecision", {}).get("fp8_amax_history"),
            "resumed_opt_dtypes": resumed_opt_dtypes}


class _DirectSteps(pl.Callback):
    """Per optimizer step: whether bf16 parameters kept their bf16 gradients (no fp32 main gradient allocated)."""

    def __init__(self) -> None:
        self.direct: list = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        main = trainer.strategy.parallelized.main_params
        self.direct.append(main is not None and main.direct and all(b.grad is None for b in main.buckets))


@contextlib.contextmanager
def _main_grads_if(fp32_main_grads: bool) -> Iterator[None]:
    """With ``fp32_main_grads``: every step inside goes through fp32 main gradients (``MainParams.start_step`` never
    keeps the bf16 ones), the method restored on the way out, also when the run raises."""
    if not fp32_main_grads:
        yield
        return
    start_step = MainParams.start_step
    MainParams.start_step = lambda self, direct: start_step(self, False)
    try:
        yield
    finally:
        MainParams.start_step = start_step


def _learn_run(rank: int, world: int, cfg, samples, precision: Dict[str, Any], micro: int, accumulate: int,
               moments: str = "fp32", fp32_main_grads: bool = False, clip: Optional[float] = None):
    """``LONG_STEPS`` AdamW steps (lr 3e-3) on a learnable task, Adam's moments in ``moments`` ("fp32" / "bf16"):
    per-step losses, initial and final full states, and per step whether bf16 parameters kept their bf16 gradients
    (``direct``). ``fp32_main_grads``: never keep them (every step through fp32 main gradients)."""
    from lightning_megatron import ParallelGPTModule
    from tests.parity import InitialState

    direct = _DirectSteps()
    pl.seed_everything(SEED, verbose=False)
    module = ParallelGPTModule(cfg, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, weight_decay=0.0, exp_avg_dtype=moments,
                               exp_avg_sq_dtype=moments)
    recorder, initial = StepLossRecorder(accumulate), InitialState()
    trainer = trainer_for(world, MegatronStrategy(), LONG_STEPS, callbacks=[recorder, initial, direct],
                          plugins=[MegatronPrecision(**precision)], accumulate_grad_batches=accumulate,
                          gradient_clip_val=clip)
    with _main_grads_if(fp32_main_grads):
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro))
    final = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "initial": initial.state, "direct": direct.direct,
            "final": {k: v.detach().cpu().clone() for k, v in final.items()}}


@lru_cache(maxsize=None)
def _one_process() -> Dict[str, Any]:
    """Every one-process run, in one spawned process."""
    cfg = tiny_config(hidden_size=64, ffn_hidden_size=128, seq_length=32)
    layout_cfg = tiny_config(num_query_groups=4)
    long = learnable_samples(cfg, LONG_STEPS * 8)
    short = make_samples(layout_cfg, STEPS * ACCUMULATE * 4)
    path = os.path.join(tempfile.mkdtemp(), "bf16p.ckpt")
    runs = [(name, (_learn_run, (cfg, long, precision, 8, 1))) for name, precision in
            (("autocast", dict(precision="bf16-mixed")), ("bf16p", BF16P), ("fp32", dict(precision="32-true")))]
    runs += [("accumulate2", (_learn_run, (cfg, long, BF16P, 4, 2)))]
    runs += [("bf16p-bf16m", (_learn_run, (cfg, long, BF16P, 8, 1, "bf16"))),
             ("bf16p-bf16m-fp32-main-grads", (_learn_run, (cfg, long, BF16P, 8, 1, "bf16", True))),
             ("bf16p-bf16m-accumulate2", (_learn_run, (cfg, long, BF16P, 4, 2, "bf16"))),
             ("bf16p-bf16m-clip", (_learn_run, (cfg, long, BF16P, 8, 1, "bf16", False, 1e9)))]
    runs += [("rem-bf16m", (_learn_run, (cfg, long, BF16P_REM, 8, 1, "bf16"))),
             ("rem-bf16m-clip", (_learn_run, (cfg, long, BF16P_REM, 8, 1, "bf16", False, 1e9))),
             ("rem-adamw", (_learn_run, (cfg, long, BF16P_REM, 8, 1)))]
    runs += [(f"ref-mb{mb}{tag}", (plugin_layout_run, (layout_cfg, {}, precision, short, mb, ACCUMULATE, 0.05,
                                                       STEPS)))
             for mb in (2, 4) for tag, precision in (("", BF16P), ("-rem", BF16P_REM))]
    runs += [(f"ref-mb{mb}-{name}", (plugin_layout_run, (tiny_config(num_query_groups=4, **overrides), {}, BF16P,
                                                         short, mb, ACCUMULATE, 0.05, STEPS)))
             for name, overrides, mb in (("tied", TIED, 2), ("moe", MOE, 4))]
    runs += [("checkpoint", (_checkpoint_run, (tiny_config(), make_samples(tiny_config(), 2), path)))]
    runs += [("checkpoint-fp8", (_checkpoint_run, (tiny_config(), make_samples(tiny_config(), 2), path + ".fp8",
                                                   FP8_DELAYED)))]
    runs += [("checkpoint-rem", (_checkpoint_run, (tiny_config(), make_samples(tiny_config(), 2), path + ".rem",
                                                   BF16P_REM)))]
    runs += [("checkpoint-sharded", (_checkpoint_run, (tiny_config(), make_samples(tiny_config(), 2), path + ".dcp",
                                                       BF16P, dict(ckpt_format="torch_dist"))))]
    out = run_distributed(run_each, 1, _call, runs)[0]
    for name, result in out.items():
        assert not isinstance(result, str), result
    return out


def _call(rank: int, world: int, fn, args):
    return fn(rank, world, *args)


def _worst(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_bf16_params_follow_autocast_and_fp32_over_20_steps():
    """Every step's loss within 2e-3 relative of the autocast bf16 run and of the fp32 run (measured: 3.8e-4 and
    3.4e-4; autocast vs fp32 1.4e-4), the run learns, and the final weights are the fp32 main parameters."""
    out = _one_process()
    bf16p, autocast, fp32 = out["bf16p"]["losses"], out["autocast"]["losses"], out["fp32"]["losses"]
    assert len(bf16p) == LONG_STEPS and bf16p[-1] < 0.9 * bf16p[0], bf16p
    assert _worst(bf16p, autocast) < 2e-3, (bf16p, autocast)
    assert _worst(bf16p, fp32) < 2e-3, (bf16p, fp32)
    assert _worst(autocast, fp32) < 2e-3
    assert all(v.dtype == torch.float32 for v in out["bf16p"]["final"].values())
    # bf16 parameters are not the fp32 run: the losses differ at bf16's level, not fp32's
    assert _worst(bf16p, fp32) > 1e-6


def test_a_step_nothing_accumulates_keeps_its_bf16_gradients_with_the_same_result():
    """bf16 moments (``PrecisionAwareAdamW``), one micro-batch, no clipping, one process: the bf16 gradients stay as
    the backward left them (no fp32 main gradient is allocated) and the run is bit for bit the one through fp32 main
    gradients (every loss, every final weight): converting a bf16 gradient to fp32 is exact, so the update sees the
    same numbers. Accumulating two micro-batches or clipping go through fp32 main gradients. The module's default
    optimizer with bf16 parameters is the precision-aware one with fp32 moments: direct too."""
    out = _one_process()
    direct, fp32 = out["bf16p-bf16m"], out["bf16p-bf16m-fp32-main-grads"]
    assert direct["direct"] == [True] * LONG_STEPS and fp32["direct"] == [False] * LONG_STEPS
    assert out["bf16p"]["direct"] == [True] * LONG_STEPS
    for other in ("bf16p-bf16m-accumulate2", "bf16p-bf16m-clip", "accumulate2"):
        assert out[other]["direct"] == [False] * LONG_STEPS, other
    assert direct["losses"] == fp32["losses"] and direct["losses"][-1] < 0.9 * direct["losses"][0]
    for k, v in direct["final"].items():
        assert torch.equal(v, fp32["final"][k]), k
    assert out["bf16p-bf16m-clip"]["losses"] == direct["losses"]   # a clip that never bites: the same numbers


def _layout_direct_run(rank: int, world: int, cfg, samples, strategy_kwargs: Dict[str, Any],
                       fp32_main_grads: bool = False) -> Dict[str, Any]:
    """3 steps of one micro-batch, bf16 parameters and moments, no clipping, under ``strategy_kwargs``: the losses and
    per step whether the bf16 gradients were kept (``fp32_main_grads``: never keep them)."""
    from lightning_megatron import ParallelGPTModule

    pl.seed_everything(SEED, verbose=False)
    module = ParallelGPTModule(cfg, lr=3e-3, min_lr=3e-4, lr_warmup_iters=1, exp_avg_dtype="bf16",
                               exp_avg_sq_dtype="bf16")
    direct, recorder = _DirectSteps(), StepLossRecorder(1)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), STEPS, callbacks=[direct, recorder],
                          plugins=[MegatronPrecision(**BF16P)])
    with _main_grads_if(fp32_main_grads):
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    return {"direct": direct.direct, "losses": recorder.losses}


def test_layouts_that_reduce_gradients_keep_fp32_main_gradients():
    """Two ranks, one micro-batch, no clipping: a layout whose finaliser reduces gradients (dp2's average, tp2+SP's
    sum of the sequence-parallel norms) goes through fp32 main gradients; tp2 without SP reduces none and keeps the
    bf16 gradients, bit for bit the run through fp32 main gradients; dp2's losses equal the run forced through fp32
    main gradients (a step on unreduced bf16 gradients would leave them)."""
    cfg = tiny_config(num_query_groups=4)
    samples = make_samples(cfg, STEPS * 4)
    cases = [(name, (cfg, samples, kwargs, force)) for name, kwargs, force in (
        ("dp2", dict(overlap_grad_reduce=False), False), ("dp2-overlap", {}, False),
        ("tp2-sp", dict(tp=2, sequence_parallel=True), False), ("tp2", dict(tp=2), False),
        ("tp2-fp32-main-grads", dict(tp=2), True), ("dp2-fp32-main-grads", dict(overlap_grad_reduce=False), True))]
    out = run_distributed(run_each, 2, _layout_direct_run, cases)[0]
    for name, result in out.items():
        assert not isinstance(result, str), result
    assert out["dp2"]["direct"] == [False] * STEPS and out["tp2-sp"]["direct"] == [False] * STEPS
    assert out["dp2-overlap"]["direct"] == [False] * STEPS   # the buckets reduced in backward: fp32 main gradients
    assert out["tp2"]["direct"] == [True] * STEPS and out["tp2-fp32-main-grads"]["direct"] == [False] * STEPS
    assert out["tp2"]["losses"] == out["tp2-fp32-main-grads"]["losses"] and len(out["tp2"]["losses"]) == STEPS
    # dp2 steps on the averaged gradients: the losses of the run forced through fp32 main gradients
    assert out["dp2"]["losses"] == out["dp2-fp32-main-grads"]["losses"] and STEPS > 1


def test_direct_step_falls_back_to_fp32_accumulation_on_a_second_gradient():
    """A direct step that gets a second gradient of a parameter after all: the kept gradients become fp32 main
    gradients and the second one is added in fp32, as in a step that was never direct; ``finish_backward`` then
    switches to the main view."""
    x = torch.full((1, 4), 1 + 2 ** -7, dtype=torch.bfloat16)
    mains = []
    for direct in (True, False):
        lin = nn.Linear(4, 3)
        main = MainParams(lin)
        opt = torch.optim.SGD(lin.parameters(), lr=0.0)
        main._optimizer_steps_main = True   # what attach sets for PrecisionAwareAdamW
        main.start_step(direct)
        lin(x).sum().backward()
        if direct:
            assert main.direct and lin.weight.grad is None and main.main_grad(lin.weight) is None
        lin(x * 3).sum().backward()
        assert not main.direct
        main.finish_backward()
        assert main.in_main_view and lin.weight.grad.dtype == torch.float32
        mains.append([main.main_grad(p).clone() for p in (lin.weight, lin.bias)])
        del opt
    assert all(torch.equal(a, b) for a, b in zip(*mains))


def test_direct_step_needs_an_optimizer_that_steps_the_main_parameters():
    """``start_step(direct=True)`` is taken only once a :class:`PrecisionAwareAdamW` is attached (it steps the fp32
    main parameters in the compute view); another optimizer would step the bf16 copies."""
    from lightning_megatron.optimizer import PrecisionAwareAdamW

    lin = nn.Linear(4, 3)
    main = MainParams(lin)
    main.attach(torch.optim.SGD(lin.parameters(), lr=0.1))
    main.start_step(True)
    assert not main.direct
    main.attach(PrecisionAwareAdamW(lin.parameters(), lr=0.1))
    main.start_step(True)
    assert main.direct


def test_accumulating_two_micro_batches_equals_one_twice_the_size():
    """accumulate_grad_batches=2 of 2 samples vs 1 of 4 samples (same data per step): the fp32 main gradient makes
    them agree to bf16 GEMM round-off (measured: loss 9.5e-5)."""
    out = _one_process()
    assert _worst(out["accumulate2"]["losses"], out["bf16p"]["losses"]) < 2e-4
    errors = weight_change_errors(out["accumulate2"], out["bf16p"])
    assert max(errors.values()) < 3e-2, max(errors.items(), key=lambda kv: kv[1])


def test_checkpoint_holds_fp32_main_params_and_resumes_exactly():
    c = _one_process()["checkpoint"]
    assert set(c["ckpt_dtypes"].values()) == {torch.float32}, c["ckpt_dtypes"]
    assert set(c["opt_dtypes"].values()) <= {torch.float32}, c["opt_dtypes"]
    assert c["first"] == c["whole"][:2]
    assert c["rest"] == c["whole"][2:], (c["rest"], c["whole"])
    for k, v in c["whole_state"].items():
        assert torch.equal(v, c["resumed_state"][k]), k
    # the default fp32 path loads it (strict) and continues from the same loss
    assert len(c["fp32_resumed"]) == 2 and abs(c["fp32_resumed"][0] - c["whole"][2]) < 2e-3 * c["whole"][2]


TIED = dict(untie_embeddings_and_output_weights=False)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2)
LAYOUTS = {   # name: (strategy kwargs, the 1-process reference, per-rank micro-batch, config overrides[, precision])
    "tp2-sp": (dict(tp=2, sequence_parallel=True), "ref-mb2", 2, {}),
    "pp2": (dict(pp=2), "ref-mb2", 2, {}),
    "pp2-tied": (dict(pp=2), "ref-mb2-tied", 2, TIED),
    "ep2": (dict(ep=2), "ref-mb4-moe", 2, MOE),
    "dp2": (dict(), "ref-mb4", 2, {}),
    "dp2-distopt": (dict(use_distributed_optimizer=True), "ref-mb4", 2, {}),
    # the fp32 main parameters as remainders: joined for the main view, split back after the broadcasts
    "dp2-distopt-remainders": (dict(use_distributed_optimizer=True), "ref-mb4-rem", 2, {}, BF16P_REM),
    "tp2-sp-remainders": (dict(tp=2, sequence_parallel=True), "ref-mb2-rem", 2, {}, BF16P_REM),
    "pp2-remainders": (dict(pp=2), "ref-mb2-rem", 2, {}, BF16P_REM),
}


@lru_cache(maxsize=None)
def _layouts() -> Dict[str, Any]:
    samples = make_samples(tiny_config(num_query_groups=4), STEPS * ACCUMULATE * 4)
    cases = [(name, (tiny_config(num_query_groups=4, **overrides), kwargs, precision[0] if precision else BF16P,
                     samples, micro, ACCUMULATE, 0.05, STEPS))
             for name, (kwargs, _, micro, overrides, *precision) in LAYOUTS.items()]
    return run_distributed(run_each, 2, plugin_layout_run, cases)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_params_layout_matches_one_process(layout):
    """3 AdamW steps of 2 micro-batches with clipping: every loss within 5e-5 and every weight change within 1e-1
    of the one-process bf16-parameter run. Measured (loss / weight change): tp2+SP 7.7e-6 / 5.7e-2, pp2 0 / 2.4e-7,
    pp2 with tied embeddings 2.1e-6 / 8.3e-4, ep2 (MoE) 2.0e-5 / 4.3e-2, dp2 and dp2 with the distributed optimizer
    1.8e-5 / 2.5e-2. With the main parameters as remainders, against the one-process run with remainders: tp2+SP
    3.4e-5 / 5.7e-2, pp2 0 / 3.1e-7, dp2 with the distributed optimizer 1.4e-5 / 3.5e-2. The autocast bf16 path under
    the same comparison:
    tp2+SP 1.5e-5 / 5.4e-2, dp2 4.0e-6 / 2.8e-2 (AdamW's first steps move a weight with a near-zero gradient by
    about lr * sign(grad), so bf16 round-off flips some), fp32: <= 1e-7 / 7e-6. Without the fp32 main gradients'
    data-parallel average the dp2 weight change is off by 0.5 and more."""
    result = _layouts()[layout]
    assert not isinstance(result, str), result
    ref = _one_process()[LAYOUTS[layout][1]]
    assert len(result["losses"]) == STEPS
    assert _worst(result["losses"], ref["losses"]) <= 5e-5, (result["losses"], ref["losses"])
    errors = weight_change_errors(result, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-1, (worst, errors[worst])


def test_fp8_delayed_scaling_state_resumes_exactly():
    """FP8 delayed scaling (history 4, max): the checkpoint carries every converted layer's amax history; the resumed
    run's losses, weights and final histories equal the uninterrupted run's (without the histories the resumed run
    would start with empty ones and end with 2 of 4 entries filled)."""
    c = _one_process()["checkpoint-fp8"]
    history = c["ckpt_fp8"]
    assert history and all(h.shape == (3, 4) for h in history.values()), history
    assert all(bool((h[:, :2] > 0).all()) and bool((h[:, 2:] == 0).all()) for h in history.values())
    assert c["rest"] == c["whole"][2:], (c["rest"], c["whole"])
    fp8 = [k for k in c["whole_state"] if k.startswith("fp8:")]
    assert fp8 and all(bool((c["whole_state"][k] > 0).all()) for k in fp8)
    for k, v in c["whole_state"].items():
        assert torch.equal(v, c["resumed_state"][k]), k


def test_sharded_checkpoint_of_bf16_parameters_resumes_exactly():
    """ckpt_format='torch_dist' with bf16 parameters: the shards are the fp32 main parameters and optimizer states,
    so the resumed run's losses and weights equal the uninterrupted run's bit for bit."""
    c = _one_process()["checkpoint-sharded"]
    assert c["first"] == c["whole"][:2]
    assert c["rest"] == c["whole"][2:], (c["rest"], c["whole"])
    for k, v in c["whole_state"].items():
        assert torch.equal(v, c["resumed_state"][k]), k


def test_remainders_train_as_fp32_main_parameters_do():
    """``store_param_remainders=True`` (fp32 main parameters as bf16 copy plus int16 remainder), 20 steps: with
    ``PrecisionAwareAdamW`` the direct steps and the steps through the main view (a clip that never bites) are bit for
    bit the same run (the optimizer writes both halves either way); with torch's AdamW (the main view joined and split
    back every step) and against the fp32-main-parameter runs, every loss within 2e-3 relative (the bf16 copies
    round ties away from zero, not to even). The checkpoint holds fp32 main parameters and resumes bit for bit."""
    out = _one_process()
    rem, rem_clip, rem_adamw = out["rem-bf16m"], out["rem-bf16m-clip"], out["rem-adamw"]
    assert rem["direct"] == [True] * LONG_STEPS and rem_clip["direct"] == [False] * LONG_STEPS
    assert rem["losses"] == rem_clip["losses"] and rem["losses"][-1] < 0.9 * rem["losses"][0]
    for k, v in rem["final"].items():
        assert v.dtype == torch.float32 and torch.equal(v, rem_clip["final"][k]), k
    assert _worst(rem["losses"], out["bf16p-bf16m"]["losses"]) < 2e-3
    assert _worst(rem_adamw["losses"], out["bf16p"]["losses"]) < 2e-3
    c = out["checkpoint-rem"]
    assert set(c["ckpt_dtypes"].values()) == {torch.float32}, c["ckpt_dtypes"]
    assert c["first"] == c["whole"][:2] and c["rest"] == c["whole"][2:], (c["rest"], c["whole"])
    for k, v in c["whole_state"].items():
        assert torch.equal(v, c["resumed_state"][k]), k
    assert len(c["fp32_resumed"]) == 2 and abs(c["fp32_resumed"][0] - c["whole"][2]) < 2e-3 * c["whole"][2]


# ---------------------------------------------------------------------------------------------- overlapped reduction
def _overlap_run(rank: int, world: int, microbatches: int) -> Dict[str, Any]:
    """Two ranks, a 3-layer bf16 MLP in buckets of one matrix each, ``microbatches`` backward passes per step with
    the data-parallel reduction overlapped: how many buckets started inside the backward, and the averaged fp32 main
    gradients against the mean of both ranks' gradients computed without it."""
    from tests._dist import init_gloo

    init_gloo(rank, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    reference = [p.detach().to(torch.bfloat16).float().clone().requires_grad_() for p in model.parameters()]
    main = MainParams(model, bucket_size=64)
    main.overlap_reduction(torch.distributed.group.WORLD, world)
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(microbatches)]
    main.start_step(direct=False)
    main.arm_reduction(microbatches)
    for x in inputs:
        model(x.to(torch.bfloat16)).float().square().sum().backward()
    started = main.started_in_backward
    main.finish_backward()
    main.finish_reduction()
    got = [p.grad.clone() for p in model.parameters()]
    # the same gradients by hand: each rank's bf16 backward summed in fp32, then averaged over the ranks
    local = [torch.zeros_like(r) for r in reference]
    for x in inputs:
        w = [r.detach().to(torch.bfloat16).requires_grad_() for r in reference]
        h = x.to(torch.bfloat16)
        for weight in w:
            h = h @ weight.t()
        h.float().square().sum().backward()
        for acc, weight in zip(local, w):
            acc += weight.grad.float()
    for g in local:
        torch.distributed.all_reduce(g)
        g /= world
    return {"started": started, "buckets": len(main.buckets), "errors": [float((a - b).abs().max())
                                                                         for a, b in zip(got, local)]}


@pytest.mark.parametrize("microbatches", [1, 3])
def test_bucket_reductions_start_inside_the_backward_and_average(microbatches):
    """Megatron's overlap_grad_reduce on the fp32 main-gradient buckets: every bucket's all-reduce starts inside the
    step's last backward (the last bucket first, as the backward completes them) and the result is the dp average
    of the fp32-accumulated gradients."""
    for r in run_distributed(_overlap_run, 2, microbatches):
        assert r["buckets"] == 3
        assert r["started"] == 3, r
        assert max(r["errors"]) <= 1e-6, r
