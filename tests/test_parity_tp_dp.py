"""End-to-end numerics: MegatronStrategy (TP, TP+SP, DP, TP x DP) against the single-process run."""
import pytest

from tests._dist import run_distributed
from tests.parity import (
    assert_state_close,
    check_layout_matches_single_process,
    make_samples,
    parallel_run,
    reference_run,
    tiny_config,
)

STEPS = 3
GLOBAL_BATCH = 4


@pytest.mark.parametrize(
    "world,kwargs,clip",
    [
        (2, dict(tp=2), None),
        (2, dict(tp=2, sequence_parallel=True), 0.05),
        (2, dict(tp=2, sequence_parallel=True), None),
        (2, dict(tp=2), 0.05),
        (4, dict(tp=4, sequence_parallel=True), None),
        (2, dict(), 0.05),
        (4, dict(tp=2), 0.05),
    ],
    ids=["tp2", "tp2-sp-clip", "tp2-sp", "tp2-clip", "tp4-sp", "dp2-clip", "tp2xdp2-clip"],
)
def test_matches_single_process(world, kwargs, clip):
    cfg = tiny_config(num_query_groups=4)
    samples = make_samples(cfg, STEPS * GLOBAL_BATCH)
    ref_losses, ref_state = reference_run(cfg, samples, STEPS, GLOBAL_BATCH, clip)
    dp = world // kwargs.get("tp", 1)
    results = run_distributed(parallel_run, world, cfg, kwargs, samples, STEPS, GLOBAL_BATCH // dp, clip)
    for r in results:
        assert len(r["losses"]) == STEPS
        for got, want in zip(r["losses"], ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], ref_losses)
    assert_state_close(results[0]["state"], ref_state)


@pytest.mark.parametrize("world,kwargs", [(2, dict()), (4, dict(tp=2, sequence_parallel=True))], ids=["dp2", "tp2xdp2-sp"])
def test_gradient_accumulation_matches_single_process(world, kwargs):
    """``accumulate_grad_batches=2`` (DDP skips the reduction of the first micro-batch) against the reference:
    the mean loss of every optimizer step and the final weights."""
    check_layout_matches_single_process(world, kwargs, tiny_config(num_query_groups=4), accumulate=2, clip=0.05)
