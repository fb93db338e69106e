"""Sharp end-to-end numerics: every layout in float64 with plain SGD against the single-process float64 run,
compared by each parameter's weight change (the summed gradients times the learning rate) at 1e-10 relative.

Why a second tier (see :mod:`tests.sharp`): the fp32 AdamW tier at 1e-5 misses a gradient that is wrong by a
constant factor (AdamW divides it out; clipping cancels a global one) and sits near float32 noise. Here the
run is ``Trainer(precision="64-true")`` + ``MegatronStrategy`` on gloo, the reference the same model, data and
initial weights in one process, and the oracle the weights (never the logged losses).

Tolerance: float64 reproduces the reference to rounding. Observed max relative change error per case (printed
per case, ``-s`` shows them): 0 for the pipeline-only layouts (the same operations in the same order), <= 3e-14
for most, at most 1.9e-13 (tp4-sp, dp2: norm weights, whose small change is the difference of two weights near
1, so the subtraction alone carries ~1e-16 / |change|). The bar 1e-10 sits 500x above the largest. Planted
bugs land far above it: SP norm gradients doubled give 1.0 on the norm weights (~1e-3 elsewhere); all
gradients x2 give ~1 unclipped and 3e-7 even in the clipped cases (through the ``1e-6`` in the clip
coefficient ``max_norm / (norm + 1e-6)``); the SP norm weights counted twice in the clip norm give 1e-4.
Before float64 was kept in the cross-entropy and the gradient norm, every tp > 1 case sat at 5e-8 to 9e-8.

Layouts of one world size run in one set of processes (one spawn and import for all of them, which is most
of the cost of a case), case after case; each case is still its own test.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.parity import tiny_config
from tests.sharp import SharpCase, relative_change_errors, run_layouts
from tests.test_parity_moe import moe_config

#: relative weight-change error allowed: float64 noise measured <= 1.9e-13, planted bugs >= 1e-7 (module docstring)
RTOL = 1e-10
CLIP = 0.05

DENSE = tiny_config()
DENSE_TP = tiny_config(num_query_groups=4)   # 4 query groups split over tp=2 and tp=4
MOE = moe_config()

CASES: Dict[str, SharpCase] = {
    # ---- 2 processes
    "tp2": SharpCase(2, dict(tp=2), DENSE_TP),
    "tp2-sp": SharpCase(2, dict(tp=2, sequence_parallel=True), DENSE_TP, accumulate=2),
    # global-norm clipping (sharded over TP, SP norms counted once) against torch's clip_grad_norm_
    "tp2-sp-clip": SharpCase(2, dict(tp=2, sequence_parallel=True), DENSE_TP, clip=CLIP),
    "dp2": SharpCase(2, dict(), DENSE, accumulate=2),
    "pp2-1f1b": SharpCase(2, dict(pp=2), DENSE, accumulate=2),
    "pp2-gpipe-tied": SharpCase(2, dict(pp=2, pipeline_schedule="gpipe"),
                                tiny_config(untie_embeddings_and_output_weights=False), accumulate=2),
    "pp2-vp2-interleaved": SharpCase(2, dict(pp=2, vp=2), tiny_config(num_layers=4), accumulate=4),
    "pp2-zbv": SharpCase(2, dict(pp=2, vp=2, pipeline_schedule="zbv"), tiny_config(num_layers=4), accumulate=4),
    "pp2-uneven": SharpCase(2, dict(pp=2, num_layers_in_first_pipeline_stage=1), tiny_config(num_layers=3),
                            accumulate=2),
    # the last stage's tied copy is left out of the norm and scaled like its twin
    "pp2-tied-clip": SharpCase(2, dict(pp=2), tiny_config(untie_embeddings_and_output_weights=False),
                               accumulate=2, clip=CLIP),
    "cp2-p2p": SharpCase(2, dict(cp=2), DENSE),
    "cp2-all_gather": SharpCase(2, dict(cp=2, cp_comm_type="all_gather"), DENSE),
    "cp2-a2a": SharpCase(2, dict(cp=2, cp_comm_type="a2a"), DENSE, accumulate=2),
    "cp2-a2a-no-delay": SharpCase(2, dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=False), DENSE),
    "cp2-per-layer-types": SharpCase(2, dict(cp=2, cp_comm_type=["p2p", "a2a"]), DENSE),
    "dp2-distopt": SharpCase(2, dict(use_distributed_optimizer=True), DENSE, accumulate=2),
    # the buckets reduce-scattered into the shards: the clip norm sums the ranks' runs over dp
    "dp2-distopt-clip": SharpCase(2, dict(use_distributed_optimizer=True, bucket_size=3000), DENSE, clip=CLIP),
    "ep2": SharpCase(2, dict(ep=2), MOE),
    "ep2-allgather-grouped": SharpCase(2, dict(ep=2), moe_config(moe_token_dispatcher_type="allgather",
                                                                 moe_grouped_gemm=True), accumulate=2),
    "ep2-seqaux-expertbias": SharpCase(2, dict(ep=2), moe_config(
        moe_router_load_balancing_type="seq_aux_loss", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05)),
    # ---- 4 processes
    "tp2xdp2-sp": SharpCase(4, dict(tp=2, sequence_parallel=True), DENSE_TP, accumulate=2),
    "tp4-sp": SharpCase(4, dict(tp=4, sequence_parallel=True), DENSE_TP),
    "cp4-a2a+p2p": SharpCase(4, dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
                             DENSE),
    "cp2xtp2-sp": SharpCase(4, dict(cp=2, tp=2, sequence_parallel=True), DENSE_TP),
    "tp2xpp2-sp": SharpCase(4, dict(tp=2, pp=2, sequence_parallel=True), DENSE_TP, accumulate=2),
    "ep2xtp2-sp-etp2": SharpCase(4, dict(ep=2, tp=2, sequence_parallel=True), MOE),
    "ep2xdp2": SharpCase(4, dict(ep=2), MOE, accumulate=2),
    "pp4-1f1b": SharpCase(4, dict(pp=4), tiny_config(num_layers=4), accumulate=4),
    "cp2xpp2": SharpCase(4, dict(cp=2, pp=2), DENSE, accumulate=2),
    # the stages' data-parallel buckets started inside the backward (the losses carry the 1/M)
    "pp2xdp2-overlap": SharpCase(4, dict(pp=2, overlap_grad_reduce=True, bucket_size=2000), DENSE, accumulate=2),
    # reduce-scattered buckets started inside the backward; the tied embedding and its copy in equal buckets (the
    # stages' other buckets differ: one layer on the first, two on the last; the embedding straddles two runs)
    "pp2xdp2-distopt-tied-clip": SharpCase(4, dict(pp=2, use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                   num_layers_in_first_pipeline_stage=1),
                                           tiny_config(num_layers=3, vocab_size=1000,
                                                       untie_embeddings_and_output_weights=False),
                                           accumulate=2, clip=CLIP),
    # routed experts' buckets reduce-scattered over edp, the dense ones over dp
    "ep2xdp2-distopt-clip": SharpCase(4, dict(ep=2, use_distributed_optimizer=True), MOE, accumulate=2, clip=CLIP),
    "cp2xdp2-a2a": SharpCase(4, dict(cp=2, cp_comm_type="a2a"), DENSE, accumulate=2),
    "cp4-p2p": SharpCase(4, dict(cp=4), DENSE),
    "ep4": SharpCase(4, dict(ep=4), MOE),
    "ep2xpp2-expertbias-clip": SharpCase(4, dict(ep=2, pp=2), moe_config(
        moe_layer_freq=[1, 0], moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.05), accumulate=2, clip=CLIP),
    "ep2xcp2-seqaux": SharpCase(4, dict(ep=2, cp=2), moe_config(moe_router_load_balancing_type="seq_aux_loss")),
    "ep2xtp2-sp-etp1-allgather": SharpCase(4, dict(ep=2, tp=2, etp=1, sequence_parallel=True),
                                           moe_config(moe_token_dispatcher_type="allgather")),
    # ---- 8 processes
    "tp2xpp2xdp2-sp": SharpCase(8, dict(tp=2, pp=2, sequence_parallel=True), DENSE_TP, accumulate=2),
}


@pytest.fixture(scope="module")
def layout_results(request) -> Any:
    """``get(world)``: rank 0's results of the selected cases of that world size, run on first use."""
    selected = {item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_layout_matches_float64_reference"}
    cache: Dict[int, Dict[str, Any]] = {}

    def get(world: int) -> Dict[str, Any]:
        if world not in cache:
            cache[world] = run_layouts({n: c for n, c in CASES.items() if c.world == world and n in selected})
        return cache[world]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_float64_reference(layout_results, case):
    spec = CASES[case]
    result = layout_results(spec.world)[case]
    assert not isinstance(result, str), f"{case} failed in the workers:\n{result}"
    assert result["steps"] == spec.steps, result["steps"]
    ref = spec.reference()
    if spec.clip is not None:   # the case must clip, else it tests nothing about clipping
        assert all(n > spec.clip for n in ref["norms"]), (ref["norms"], spec.clip)
    errors = relative_change_errors(result, ref)
    worst = max(errors, key=errors.get)
    print(f"\nsharp {case}: max relative weight-change error {errors[worst]:.2e} ({worst})")
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= RTOL}
    assert not bad, f"{case}: relative error of the weight change above {RTOL}: {bad}"
