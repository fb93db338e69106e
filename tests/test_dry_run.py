"""Dry runs (``MegatronStrategy(dry_run=DryRun(world_size, rank))``: one process plays one rank over torch's fake
backend) against real gloo runs and against the planner, on CPU.

- The four reference rows' layouts (LLaMA-3 8B: 8 ranks cp2; LLaMA-3 70B: 64 ranks tp4+SP pp4 cp2; GPT-3 175B:
  512 ranks tp4+SP pp8; Mixtral 8x7B: 64 ranks pp4 ep8; all with the distributed optimizer, as the example YAMLs)
  with a tiny model: every kind of rank (each pipeline stage's first rank, the last rank, an expert rank) builds and
  trains 2 optimizer steps; its parameter names and local sizes are the planner's ``rank_parameters`` and its
  parameter, gradient and optimizer-state bytes equal ``planner.state_bytes`` of that rank exactly.
- The same rank kinds at a size gloo runs here (4 processes: tp2+SP x pp2, tp2+SP x cp2, pp2 x ep2): the dry run of
  each rank's place in a 64-rank world (dp x 16) holds exactly the parameter names and local shapes the real
  rank holds, and the real ranks' bytes are the planner's too.
All dry runs share one worker process (the fake process group is destroyed after each).
"""
from __future__ import annotations

from dataclasses import replace as dataclasses_replace
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_megatron import DryRun, MegatronStrategy
from lightning_megatron.cli.dry_run import StateBytesProbe
from lightning_megatron.planner import Layout, rank_parameters, state_bytes
from lightning_megatron.planner.verify import rank_coordinates
from tests._dist import run_distributed, run_each
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for

STEPS = 2
TP4 = dict(num_attention_heads=8, num_query_groups=4)
MOE = dict(num_moe_experts=8, moe_ffn_hidden_size=32)

#: name: (strategy keywords, world, ranks played, model overrides, micro-batches per step)
ROWS: Dict[str, Tuple[Dict[str, Any], int, List[int], Dict[str, Any], int]] = {
    "llama3_8b-8": (dict(cp=2, use_distributed_optimizer=True), 8, [0, 1, 7], {}, 1),
    "llama3_70b-64": (dict(tp=4, pp=4, cp=2, sequence_parallel=True, use_distributed_optimizer=True), 64,
                      [0, 16, 48, 63], dict(num_layers=8, **TP4), 4),
    "gpt3_175b-512": (dict(tp=4, pp=8, sequence_parallel=True, use_distributed_optimizer=True), 512,
                      [0, 64, 448, 511], dict(num_layers=16, **TP4), 8),
    "mixtral_8x7b-64": (dict(pp=4, ep=8, use_distributed_optimizer=True), 64, [0, 5, 16, 63],
                        dict(num_layers=8, **MOE), 4),
}
#: gloo-sized layouts of the same rank kinds: name: (strategy keywords, model overrides, micro-batches per step)
SMALL: Dict[str, Tuple[Dict[str, Any], Dict[str, Any], int]] = {
    "tp2sp-pp2": (dict(tp=2, pp=2, sequence_parallel=True, use_distributed_optimizer=True), dict(num_layers=4), 2),
    "tp2sp-cp2": (dict(tp=2, cp=2, sequence_parallel=True, use_distributed_optimizer=True), {}, 1),
    "pp2-ep2": (dict(pp=2, ep=2, use_distributed_optimizer=True), dict(num_layers=4, num_moe_experts=4,
                                                                        moe_ffn_hidden_size=32), 2),
}
SMALL_WORLD, SCALE = 4, 16   # the dry runs play the gloo ranks' places in a world SCALE times larger (dp x SCALE)


def layout_of(kwargs: Dict[str, Any], world: int, accumulate: int) -> Layout:
    tp, pp, cp = kwargs.get("tp", 1), kwargs.get("pp", 1), kwargs.get("cp", 1)
    return Layout(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), ep=kwargs.get("ep", 1),
                  sequence_parallel=kwargs.get("sequence_parallel", False),
                  sharding="optim" if kwargs.get("use_distributed_optimizer") else "no_shard",
                  num_microbatches=accumulate)


def _train(rank_world: int, kwargs: Dict[str, Any], overrides: Dict[str, Any], accumulate: int,
           dry_run: Any = None) -> Dict[str, Any]:
    """Train STEPS steps of one rank; its parameters' local shapes, static bytes and steps taken."""
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config(**overrides)
    module = new_module(cfg, STEPS)
    probe = StateBytesProbe()
    strategy = MegatronStrategy(**kwargs, dry_run=dry_run)
    trainer = trainer_for(rank_world, strategy, STEPS, callbacks=[probe], accumulate_grad_batches=accumulate,
                          precision="32-true")
    dp = strategy.parallel_config.resolve(dry_run.world_size if dry_run else rank_world).dp
    samples = make_samples(cfg, dp * accumulate * STEPS)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=1, shuffle=False))
    return {"shapes": {n: tuple(p.shape) for n, p in module.named_parameters()}, "state": dict(probe.state),
            "steps": trainer.global_step}


def _dry_runs(rank: int, world: int, cases: List[Tuple[str, tuple]]) -> Dict[str, Any]:
    """Worker (one process): each case ``(kwargs, fake world, fake rank, overrides, accumulate)`` as a dry run."""
    out: Dict[str, Any] = {}
    for name, (kwargs, fake_world, fake_rank, overrides, accumulate) in cases:
        try:
            out[name] = _train(1, kwargs, overrides, accumulate, DryRun(world_size=fake_world, rank=fake_rank))
        except Exception:  # noqa: BLE001 - reported by the case's test
            import traceback

            out[name] = traceback.format_exc()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


def _real(rank: int, world: int, kwargs: Dict[str, Any], overrides: Dict[str, Any], accumulate: int):
    return _train(world, kwargs, overrides, accumulate)


def scaled_rank(layout: Layout, rank: int, scale: int) -> int:
    """The rank at ``rank``'s mesh coordinates in the same layout with ``scale`` times the data parallelism."""
    at = rank_coordinates(layout, rank)
    dp = layout.dp * scale
    return ((at["pp"] * dp + at["dp"]) * layout.cp + at["cp"]) * layout.tp + at["tp"]


def _dry_cases() -> List[Tuple[str, tuple]]:
    cases = [(f"{row}/{r}", (kw, world, r, over, acc)) for row, (kw, world, ranks, over, acc) in ROWS.items()
             for r in ranks]
    for name, (kw, over, acc) in SMALL.items():
        layout = layout_of(kw, SMALL_WORLD, acc)
        cases += [(f"{name}/{r}", (kw, SMALL_WORLD * SCALE, scaled_rank(layout, r, SCALE), over, acc))
                  for r in range(SMALL_WORLD)]
    return cases


@pytest.fixture(scope="module")
def dry():
    return run_distributed(_dry_runs, 1, _dry_cases())[0]


@pytest.fixture(scope="module")
def real():
    cases = [(name, (kw, over, acc)) for name, (kw, over, acc) in SMALL.items()]
    return run_distributed(run_each, SMALL_WORLD, _real, cases)


def _check_against_planner(got: Dict[str, Any], overrides: Dict[str, Any], layout: Layout, rank: int) -> None:
    assert isinstance(got, dict), got   # else the traceback of the failed run
    assert got["steps"] == STEPS, got["steps"]
    cfg = tiny_config(**overrides)
    at = rank_coordinates(layout, rank)
    planned = {t.name: t for t in rank_parameters(cfg, layout, at["pp"])}
    shapes = {n.removeprefix("model."): s for n, s in got["shapes"].items()}
    assert set(shapes) == set(planned), (sorted(set(shapes) ^ set(planned)))
    for name, shape in shapes.items():
        t = planned[name]
        assert torch.Size(shape).numel() == t.numel and (len(shape) == 1 or shape[0] == t.rows), (name, shape, t)
    want = state_bytes(cfg, layout, at["pp"], dp_rank=at["zero"], edp_rank=at["edp"])
    state = got["state"]
    assert (state["params"], state["grads"], state["optimizer"]) == (want.params, want.grads, want.optimizer), (
        rank, state, want)


@pytest.mark.parametrize("row", list(ROWS))
def test_reference_rows_every_rank_kind_trains_and_holds_what_the_planner_counts(dry, row):
    kw, world, ranks, over, acc = ROWS[row]
    layout = layout_of(kw, world, acc)
    for r in ranks:
        _check_against_planner(dry[f"{row}/{r}"], over, layout, r)
    # the ranks really differ where the layout says they do (first stage: embedding; last: output layer)
    if layout.pp > 1:
        first, last = dry[f"{row}/{ranks[0]}"]["shapes"], dry[f"{row}/{ranks[-1]}"]["shapes"]
        assert "model.embedding.word_embeddings.weight" in first and "model.embedding.word_embeddings.weight" not in last
        assert "model.output_layer.weight" in last and "model.output_layer.weight" not in first


@pytest.mark.parametrize("name", list(SMALL))
def test_dry_run_ranks_hold_what_real_gloo_ranks_hold(dry, real, name):
    kw, over, acc = SMALL[name]
    layout = layout_of(kw, SMALL_WORLD, acc)
    big = layout_of(kw, SMALL_WORLD * SCALE, acc)
    for r in range(SMALL_WORLD):
        got_real = real[r][name]
        _check_against_planner(got_real, over, layout, r)
        got_dry = dry[f"{name}/{r}"]
        _check_against_planner(got_dry, over, big, scaled_rank(layout, r, SCALE))
        assert got_dry["shapes"] == got_real["shapes"], (name, r)


def test_dry_run_is_validated():
    with pytest.raises(ValueError, match="outside the job"):
        DryRun(world_size=8, rank=8)
    with pytest.raises(ValueError, match="at least 1"):
        DryRun(world_size=0)
    with pytest.raises(ValueError, match="DryRun"):
        MegatronStrategy(tp=2, dry_run=(64, 0))
    with pytest.raises(ValueError, match="check_for_nan_in_loss_and_grad"):
        MegatronStrategy(tp=2, dry_run=DryRun(64, 0), check_for_nan_in_loss_and_grad=True)
    strategy = MegatronStrategy(tp=2, dry_run=DryRun(64, 3))
    assert strategy.parallel_config.check_for_nan_in_loss_and_grad is False
    trainer_args = dict(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match="devices=1"):
        pl.Trainer(**trainer_args)


def test_verify_reads_the_example_configs_as_their_layouts():
    """``planner verify``'s job of each reference YAML is the row's layout; ``--ranks`` names resolve per layout."""
    from lightning_megatron.planner.verify import load_job, parse_ranks, predicted, tiny_job

    want = {"llama3_8b": (8, 1, 1, 2, 1, 32), "llama3_70b": (64, 4, 4, 2, 1, 64), "gpt3_175b": (512, 4, 8, 1, 1, 96),
            "mixtral_8x7b": (64, 1, 4, 1, 8, 16)}
    for name, (world, tp, pp, cp, ep, m) in want.items():
        job = load_job(f"examples/configs/{name}.yaml")
        layout = job.layout
        assert (layout.world, layout.tp, layout.pp, layout.cp, layout.ep, layout.num_microbatches) == (
            world, tp, pp, cp, ep, m)
        assert layout.sharding == "optim" and tiny_job(job).layout == dataclasses_replace(
            layout, num_microbatches=pp if pp > 1 else 1)
        assert parse_ranks("first,last,first", layout) == [0, world - 1]
        assert predicted(job, world - 1)["params"] > 0
    with pytest.raises(ValueError, match="outside the job"):
        parse_ranks("64", load_job("examples/configs/llama3_70b.yaml").layout)
    # the planner's verdicts at full size on one H200 (docs/planner.md's table): GPT-3's first stage does not fit
    gpt3 = load_job("examples/configs/gpt3_175b.yaml")
    assert not predicted(gpt3, 0)["fits"] and predicted(gpt3, 511)["fits"]


def test_verify_command_prints_measured_beside_planned():
    """The command end to end on the CPU (one rank of the 8B row's layout, tiny model, one step)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lightning_megatron.planner", "verify", "--config",
                          "examples/configs/llama3_8b.yaml", "--tiny", "--ranks", "last", "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("rank 7 (pp 0, dp 3, cp 1, tp 0)") for line in lines), out.stdout
    for row in ("parameters held", "static bytes: parameters", "static bytes: gradients", "static bytes: optimizer"):
        line = next(line for line in lines if line.strip().startswith(row))
        assert line.split()[-1] == "1.000", line   # the measured bytes are the planner's
    assert "without communication" in out.stdout


def test_a_rank_out_of_memory_is_reported_as_such():
    """A rank that ran out of GPU memory measured nothing else: its line says so beside the planner's peak (on
    2026-12-05 the 8B row's first rank on one H200 printed a KeyError here instead)."""
    from lightning_megatron.planner.verify import format_rank, load_job, predicted

    job = load_job("examples/configs/llama3_8b.yaml")
    got = {"rank": 0, "device": "NVIDIA H200", "steps": 2, "out_of_memory": "CUDA out of memory. Tried to allocate"}
    text = format_rank(job, got, predicted(job, 0))
    assert text.startswith("rank 0 (pp 0, dp 0, cp 0, tp 0) on NVIDIA H200") and "OUT OF MEMORY" in text, text
