"""Tensor-parallel RNG streams (Megatron's seeds), on 2 real gloo processes (one TP group of 2).

``TensorParallelRNG.fork`` must give each TP rank its own stream (seed ``seed + 2718 + tp_rank``, plus
``100 * pp_rank``) while the default stream stays identical across TP ranks and is not advanced by a fork.
At model level, a ``GPTModel`` with attention dropout under ``apply_tp(tp=2, tp_fork=...)`` must drop
different attention probabilities on each TP rank: with both ranks' local attention weights made
identical, their core-attention outputs may then differ only through the dropout masks; a model given no
``tp_fork`` (the control) must produce identical ones.

Hidden (and embedding) dropout, as Megatron: without sequence parallelism the activations are replicated over
TP and dropped on the default stream, so every TP rank drops the same elements and a tp2 run draws exactly
the masks of a tp1 run (training under tp2 matches tp1 with ``hidden_dropout > 0``); under sequence
parallelism each TP rank holds its own part of the sequence and drops it on its TP stream, which no tp1 run
reproduces, but a run repeats exactly.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG, default_seed, tensor_parallel_seed
from tests._dist import init_gloo, run_distributed

SEED = 1234
MEGATRON_TP_OFFSET = 2718  # megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed


def test_seed_formulas():
    assert default_seed(SEED, 0) == SEED and default_seed(SEED, 3) == SEED + 300
    assert tensor_parallel_seed(SEED, 0) == SEED + MEGATRON_TP_OFFSET
    assert tensor_parallel_seed(SEED, 3, pp_rank=2) == SEED + 200 + MEGATRON_TP_OFFSET + 3


def _tp_stream(tp_rank: int, n: int) -> torch.Tensor:
    """Independent reference: a fresh generator with Megatron's TP seed."""
    return torch.rand(n, generator=torch.Generator().manual_seed(SEED + MEGATRON_TP_OFFSET + tp_rank))


def _core_attention_inputs(model) -> List[torch.Tensor]:
    """Run one training forward; return the input of layer 0's ``linear_proj`` (core attention output)."""
    seen: List[torch.Tensor] = []
    proj = model.decoder.layers["0"].self_attention.linear_proj
    handle = proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    tokens = torch.arange(2 * 16).view(2, 16) % 200
    model(tokens)
    handle.remove()
    return seen


def _rng_worker(rank: int, world: int) -> Dict[str, object]:
    from lightning_megatron import GPTConfig, GPTModel
    from lightning_megatron.parallel import ParallelConfig, ParallelMesh, apply_tp

    init_gloo(rank, world)
    mesh = ParallelMesh(ParallelConfig(tp=2))
    tp_rank, group = mesh.rank("tp"), mesh.group("tp")
    out: Dict[str, object] = {"tp_rank": tp_rank}

    # ---- the streams
    torch.manual_seed(default_seed(SEED, 0))
    rng = TensorParallelRNG(tensor_parallel_seed(SEED, tp_rank), torch.device("cpu"))
    default = [torch.rand(4)]
    with rng.fork():
        inside = [torch.rand(4)]
    default.append(torch.rand(4))
    with rng.fork():
        inside.append(torch.rand(4))  # the TP stream continues where it stopped
    default.append(torch.rand(4))
    out["default"], out["inside"] = torch.cat(default), torch.cat(inside)
    torch.manual_seed(default_seed(SEED, 0))
    out["default_no_fork"] = torch.rand(12)

    # ---- model level: attention dropout on the TP stream
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=200, seq_length=16, attention_dropout=0.5)
    for name, fork in (("wired", TensorParallelRNG(tensor_parallel_seed(SEED, tp_rank), torch.device("cpu")).fork),
                       ("control", None)):
        torch.manual_seed(SEED)  # same global weights on both ranks
        model = apply_tp(GPTModel(cfg), group, sequence_parallel=False, tp_fork=fork)
        attn = model.decoder.layers["0"].self_attention
        with torch.no_grad():  # identical local q/k/v weights: ranks differ only through dropout
            attn.linear_qkv.weight.copy_(torch.randn(attn.linear_qkv.weight.shape,
                                                     generator=torch.Generator().manual_seed(5)))
        if name == "wired":
            with attn.tp_fork():
                out["tp_fork_draw"] = torch.rand(4)
        model.eval()
        out[f"{name}_eval"] = _core_attention_inputs(model)[0]
        model.train()
        torch.manual_seed(99)
        out[f"{name}_train"] = _core_attention_inputs(model)[0]
        out[f"{name}_default_after_forward"] = torch.rand(4)
        if name == "wired":
            with attn.tp_fork():
                out["tp_fork_draw_after_forward"] = torch.rand(4)
    torch.manual_seed(99)
    out["default_untouched"] = torch.rand(4)

    # ---- embedding dropout: the default stream without SP, this rank's TP stream under SP
    cfg = cfg.replace(attention_dropout=0.0, hidden_dropout=0.5)
    tokens = torch.arange(2 * 16).view(2, 16) % 200
    for sp in (False, True):
        torch.manual_seed(SEED)
        rng = TensorParallelRNG(tensor_parallel_seed(SEED, tp_rank), torch.device("cpu"))
        model = apply_tp(GPTModel(cfg), group, sequence_parallel=sp, tp_fork=rng.fork)
        pos = model.positions(tokens)
        with torch.no_grad():
            before = model.embedding(tokens.t(), pos)  # [s(/tp under SP), b, h], before dropout
            torch.manual_seed(99)
            out[f"embed_sp{sp}"] = (before, model.embed(tokens, pos))
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, object]]:
    return run_distributed(_rng_worker, 2)


def test_fork_streams(results):
    r0, r1 = results
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    # outside the fork: identical across TP ranks, and exactly the stream without any fork
    assert torch.equal(r0["default"], r1["default"])
    assert torch.equal(r0["default"], r0["default_no_fork"])
    # inside: Megatron's per-rank seed, continued across forks, different per TP rank
    for r in results:
        assert torch.equal(r["inside"], _tp_stream(r["tp_rank"], 8))
    assert not torch.equal(r0["inside"], r1["inside"])


def test_gpt_attention_dropout_uses_tp_stream(results):
    r0, r1 = results
    # tp_fork is wired into the attention: draws come from each rank's TP stream (fresh RNG, first draws)
    for r in results:
        assert torch.equal(r["tp_fork_draw"], _tp_stream(r["tp_rank"], 4))
    assert not torch.equal(r0["tp_fork_draw"], r1["tp_fork_draw"])
    # the forward's dropout advanced the TP stream, and left the default stream untouched
    for r in results:
        assert not torch.equal(r["tp_fork_draw_after_forward"], _tp_stream(r["tp_rank"], 8)[4:])
        assert torch.equal(r["wired_default_after_forward"], r["default_untouched"])
    # identical local weights and inputs: equal without dropout ...
    for name in ("wired", "control"):
        torch.testing.assert_close(r0[f"{name}_eval"], r1[f"{name}_eval"], rtol=0, atol=0)
    # ... dropout is active (train differs from eval) ...
    assert not torch.allclose(r0["wired_train"], r0["wired_eval"])
    # ... and the masks differ per TP rank only when tp_fork is wired (the control shares the default stream)
    assert not torch.allclose(r0["wired_train"], r1["wired_train"])
    torch.testing.assert_close(r0["control_train"], r1["control_train"], rtol=0, atol=0)
    assert not torch.allclose(r0["control_train"], r0["control_eval"])


def _dropout_from(seed: int, x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.functional.dropout(x, 0.5, True)


def test_embedding_dropout_stream(results):
    r0, r1 = results
    # without SP: the default stream (the one seeded before the call), the same elements on both TP ranks
    for r in results:
        before, got = r["embed_spFalse"]
        assert torch.equal(got, _dropout_from(99, before))
        assert 0.3 < (got == 0).float().mean() < 0.7
    assert torch.equal(r0["embed_spFalse"][1], r1["embed_spFalse"][1])
    # under SP: each rank's sequence part on its own TP stream (its first draw)
    for r in results:
        before, got = r["embed_spTrue"]
        assert before.shape[0] == 16 // 2
        assert torch.equal(got, _dropout_from(SEED + MEGATRON_TP_OFFSET + r["tp_rank"], before))
        assert not torch.equal(got, _dropout_from(99, before))


# ------------------------------------------------------------------------------ training with hidden dropout
DROPOUT_STEPS, DROPOUT_BATCH = 3, 4


def _dropout_runs(rank: int, world: int, cfg, samples):
    """tp2 without SP, then tp2 + SP twice, in the same processes."""
    from tests.parity import layout_run

    runs = [layout_run(rank, world, cfg, dict(tp=2), samples, DROPOUT_BATCH, 1, None, DROPOUT_STEPS)]
    for _ in range(2):
        runs.append(layout_run(rank, world, cfg, dict(tp=2, sequence_parallel=True), samples, DROPOUT_BATCH, 1, None,
                               DROPOUT_STEPS))
    return runs


def test_hidden_dropout_training():
    from tests.parity import assert_state_close, layout_run, make_samples, reference_loop, tiny_config

    cfg = tiny_config(hidden_dropout=0.2)
    samples = make_samples(cfg, DROPOUT_STEPS * DROPOUT_BATCH)
    tp1 = layout_run(0, 1, cfg, {}, samples, DROPOUT_BATCH, 1, None, DROPOUT_STEPS)  # one process, same strategy
    no_dropout = reference_loop(tiny_config(), samples, DROPOUT_STEPS, DROPOUT_BATCH)["losses"]
    tp2, sp_a, sp_b = zip(*run_distributed(_dropout_runs, 2, cfg, samples))
    # dropout is on: every loss moves away from the run without it by far more than round-off
    assert all(abs(a - b) > 1e-5 * abs(b) for a, b in zip(tp1["losses"], no_dropout)), (tp1["losses"], no_dropout)
    assert max(abs(a - b) / abs(b) for a, b in zip(tp1["losses"], no_dropout)) > 1e-3, (tp1["losses"], no_dropout)
    # tp2 without SP draws the tp1 masks: the same run to float32 round-off
    for r in tp2:
        for got, want in zip(r["losses"], tp1["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], tp1["losses"])
    assert_state_close(tp2[0]["state"], tp1["state"])
    # tp2 + SP: other masks (per-rank TP streams), but the same ones on every run
    for a, b in zip(sp_a, sp_b):
        assert a["losses"] == b["losses"]
    assert all(torch.equal(v, sp_b[0]["state"][k]) for k, v in sp_a[0]["state"].items())
    assert sp_a[0]["losses"] != tp1["losses"]
