"""``MegatronStrategy(data_parallel_sharding_strategy="optim_grads" | "optim_grads_params")`` (FSDP2 over dp x cp,
experts over edp): the same training as the single-process run (loss of every step and final weights within 1e-5,
fp32, with gradient clipping and 2 micro-batches per step) under dp2, tp2 x dp2 + SP, pp2 x dp2 and ep2 (edp2); the
parameters, gradients and optimizer states really sharded; full checkpoints written from FSDP tp2 x dp2 resume under
tp1, and tp1 checkpoints resume under FSDP tp2 x dp2. Every case of one world size runs in one set of processes."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy, ParallelConfig
from tests._dist import run_distributed, run_each
from tests.parity import (SEED, ListDataset, StepLossRecorder, assert_state_close, make_samples, new_module,
                          reference_loop, tiny_config, trainer_for)

ACCUMULATE, CLIP, STEPS, MICRO = 2, 0.05, 3, 2
LEVELS = ("optim_grads", "optim_grads_params")
LAYOUTS = {
    # id: (world, strategy kwargs)
    "dp2": (2, dict()),
    "tp2xdp2-sp": (4, dict(tp=2, sequence_parallel=True)),
    "pp2xdp2": (4, dict(pp=2)),
}


class ShardProbe(pl.Callback):
    """After training: elements of the parameters (and Adam's moments) this rank holds against the whole tensors
    FSDP sees (this rank's tensor-parallel shards), and whether every parameter and gradient is a ``DTensor``."""

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        params = list(pl_module.parameters())
        self.dtensors = all(isinstance(p, DTensor) for p in params)
        self.grads = all(isinstance(p.grad, DTensor) for p in params if p.grad is not None)
        self.local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        self.whole = sum(p.numel() for p in params)
        state = trainer.optimizers[0].state
        self.state_local = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                               for s in state.values() for v in s.values() if v.dim() > 0)


def fsdp_layout_run(rank: int, world: int, cfg, kwargs: Dict[str, Any], samples, moe: bool) -> Dict[str, Any]:
    """One rank of a 3-step run (2 micro-batches of 2 samples per step and rank, clip 0.05): each step's loss (and
    MoE aux loss), the sharding probe and (rank 0) the full final state."""
    import torch.distributed as dist

    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    recorder = StepLossRecorder(ACCUMULATE, keys=("train_loss", "moe_aux_loss") if moe else ("train_loss",))
    probe = ShardProbe()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), STEPS, callbacks=[recorder, probe],
                          gradient_clip_val=CLIP, accumulate_grad_batches=ACCUMULATE)
    # FSDP's gradient reduce-scatters (torch 2.13 issues them through dist.reduce_scatter_single), counted
    calls, reduce_scatter = [], dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=MICRO, shuffle=False))
    finally:
        dist.reduce_scatter_single = reduce_scatter
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "aux": recorder.values.get("moe_aux_loss"),
            "reductions": (len(calls), len(trainer.strategy.fsdp.units)),
            "probe": (probe.dtensors, probe.grads, probe.local, probe.whole, probe.state_local),
            "state": {k: v.cpu() for k, v in state.items()} if rank == 0 else None}


def checkpoint_step(rank: int, world: int, what: str, *args: Any) -> Any:
    """``train_and_save`` / ``resume`` of tests/test_strategy.py (the resume reference is built there)."""
    from tests.test_strategy import resume, train_and_save

    return (train_and_save if what == "save" else resume)(rank, world, *args)


def run_cases(rank: int, world: int, cases: List[Tuple[str, tuple]]) -> Dict[str, Any]:
    """Every case of one world size in this one process group: ``(name, (kind, arguments))``."""
    def one(rank: int, world: int, kind: str, *args: Any) -> Any:
        return fsdp_layout_run(rank, world, *args) if kind == "layout" else checkpoint_step(rank, world, kind, *args)

    return run_each(rank, world, one, cases)


def _dp(world: int, kwargs: Dict[str, Any]) -> int:
    return world // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))


def _reference(cfg, samples, global_batch: int) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    ref = reference_loop(cfg, samples, STEPS, global_batch, CLIP, accumulate=ACCUMULATE)
    losses = ref["losses"]
    return [sum(losses[i * ACCUMULATE:(i + 1) * ACCUMULATE]) / ACCUMULATE for i in range(STEPS)], ref["state"]


def _assert_run_matches(results: List[Dict[str, Any]], ref_losses: List[float], ref_state, ref_aux=None) -> None:
    for r in results:
        # one reduce-scatter per FSDP unit and optimizer step: none for the non-final micro-batch
        reductions, units = r["reductions"]
        assert reductions == units * STEPS, r["reductions"]
        assert len(r["losses"]) == STEPS, r["losses"]
        for got, want in zip(r["losses"] + (r["aux"] or []), ref_losses + (ref_aux or [])):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["aux"], ref_losses, ref_aux)
    assert_state_close(results[0]["state"], ref_state)


def _assert_sharded(results: List[Dict[str, Any]], dp: int) -> None:
    for r in results:
        dtensors, grads, local, whole, state_local = r["probe"]
        assert dtensors and grads, r["probe"]
        # dim-0 shards over dp ranks: about 1/dp of each tensor (small tensors round up), Adam's two moments alike
        assert local <= whole / dp * 1.3, r["probe"]
        assert state_local == 2 * local, r["probe"]


def _layout_cases(world: int) -> Dict[str, Tuple[tuple, Any]]:
    """``name -> (case arguments, reference)`` of the dense layouts of ``world`` processes under both levels."""
    cfg = tiny_config()
    cases = {}
    for name, (w, kwargs) in LAYOUTS.items():
        if w != world:
            continue
        global_batch = MICRO * _dp(world, kwargs)
        samples = make_samples(cfg, STEPS * ACCUMULATE * global_batch)
        ref = _reference(cfg, samples, global_batch)
        for level in LEVELS:
            args = ("layout", cfg, dict(kwargs, data_parallel_sharding_strategy=level), samples, False)
            cases[f"{name}-{level}"] = (args, ref)
    return cases


def test_fsdp_dp2_matches_single_process():
    """Both levels at dp2, and ZeRO-3 with full activation recompute (each layer's recompute runs inside its
    backward, where FSDP has gathered the layer's parameters)."""
    cases = _layout_cases(2)
    (args, ref) = cases["dp2-optim_grads_params"]
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cases["dp2-optim_grads_params-full-recompute"] = ((*args[:2], dict(args[2], **recompute), *args[3:]), ref)
    # ep2 at world 2: edp = 1, the experts stay out of FSDP (nothing to shard them over) and are reduced as under DDP
    from tests.test_parity_moe import moe_config, moe_reference

    moe = moe_config()
    moe_samples = make_samples(moe, STEPS * ACCUMULATE * MICRO * 2)
    cases["ep2-edp1-optim_grads_params"] = (("layout", moe, dict(ep=2, data_parallel_sharding_strategy="optim_grads_params"),
                                             moe_samples, True), moe_reference(moe, moe_samples, MICRO * 2, ACCUMULATE, CLIP))
    results = run_distributed(run_cases, 2, [(name, args) for name, (args, _) in cases.items()])
    for name, (args, ref) in cases.items():
        per_rank = [r[name] for r in results]
        assert not isinstance(per_rank[0], str), per_rank[0]
        if name.startswith("ep2"):
            losses, aux, state = ref
            _assert_run_matches(per_rank, losses, state, aux)
            dtensors, grads, local, whole, state_local = per_rank[0]["probe"]
            assert not dtensors and local < whole, per_rank[0]["probe"]   # dense sharded, experts whole
        else:
            _assert_run_matches(per_rank, *ref)
            _assert_sharded(per_rank, dp=2)


def test_fsdp_world4_layouts_moe_and_checkpoints(tmp_path):
    """One set of 4 processes: tp2 x dp2 + SP and pp2 x dp2 under both levels; ep2 (dense over dp4, experts over
    edp2) under both levels against tests/test_parity_moe.py's reference; then a checkpoint of FSDP tp2 x dp2 resumed
    under tp1 (dp4, no sharding) and one of tp1 (dp4) resumed under FSDP tp2 x dp2, against the uninterrupted
    single-process run (tests/test_strategy.py's resume reference)."""
    from tests.test_parity_moe import moe_config, moe_reference
    from tests.test_strategy import GLOBAL_BATCH, N_TRAIN, RESUME_STEPS, SAVE_AT, resume_order

    cases = _layout_cases(4)
    moe = moe_config()
    moe_samples = make_samples(moe, STEPS * ACCUMULATE * MICRO * 4)
    moe_ref = moe_reference(moe, moe_samples, MICRO * 4, ACCUMULATE, CLIP)
    moe_names = []
    for level in LEVELS:
        args = ("layout", moe, dict(ep=2, data_parallel_sharding_strategy=level), moe_samples, True)
        cases[f"ep2xdp2-edp2-{level}"] = (args, moe_ref)
        moe_names.append(f"ep2xdp2-edp2-{level}")
    ckpt_cfg = tiny_config(num_query_groups=4)
    ckpt_samples = make_samples(ckpt_cfg, N_TRAIN)
    fsdp_tp2 = dict(tp=2, data_parallel_sharding_strategy="optim_grads_params")
    tp1 = dict(tp=1)
    from_fsdp, from_tp1 = str(tmp_path / "fsdp-tp2xdp2.ckpt"), str(tmp_path / "tp1.ckpt")
    ckpt_cases = [
        ("save-fsdp-tp2xdp2", ("save", ckpt_cfg, ckpt_samples, fsdp_tp2, GLOBAL_BATCH // 2, from_fsdp)),
        ("save-tp1", ("save", ckpt_cfg, ckpt_samples, tp1, GLOBAL_BATCH // 4, from_tp1)),
        ("fsdp-tp2xdp2-to-tp1", ("resume", ckpt_cfg, ckpt_samples, tp1, GLOBAL_BATCH // 4, from_fsdp)),
        ("tp1-to-fsdp-tp2xdp2", ("resume", ckpt_cfg, ckpt_samples, fsdp_tp2, GLOBAL_BATCH // 2, from_tp1)),
    ]
    results = run_distributed(run_cases, 4, [(n, a) for n, (a, _) in cases.items()] + ckpt_cases)
    failures = {n: r[n] for r in results for n in r if isinstance(r[n], str)}
    assert not failures, next(iter(failures.values()))
    for name, (args, ref) in cases.items():
        per_rank = [r[name] for r in results]
        if name in moe_names:
            losses, aux, state = ref
            _assert_run_matches(per_rank, losses, state, aux)
            # dense parameters over dp4, experts over edp2: at most about half of this rank's tensors
            _assert_sharded(per_rank, dp=2)
        else:
            _assert_run_matches(per_rank, *ref)
            _assert_sharded(per_rank, dp=2)
    # checkpoints: the FSDP one holds the full tp1 state of the single-process run after SAVE_AT steps
    ref_full = reference_loop(ckpt_cfg, ckpt_samples, RESUME_STEPS, GLOBAL_BATCH, order=resume_order())
    ref_save = reference_loop(ckpt_cfg, ckpt_samples, RESUME_STEPS, GLOBAL_BATCH, order=resume_order(),
                              stop_after=SAVE_AT)
    for path in (from_fsdp, from_tp1):
        ckpt = torch.load(path, weights_only=False, map_location="cpu")
        assert_state_close(ckpt["state_dict"], ref_save["state"])
        names = [n for n, _ in ref_save["module"].named_parameters()]
        groups = ckpt["optimizer_states"][0]["param_groups"]
        flat = [n for g in groups for n in g["params"]]
        want = ref_save["optimizer"]["state"]
        assert sorted(flat) == sorted(names)
        for index, values in want.items():
            got = ckpt["optimizer_states"][0]["state"][flat[index]]
            for key in ("exp_avg", "exp_avg_sq"):
                assert_state_close({key: got[key]}, {key: values[key]})
    for name in ("fsdp-tp2xdp2-to-tp1", "tp1-to-fsdp-tp2xdp2"):
        for r in (res[name] for res in results):
            assert r["global_step"] == RESUME_STEPS
            for got, want in zip(r["losses"], ref_full["losses"][SAVE_AT:]):
                assert abs(got - want) <= 1e-5 * abs(want), (name, r["losses"], ref_full["losses"][SAVE_AT:])
            assert len(r["losses"]) == RESUME_STEPS - SAVE_AT
        assert_state_close(results[0][name]["state"], ref_full["state"])


# ------------------------------------------------------------------------------------------------ options
def test_sharding_level_options():
    assert ParallelConfig().data_parallel_sharding_strategy == "no_shard"
    alias = ParallelConfig(use_distributed_optimizer=True)
    assert alias.data_parallel_sharding_strategy == "optim" and not alias.fsdp
    optim = ParallelConfig(data_parallel_sharding_strategy="optim")
    assert optim.use_distributed_optimizer
    zero3 = ParallelConfig(data_parallel_sharding_strategy="optim_grads_params", use_distributed_optimizer=True)
    assert zero3.fsdp and zero3.delay_wgrad_compute is False
    with pytest.raises(ValueError, match="'no_shard' contradicts use_distributed_optimizer=True"):
        ParallelConfig(data_parallel_sharding_strategy="no_shard", use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="'optim_grads_param' is not one of"):
        ParallelConfig(data_parallel_sharding_strategy="optim_grads_param")
    with pytest.raises(ValueError, match="with vp=2"):
        ParallelConfig(pp=2, vp=2, data_parallel_sharding_strategy="optim_grads")
    with pytest.raises(ValueError, match="delay_wgrad_compute=True"):
        ParallelConfig(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True,
                       data_parallel_sharding_strategy="optim_grads")
    strategy = MegatronStrategy(data_parallel_sharding_strategy="optim_grads")
    assert strategy.parallel_config.fsdp


def test_mixed_precision_policy_from_the_precision_setting():
    from lightning_megatron.parallel.fsdp import mixed_precision_policy

    policy = mixed_precision_policy("bf16-mixed", ParallelConfig())
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    reduced_bf16 = mixed_precision_policy("bf16-mixed", ParallelConfig(grad_reduce_in_bf16=True))
    assert reduced_bf16.reduce_dtype == torch.bfloat16
    assert mixed_precision_policy("32-true", ParallelConfig()) is None
    assert mixed_precision_policy("32-true", ParallelConfig(grad_reduce_in_bf16=True)).reduce_dtype == torch.bfloat16
    assert mixed_precision_policy("bf16-true", ParallelConfig()) is None


def _fit_twice_or_once(rank: int, world: int, twice: bool, samples) -> Dict[str, torch.Tensor]:
    pl.seed_everything(SEED, verbose=False)
    module = new_module(tiny_config(), 2, adamw="sgd")   # stateless: a second fit's new optimizer changes nothing
    strategy = MegatronStrategy(data_parallel_sharding_strategy="optim_grads")
    data = DataLoader(ListDataset(samples), batch_size=2, shuffle=False)
    trainer = trainer_for(world, strategy, 1 if twice else 2, gradient_clip_val=0.05)
    trainer.fit(module, data)
    if twice:
        trainer.fit_loop.epoch_loop.max_steps = 2
        trainer.fit(module, data)
    return {k: v.detach().cpu().clone() for k, v in strategy.lightning_module_state_dict().items()}


def test_a_second_fit_under_fsdp_clips_by_the_whole_norm():
    """FSDP dp2 with clipping, plain SGD, every batch the same: one step, then a second ``fit`` of the same strategy
    for the next, ends bit-equal to two steps in one ``fit`` (the second fit's gradient finaliser keeps the FSDP
    units, so its clip norm sums the shards over dp; without them it clips by this rank's shard: 1.7e-3 off)."""
    samples = make_samples(tiny_config(), 1) * 8
    twice = run_distributed(_fit_twice_or_once, 2, True, samples)
    once = run_distributed(_fit_twice_or_once, 2, False, samples)
    for name, value in once[0].items():
        assert torch.equal(twice[0][name], value), (name, float((twice[0][name] - value).abs().max()))
