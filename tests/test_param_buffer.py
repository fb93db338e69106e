"""The parameter-and-gradient buffer (``MainParams``) as the one owner of the gradients outside the FSDP levels, for
parameters in their own dtype (fp32, fp64) as for bf16 ones: the data-parallel replicas start equal (the buffer is
broadcast once, as torch DDP does when it wraps a model); ``p.grad`` of an fp32 parameter is its view of the buffer,
so a callback reading it after the backward sees the gradient; no parameter of any layout is held outside the
buffer (its storage is the buffer's); every gradient route of a step reaches it once (plain SGD, final weights
against one process, in ``tests/test_parity_tp_dp.py``, ``test_parity_pp.py``, ``test_overlap.py``)."""
from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from tests._dist import run_distributed
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for


class GradientsSeen(pl.Callback):
    """After the first backward: how many parameters hold a gradient on ``p.grad`` and whether each of those is a view
    of the buffer's gradient storage; and whether every parameter's storage lies in one of the buffer's buckets."""

    def __init__(self) -> None:
        self.seen: Dict[str, Any] = {}

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.seen:
            return
        buffer = trainer.strategy.parallelized.main_params
        grads = [b.grad for b in buffer.buckets if b.grad is not None]

        def inside(t: torch.Tensor, flats) -> bool:
            start = t.untyped_storage().data_ptr()
            return any(start == f.untyped_storage().data_ptr() for f in flats)

        params = list(pl_module.parameters())
        with_grad = [p for p in params if p.grad is not None]
        self.seen = {
            "params": len(params),
            "with_grad": len(with_grad),
            "grads_in_buffer": sum(inside(p.grad, grads) for p in with_grad),
            "params_in_buffer": sum(inside(p, [b.compute for b in buffer.buckets]) for p in params),
            "finite": all(bool(torch.isfinite(p.grad).all()) for p in with_grad),
        }


def _train(rank: int, world: int, kwargs: Dict[str, Any], samples, seed_by_rank: bool) -> Dict[str, Any]:
    pl.seed_everything(SEED + (rank if seed_by_rank else 0), verbose=False)   # ranks may initialise apart
    module, seen = new_module(tiny_config(), 2), GradientsSeen()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), 2, callbacks=[seen])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    return {"state": {k: v.detach().cpu().clone() for k, v in state.items()}, "seen": seen.seen,
            "local": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}


def test_replicas_start_equal_from_the_first_rank():
    """Two data-parallel ranks that initialise differently (another seed each) train as one: the buffer is
    broadcast from dp rank 0 before the first step, so both end with the same weights, bit for bit."""
    samples = make_samples(tiny_config(), 8)
    apart = run_distributed(_train, 2, {}, samples, True)
    for name, value in apart[0]["local"].items():   # the same update from different starts would stay apart
        assert torch.equal(value, apart[1]["local"][name]), name


def test_fp32_gradients_are_views_of_the_buffer_and_every_parameter_lives_in_it():
    """fp32 parameters under dp2, tp2 + SP and pp2: after the backward every parameter that has a gradient holds it
    on ``p.grad``, a view of the buffer's gradient storage; every parameter is a view of a bucket."""
    samples = make_samples(tiny_config(), 8)
    for world, kwargs in ((2, {}), (2, dict(tp=2, sequence_parallel=True)), (2, dict(pp=2))):
        for r in run_distributed(_train, world, kwargs, samples, False):
            seen = r["seen"]
            assert seen and seen["with_grad"] > 0 and seen["finite"], (kwargs, seen)
            assert seen["grads_in_buffer"] == seen["with_grad"], (kwargs, seen)
            assert seen["params_in_buffer"] == seen["params"], (kwargs, seen)


class ReducedGradients(pl.Callback):
    """Before the first optimizer step: each bucket's reduced gradients (the whole buffer, on CPU) and its shard's
    run ``(start, length)`` (None without the distributed optimizer)."""

    def __init__(self, reduce_scatter: Optional[bool] = None) -> None:
        self.buckets: list = []
        self.reduce_scatter = reduce_scatter

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.parallelized.main_params.reduce_scatter = self.reduce_scatter

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.buckets:
            return
        buffer = trainer.strategy.parallelized.main_params
        self.buckets = [(b.grad.detach().cpu().clone(), None if b.shard is None else (b.shard.start, b.shard.length))
                        for b in buffer.buckets if b.grad is not None]


def _reduced(rank: int, world: int, kwargs: Dict[str, Any], samples,
             reduce_scatter: Optional[bool] = None) -> Dict[str, Any]:
    from lightning_megatron.parallel.param_buffer import buffer

    scatters = []   # the buffer's reduce-scatters (real collectives, counted on their way through)
    real = buffer.reduce_scatter_into

    def counted(*args: Any, **kw: Any) -> Any:
        scatters.append(args[0].numel())
        return real(*args, **kw)

    buffer.reduce_scatter_into = counted
    try:
        pl.seed_everything(SEED, verbose=False)
        module, seen = new_module(tiny_config(), 2), ReducedGradients(reduce_scatter)
        trainer = trainer_for(world, MegatronStrategy(**kwargs), 1, callbacks=[seen])
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    finally:
        buffer.reduce_scatter_into = real
    return {"buckets": seen.buckets, "scatters": scatters, "steps": trainer.global_step}


@pytest.fixture(scope="module")
def all_reduced():
    """dp2 without the distributed optimizer, the same step: every rank's buckets hold the whole average (one run for
    both of the test's cases)."""
    return run_distributed(_reduced, 2, dict(bucket_size=3000), make_samples(tiny_config(), 8), True)


@pytest.mark.parametrize("reduce_scatter", [True, None], ids=["reduce-scatter", "gloo-default-all-reduce"])
def test_distributed_optimizer_reduce_scatters_each_bucket_into_the_shards(reduce_scatter, all_reduced):
    """dp2 with the distributed optimizer: each rank's gradient buckets hold the data-parallel average in its shard's
    run and zeros elsewhere; the two runs together are the average the all-reduce of the same step leaves on every
    rank (dp2 without the distributed optimizer). ``reduce_scatter=True`` (NCCL's default): one reduce-scatter per
    bucket and step, half an all-reduce's traffic; None on gloo: an all-reduce of which each rank keeps its run."""
    samples = make_samples(tiny_config(), 8)
    runs = run_distributed(_reduced, 2, dict(use_distributed_optimizer=True, bucket_size=3000), samples,
                           reduce_scatter)
    plain = all_reduced
    scattered, whole = [r["buckets"] for r in runs], [r["buckets"] for r in plain]
    assert len(scattered[0]) > 2 and len(scattered[0]) == len(whole[0])
    expected = runs[0]["steps"] * len(scattered[0]) if reduce_scatter else 0
    assert len(runs[0]["scatters"]) == expected, (runs[0]["scatters"], runs[0]["steps"])
    assert plain[0]["scatters"] == []   # unsharded buckets are all-reduced whatever reduce_scatter says
    for index, (average, run) in enumerate(whole[0]):
        assert run is None and torch.equal(average, whole[1][index][0])
        parts = [rank[index][0] for rank in scattered]
        for rank, part in enumerate(parts):
            start, length = scattered[rank][index][1]
            outside = torch.cat([part[:start], part[start + length:]])
            assert torch.count_nonzero(outside) == 0, (index, rank)
            assert torch.count_nonzero(part[start:start + length]) > 0, (index, rank)
        together = (parts[0] + parts[1])[:average.numel()]
        torch.testing.assert_close(together, average, rtol=1e-6, atol=1e-9)
