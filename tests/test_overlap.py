"""The three communication overlaps (``overlap_grad_reduce``, ``overlap_param_gather``, ``tp_comm_overlap``) are
exact: the same training as one process (loss of every step and final weights within 1e-5, fp32), under tp2+SP,
dp, cp2, pp2 x dp2 and ep2, each with evidence that the overlapped path ran (buckets started inside backward,
parameters waited for inside forward, ring layers); and the ring layers alone against the collectives at tp=4.
All cases share one spawn of 4 gloo processes."""
from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from tests._dist import run_distributed, run_each
from tests.parity import (SEED, ListDataset, StepLossRecorder, assert_state_close, make_samples, new_module,
                          reference_loop, tiny_config, trainer_for)

STEPS = 3
MICRO = 2

# id: (strategy kwargs, micro-batches per step, clip, what the evidence must show)
CASES: Dict[str, tuple] = {
    "tp2xdp2-sp-tp_comm_overlap": (dict(tp=2, sequence_parallel=True, tp_comm_overlap=True), 2, 0.05, "ring"),
    "dp4-no-overlap_grad_reduce": (dict(overlap_grad_reduce=False), 2, None, "after-backward"),
    "cp2xdp2-bucket_size": (dict(cp=2, overlap_grad_reduce=True, bucket_size=3000), 1, 0.05, "buckets"),
    "pp2xdp2-overlap_grad_reduce": (dict(pp=2, overlap_grad_reduce=True, bucket_size=3000), 4, 0.05, "backward"),
    "pp2xdp2-interleaved-overlap_grad_reduce": (
        dict(pp=2, vp=2, overlap_grad_reduce=True, bucket_size=3000), 2, None, "backward"),
    # zero-bubble: weight gradients computed apart from autograd's accumulation, so buckets may be left to finish()
    "pp2xdp2-zbv-overlap_grad_reduce": (dict(pp=2, vp=2, pipeline_schedule="zbv", overlap_grad_reduce=True,
                                             bucket_size=3000), 2, 0.05, "exact"),
    "dp4-overlap_param_gather": (dict(use_distributed_optimizer=True, overlap_param_gather=True), 1, 0.05,
                                 "forward"),
    "pp2xdp2-overlap_param_gather": (dict(pp=2, use_distributed_optimizer=True, overlap_param_gather=True,
                                          overlap_grad_reduce=True), 2, None, "forward"),
}
CONFIG = {"pp2xdp2-interleaved-overlap_grad_reduce": dict(num_layers=4),
          "pp2xdp2-zbv-overlap_grad_reduce": dict(num_layers=4)}


class Evidence(pl.Callback):
    """What the overlapped paths did during training (rank-local counts)."""

    def on_train_end(self, trainer, pl_module) -> None:
        from lightning_megatron.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        s = trainer.strategy
        buffer = s.parallelized.main_params   # the parameters' buffer: its dense buckets reduce over dp x cp
        dense = [b for b in buffer.buckets if not b.expert]
        self.seen = {
            "ring_layers": sum(bool(getattr(m, "tp_comm_overlap", False)) for m in pl_module.modules()
                               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))),
            "buckets": len(dense),
            "started_in_backward": buffer.started_in_backward,
            "waited_in_forward": s.run.param_gather.waited_in_forward if s.run.param_gather is not None else None,
            # elements of each bucket of matrices holding more than one parameter
            "shared_bucket_elements": [b.numel for b in dense if len(b.params) > 1 and b.params[0].dim() > 1],
        }


def _train(rank: int, world: int, cfg, kwargs: Dict[str, Any], samples, accumulate: int,
           clip: Optional[float]) -> Dict[str, Any]:
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    recorder, evidence = StepLossRecorder(accumulate), Evidence()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), STEPS, callbacks=[recorder, evidence],
                          gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=MICRO, shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "seen": evidence.seen,
            "state": {k: v.cpu() for k, v in state.items()} if rank == 0 else None}


def _ring_layers(rank: int, world: int) -> Dict[str, float]:
    """Column- and row-parallel layers over a TP group of ``world`` with the ring against the collectives: outputs
    and gradients of input, weight and bias (fp32; and under bf16 autocast; with the gather recomputed)."""
    import torch.distributed as dist

    from lightning_megatron.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not dist.is_initialized():
        from tests._dist import init_gloo

        init_gloo(rank, world)
    group = dist.new_group(list(range(world)))
    errors: Dict[str, float] = {}
    for name, autocast, regather in (("fp32", False, False), ("bf16", True, False), ("regather", False, True)):
        torch.manual_seed(11)   # the same weights and inputs on every rank, then each takes its part
        col = ColumnParallelLinear(16, 8 * world, group, bias=True, sequence_parallel=True)
        row = RowParallelLinear(8 * world, 16, group, sequence_parallel=True)
        for layer in (col, row):
            torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(col.bias)
        col.recompute_input_gather = regather
        x_full = torch.randn(4 * world, 3, 16)
        grad_full = torch.randn(4 * world, 3, 16)
        results = []
        for ring in (False, True):
            col.tp_comm_overlap = row.tp_comm_overlap = ring
            for p in (*col.parameters(), *row.parameters()):
                p.grad = None
            x = x_full.chunk(world)[rank].clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = row(col(x))
            y.backward(grad_full.chunk(world)[rank].to(y.dtype))
            results.append([y.float(), x.grad, col.weight.grad, col.bias.grad, row.weight.grad])
        for i, (a, b) in enumerate(zip(*results)):
            errors[f"{name}-{i}"] = float((a - b).norm() / b.norm())
    return errors


def _case(rank: int, world: int, kind: str, *args: Any) -> Any:
    if kind == "moe":
        from tests.test_parity_moe import moe_layout_run

        return moe_layout_run(rank, world, *args)
    return _ring_layers(rank, world) if kind == "layers" else _train(rank, world, *args)


# ep2 x dp4 (edp 2) MoE: the distributed optimizer's two parts (dense over dp, experts over edp) both broadcast
# without waiting, with the SP rings at tp2 and the overlapped pipeline reduction in the other cases
MOE_KWARGS = dict(ep=2, use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
                  bucket_size=3000)


@pytest.fixture(scope="module")
def runs():
    """Every case in one spawn of 4 processes (and the single-process reference of each)."""
    cases, refs = [], {}
    for name, (kwargs, accumulate, clip, _) in CASES.items():
        cfg = tiny_config(**CONFIG.get(name, {}))
        model_parallel = kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1)
        global_batch = MICRO * (4 // model_parallel)
        samples = make_samples(cfg, STEPS * accumulate * global_batch)
        ref = reference_loop(cfg, samples, STEPS, global_batch, clip, accumulate=accumulate)
        refs[name] = ([sum(ref["losses"][i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(STEPS)],
                      ref["state"])
        cases.append((name, ("train", cfg, kwargs, samples, accumulate, clip)))
    from tests.test_parity_moe import STEPS as MOE_STEPS, moe_config, moe_reference

    assert MOE_STEPS == STEPS
    moe = moe_config()
    samples = make_samples(moe, STEPS * 2 * 4)
    refs["moe"] = moe_reference(moe, samples, 2 * 4, 1, 0.05)
    cases.append(("moe", ("moe", moe, MOE_KWARGS, samples, 2, 1, 0.05)))
    cases.append(("layers", ("layers",)))   # after the Trainers: the process group exists
    return run_distributed(run_each, 4, _case, cases), refs


def test_ring_layers_match_the_collectives(runs):
    results, _ = runs
    for r in results:
        errors = r["layers"]
        assert isinstance(errors, dict), errors
        for key, err in errors.items():
            assert err <= (1e-2 if key.startswith("bf16") else 1e-6), (key, err)


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_matches_single_process(runs, case):
    results, refs = runs
    ref_losses, ref_state = refs[case]
    for r in results:
        out = r[case]
        assert isinstance(out, dict), out
        for got, want in zip(out["losses"], ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (out["losses"], ref_losses)
        assert len(out["losses"]) == STEPS
    assert_state_close(results[0][case]["state"], ref_state)
    evidence = CASES[case][3]
    for r in results:
        seen = r[case]["seen"]
        if evidence == "ring":
            assert seen["ring_layers"] > 0, seen   # 2 layers x (qkv, proj, fc1, fc2) + the LM head
        elif evidence == "after-backward":   # every bucket reduced after the backward, none inside it
            assert seen["buckets"] >= 1 and seen["started_in_backward"] == 0, seen
        elif evidence == "buckets":   # bucket_size=3000 elements, each bucket started inside backward
            sizes = seen["shared_bucket_elements"]
            assert all(n <= 3000 for n in sizes) and seen["buckets"] > 2, seen
            assert seen["started_in_backward"] == STEPS * seen["buckets"], seen
        elif evidence == "backward":   # every bucket of every step started inside backward
            assert seen["buckets"] > 1 and seen["started_in_backward"] == STEPS * seen["buckets"], seen
        elif evidence == "forward":   # parameters waited for by the forward pre-hooks, after the first step
            assert seen["waited_in_forward"] > 0, seen


def test_ep2_distributed_optimizer_with_overlaps_matches_single_process(runs):
    """ep2 at world 4 (edp 2): loss and aux loss of every step and the final weights within 1e-5 of one process."""
    results, refs = runs
    ref_losses, ref_aux, ref_state = refs["moe"]
    for r in results:
        out = r["moe"]
        assert isinstance(out, dict), out
        assert len(out["losses"]) == STEPS
        for got, want in zip(out["losses"] + out["aux"], ref_losses + ref_aux):
            assert abs(got - want) <= 1e-5 * abs(want), (out["losses"], out["aux"], ref_losses, ref_aux)
    assert_state_close(results[0]["moe"]["state"], ref_state)


def test_option_rules_name_the_values_and_the_fix():
    from lightning_megatron import ParallelConfig
    from lightning_megatron.parallel.grad_buckets import ddp_bucket_kwargs, overlaps_grad_reduce

    with pytest.raises(ValueError, match="overlap_param_gather=True .* needs use_distributed_optimizer=True"):
        MegatronStrategy(overlap_param_gather=True)
    with pytest.raises(ValueError, match="tp_comm_overlap=True .* needs tp > 1 and sequence_parallel=True, got tp=2, "
                                         "sequence_parallel=False"):
        MegatronStrategy(tp=2, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="bucket_size=0 must be None or a positive number"):
        ParallelConfig(bucket_size=0)
    with pytest.raises(ValueError, match="overlap_grad_reduce='yes' must be None"):
        ParallelConfig(overlap_grad_reduce="yes")
    # the default keeps each path's own: DDP's overlapped buckets (pp = 1), one reduction after the schedule (pp > 1)
    assert overlaps_grad_reduce(ParallelConfig()) and not overlaps_grad_reduce(ParallelConfig(pp=2))
    assert overlaps_grad_reduce(ParallelConfig(pp=2, overlap_grad_reduce=True))
    linear = torch.nn.Linear(1024, 1024)   # 4 MiB of fp32 weight
    assert ddp_bucket_kwargs(linear, ParallelConfig(), {}) == {}
    assert ddp_bucket_kwargs(linear, ParallelConfig(bucket_size=2**20), {}) == {"bucket_cap_mb": 4.0}
    assert ddp_bucket_kwargs(linear, ParallelConfig(overlap_grad_reduce=False), {})["bucket_cap_mb"] > 4.0
    with pytest.raises(ValueError, match="bucket_cap_mb=10 and bucket_size=1000 .* give one of them"):
        ddp_bucket_kwargs(linear, ParallelConfig(bucket_size=1000), {"bucket_cap_mb": 10})
