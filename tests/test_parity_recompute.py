"""Activation recompute under MegatronStrategy with gloo processes and the real Trainer.

- tp2 + SP with hidden and attention dropout: selective and full (uniform, block) recompute give bit-for-bit the
  losses and final weights of the same run without recompute (the dropout masks of the recomputed forwards come
  from the replayed default and tensor-parallel streams);
- recompute composed with pp2 (1f1b; interleaved with virtual chunks; the zero-bubble schedules, whose backward
  runs in two passes), cp2 (p2p, and a2a with the delayed weight-gradient GEMMs) and ep2 (MoE) matches the
  single-process run (fp32 AdamW, loss per step and final weights at 1e-5, :mod:`tests.parity`).

Each test runs all its layouts in one set of processes (one spawn and import).
"""
from __future__ import annotations

import traceback
from typing import Any, Dict, Sequence, Tuple

import pytest
import torch

from tests._dist import run_distributed
from tests.parity import assert_state_close, layout_run, make_samples, reference_loop, tiny_config

STEPS = 3
MICRO_BATCH = 2


def full(method: str, n: int) -> Dict[str, Any]:
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)


def selective(*modules: str) -> Dict[str, Any]:
    return dict(recompute_granularity="selective", recompute_modules=list(modules) if modules else None)


def run_layouts(rank: int, world: int, cases: Sequence[Tuple[str, Tuple]]) -> Dict[str, Any]:
    """Each ``(name, layout_run arguments)`` in turn in this process group; a case that raises gives its
    traceback (every rank raises alike, so the ranks stay in step)."""
    out: Dict[str, Any] = {}
    for name, args in cases:
        try:
            out[name] = layout_run(rank, world, *args)
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = traceback.format_exc()
    return out


def global_batch(world: int, kwargs: Dict[str, Any]) -> int:
    return MICRO_BATCH * world // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))


# ------------------------------------------------------------------------------------------- tp2 + SP, dropout
DROPOUT = tiny_config(num_layers=3, num_query_groups=4, hidden_dropout=0.1, attention_dropout=0.1)
TP2_SP = dict(tp=2, sequence_parallel=True)
DROPOUT_CASES = {
    "selective": selective(),
    "selective-all": selective("core_attn", "mlp", "layernorm"),
    "uniform1": full("uniform", 1),
    "uniform2": full("uniform", 2),
    "block2": full("block", 2),
}


def test_tp2_sp_with_dropout_is_bit_identical_to_no_recompute():
    samples = make_samples(DROPOUT, STEPS * 2 * global_batch(2, TP2_SP))
    cases = [(name, (DROPOUT, dict(TP2_SP, **recompute), samples, MICRO_BATCH, 2, 0.05, STEPS))
             for name, recompute in {"none": {}, **DROPOUT_CASES}.items()]
    results = run_distributed(run_layouts, 2, cases)
    for rank, result in enumerate(results):
        for name, got in result.items():
            assert not isinstance(got, str), f"{name}:\n{got}"
            assert got["losses"] == result["none"]["losses"], (name, rank, got["losses"], result["none"]["losses"])
    want = results[0]["none"]["state"]
    for name in DROPOUT_CASES:
        got = results[0][name]["state"]
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (name, key)


# ------------------------------------------------------------------------------------------- against one process
PARITY_CASES = {
    # id: (strategy kwargs, config overrides, micro-batches per step)
    "pp2-1f1b-uniform1": (dict(pp=2, **full("uniform", 1)), dict(num_layers=4), 2),
    "pp2-1f1b-selective-all": (dict(pp=2, **selective("core_attn", "mlp", "layernorm")), dict(num_layers=4), 2),
    "pp2-vp2-interleaved-block1": (dict(pp=2, vp=2, **full("block", 1)), dict(num_layers=4), 2),
    "pp2-vp2-zero-bubble-uniform1": (dict(pp=2, vp=2, pipeline_schedule="interleaved_zero_bubble",
                                          **full("uniform", 1)), dict(num_layers=4), 2),
    "pp2-vp2-zbv-selective": (dict(pp=2, vp=2, pipeline_schedule="zbv", **selective("core_attn", "mlp")),
                              dict(num_layers=4), 2),
    "cp2-p2p-uniform2": (dict(cp=2, **full("uniform", 2)), {}, 1),
    "cp2-p2p-selective": (dict(cp=2, **selective("core_attn", "layernorm")), {}, 1),
    "cp2-a2a-delay-wgrad-block1": (dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True, **full("block", 1)),
                                   {}, 1),
    "cp2-a2a-delay-wgrad-selective": (dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True,
                                           **selective("core_attn", "mlp", "layernorm")), {}, 1),
    "ep2-moe-uniform2": (dict(ep=2, **full("uniform", 2)),
                         dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                              moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=0.01), 1),
    "ep2-moe-selective": (dict(ep=2, **selective("moe_act", "shared_experts", "core_attn", "layernorm")),
                          dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                               moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=0.01), 1),
}


@pytest.fixture(scope="module")
def parity_results():
    cases, references = [], {}
    for name, (kwargs, overrides, accumulate) in PARITY_CASES.items():
        cfg = tiny_config(**overrides)
        gb = global_batch(2, kwargs)
        samples = make_samples(cfg, STEPS * accumulate * gb)
        cases.append((name, (cfg, kwargs, samples, MICRO_BATCH, accumulate, None, STEPS)))
        references[name] = (reference_loop(cfg, samples, STEPS, gb, None, accumulate=accumulate), accumulate)
    return run_distributed(run_layouts, 2, cases), references


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_recompute_layout_matches_single_process(parity_results, case):
    results, references = parity_results
    ref, accumulate = references[case]
    want = [sum(ref["losses"][i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(STEPS)]
    for result in results:
        got = result[case]
        assert not isinstance(got, str), got
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], want):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], want)
    assert_state_close(results[0][case]["state"], ref["state"], 1e-5)
