"""End-to-end numerics of context parallelism: MegatronStrategy(cp=...) under the real Trainer against the
single-process run (loss per optimizer step, final weights), for each attention communication type and
composed with TP+SP, PP and DP. The sequence split happens in the strategy; data modules are unchanged."""
import pytest

from tests.parity import check_layout_matches_single_process, tiny_config

CASES = {
    # id: (world, strategy kwargs, config overrides, micro-batches per step, clip)
    "cp2-p2p": (2, dict(cp=2), {}, 1, 0.05),
    "cp2-all_gather": (2, dict(cp=2, cp_comm_type="all_gather"), {}, 1, None),
    "cp2-a2a-no-delay": (2, dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=False), {}, 1, None),
    "cp4-p2p": (4, dict(cp=4), {}, 1, None),
    "cp4-a2a+p2p": (4, dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]), {}, 1, None),
    "cp2-per-layer-types": (2, dict(cp=2, cp_comm_type=["p2p", "a2a"]), {}, 1, None),
    "cp2xtp2-sp": (4, dict(cp=2, tp=2, sequence_parallel=True), dict(num_query_groups=4), 1, 0.05),
    "cp2xpp2": (4, dict(cp=2, pp=2), {}, 2, None),
    "cp2xdp2": (4, dict(cp=2), {}, 1, 0.05),
    # delayed weight gradients (run during the a2a exchanges; DDP over dp x cp still reduces them): the default
    # for the a2a layers at tp=1, so "cp4-a2a+p2p", "cp2-per-layer-types" and the last case run them too
    "cp2-a2a-delay-wgrad": (2, dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True), {}, 1, 0.05),
    "cp2xdp2-a2a-delay-wgrad": (4, dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True), {}, 2, 0.05),
    "cp4-a2a+p2p-no-delay": (4, dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
                                     delay_wgrad_compute=False), {}, 1, None),
    "cp2xpp2-a2a-delay-wgrad": (4, dict(cp=2, pp=2, cp_comm_type="a2a", delay_wgrad_compute=True), {}, 2, None),
    "cp2xpp2-per-layer-types": (4, dict(cp=2, pp=2, cp_comm_type=["a2a", "p2p"]), {}, 2, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_single_process(case):
    world, kwargs, overrides, accumulate, clip = CASES[case]
    check_layout_matches_single_process(world, kwargs, tiny_config(**overrides), accumulate, clip)


def test_seq_length_must_divide_into_cp_chunks():
    from lightning_megatron import ParallelConfig

    cfg = tiny_config(seq_length=12)
    with pytest.raises(ValueError, match=r"seq_length=12 is not divisible by 2\*cp \(load-balanced CP chunks\) = 8"):
        ParallelConfig(cp=4).validate_model(cfg)
    with pytest.raises(ValueError, match=r"seq_length=12 is not divisible by 2\*cp\*tp .* = 8"):
        ParallelConfig(cp=2, tp=2, sequence_parallel=True).validate_model(cfg)
