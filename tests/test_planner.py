"""The layout planner (lightning_megatron.planner): its predictions against the measurements recorded in
benchmarks/RESULTS.md and its reports (peak memory within 10%, step time within 15%), the data file's rows against
those files, the enumeration deciding validity by the library's own rules, the CLI on the four reference rows, and
``MegatronStrategy.from_plan``."""
from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
from pathlib import Path

import pytest

from lightning_megatron import GPTConfig, MegatronStrategy
from lightning_megatron.planner.cli import main
from lightning_megatron.planner import Layout, load_hardware, plan, predict, state_bytes
from lightning_megatron.planner.check import MEASURED_FILE, compare, row_case
from lightning_megatron.planner.model import Workload
from lightning_megatron.planner.memory import static_bytes_per_param

ROOT = Path(__file__).resolve().parents[1]
MEMORY_BOUND, TIME_BOUND = 0.10, 0.15


def _number(text: str) -> str:
    return f"{text:,}" if isinstance(text, int) else str(text)


def test_measured_rows_are_copied_from_results_md():
    """Each row of the data file is a verbatim row of RESULTS.md or its dated reports and holds the numbers the file
    takes from it."""
    results = "\n".join(f.read_text() for f in [ROOT / "benchmarks" / "RESULTS.md",
                                                 *sorted((ROOT / "benchmarks" / "reports").glob("*.md"))])
    data = json.loads(MEASURED_FILE.read_text())
    assert len(data["rows"]) >= 15
    for row in data["rows"]:
        assert row["row"] in results, row["id"]
        assert _number(row["tokens_per_s"]) in row["row"], row["id"]
        peak_text = row.get("peak_row", row["row"])
        assert peak_text in results, row["id"]
        peak = f"{row['peak_gib']:.2f}".rstrip("0").rstrip(".")
        assert re.search(re.escape(peak) + r"(?![0-9])", peak_text), (row["id"], peak)
    for row in data["not_modelled"]:
        assert row["row"] in results


def test_predictions_match_the_measurements():
    """Every measured 1- and 2-GPU layout: predicted peak memory within 10%, step time within 15%."""
    rows = compare()
    misses = [f"{r['id']}: memory {r['memory_error']:+.1%}, step {r['time_error']:+.1%}" for r in rows
              if abs(r["memory_error"]) > MEMORY_BOUND or abs(r["time_error"]) > TIME_BOUND]
    assert not misses, misses
    predicted = [r for r in rows if not r["fit"]]
    assert len(predicted) >= 12   # most rows are predictions, not fits


def test_fitted_constants_are_the_fit_of_their_rows():
    """calibration.json's fitted constants are what benchmarks/planner/fit_planner.py derives from the measured rows."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "planner"))
    try:
        import fit_planner
        with contextlib.redirect_stdout(io.StringIO()):
            fitted = fit_planner.fit()
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "planner"))
    hw = load_hardware("h200")
    for name, value in fitted.items():
        assert getattr(hw, name) == pytest.approx(value, rel=1e-3), name


def test_memory_model_parts():
    """No-shard bytes are 16 per parameter plus Adam's step counters; the sharding levels divide what they name
    (FSDP: parameters, gradients and states, both levels alike between steps)."""
    cfg = GPTConfig.llama_1b_bench()
    whole = state_bytes(cfg, Layout())
    n = cfg.num_parameters
    assert whole.params == 4 * n and whole.grads == 4 * n and whole.optimizer == 8 * n + 4 * (1 + 6 * 24 + 1 + 1)
    layouts = {level: Layout(dp=4, sharding=level) for level in ("optim", "optim_grads", "optim_grads_params")}
    optim, grads, params = (state_bytes(cfg, layouts[k], dp_rank=None) for k in layouts)
    assert optim.params == whole.params and optim.grads == whole.grads
    assert whole.optimizer / 4 <= optim.optimizer < whole.optimizer / 4 * 1.1
    for fsdp in (grads, params):
        assert fsdp.params == pytest.approx(whole.params / 4, rel=1e-3)
        assert fsdp.grads == pytest.approx(whole.grads / 4, rel=1e-3)
        assert fsdp.optimizer == pytest.approx(whole.optimizer / 4, rel=1e-3)
    assert grads == params
    with pytest.raises(ValueError, match="sharding='zero3' is not one of"):
        state_bytes(cfg, Layout(sharding="zero3"))


def test_bf16_moments_lower_the_predicted_peak_by_what_they_measured():
    """The precision-aware optimizer's bf16 moments: 4 bytes per parameter of optimizer state instead of 8, in the
    bytes (also sharded) and in the predicted peak of the 1.3B model on one H200: 4.71 GiB lower, as measured
    (RESULTS.md, precision-aware optimizer: FP8 tensorwise 25.15 -> 20.44 GiB, bf16 parameters 30.16 -> 25.45)."""
    cfg = GPTConfig.llama_1b_bench()
    n = cfg.num_parameters
    for layout in (Layout(), Layout(dp=4, sharding="optim"), Layout(dp=4, sharding="optim_grads_params")):
        fp32, bf16 = (state_bytes(cfg, layout, dp_rank=0, moment_bytes=b) for b in (8, 4))
        assert (bf16.params, bf16.grads) == (fp32.params, fp32.grads)
        shard = 1 if layout.sharding == "no_shard" else 4
        assert fp32.optimizer - bf16.optimizer == pytest.approx(4 * n / shard, rel=2e-2), layout
    hw = load_hardware("h200")
    layout = Layout(micro_batch_size=4)
    peaks = [predict(layout, Workload(cfg, 2048, 4, "fp8", exp_avg_dtype=m, exp_avg_sq_dtype=m), hw).peak_gib
             for m in ("fp32", "bf16")]
    assert peaks[0] - peaks[1] == pytest.approx(25.15 - 20.44, abs=0.01), peaks
    result = plan(cfg, 1, 4, hardware="h200", precision="fp8", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
                  micro_batch_sizes=(4,), recompute=("none",))
    assert result.work.moment_bytes == 4 and result.feasible
    with pytest.raises(ValueError, match="exp_avg_dtype='fp16' must be one of 'fp32', 'bf16'"):
        plan(cfg, 1, 4, exp_avg_dtype="fp16")


def test_bf16_moments_shorten_the_predicted_optimizer_step_as_measured():
    """The optimizer step of the 1.3B model on one H200 moves 8 bytes of moments per parameter instead of 16: the
    predicted step takes 0.79 of the fp32-moment one (measured with ``bench_optimizer.py``: 7.50 against 10.23 ms,
    0.73; RESULTS.md, precision-aware optimizer), for every parameter the rank steps, also sharded."""
    cfg = GPTConfig.llama_1b_bench()
    hw = load_hardware("h200")
    for layout, shard in ((Layout(micro_batch_size=4), 1), (Layout(dp=4, sharding="optim", micro_batch_size=4), 4)):
        t = [predict(layout, Workload(cfg, 2048, 4 * layout.dp, exp_avg_dtype=m, exp_avg_sq_dtype=m), hw)
             .time["optimizer"] for m in ("fp32", "bf16")]
        assert t[1] / t[0] == pytest.approx(7.50 / 10.23, rel=0.1), (layout, t)
        assert t[0] * 1e3 == pytest.approx(10.23 / shard, rel=0.15), (layout, t)


def test_bf16_params_peak_and_state_match_what_they_measured():
    """bf16 parameters (``MegatronPrecision(params_dtype=torch.bfloat16)``, ``params_dtype="bf16"``): 6 bytes per
    parameter (bf16 copy + fp32 main), fp32 main gradients, Adam states as with fp32 parameters (the distributed
    optimizer shards the main parameters with them: 2 + 4 + 12 / dp). The 1.3B model on one H200 (RESULTS.md, "Precision: bf16 parameters and FP8 on one
    GPU"): the predicted peak within 10% of the eager measurement (bf16 autocast 35.58 GiB, bf16 parameters 34.17;
    the planner's rows are eager runs, compile=True peaks are lower: 30.82 / 30.16) and 1.41 GiB lower within
    0.15 GiB (no autocast weight copies, a bf16 residual stream); the state held between steps (main gradients
    dropped at the optimizer step) 18.89 - 16.54 = 2.35 GiB lower, as measured eager and compiled alike. Measured
    without remainders: ``store_param_remainders=False`` (the default with bf16 parameters is on)."""
    cfg = GPTConfig.llama_1b_bench()
    n = cfg.num_parameters
    fp32, bf16 = (state_bytes(cfg, Layout(), dp_rank=0, params_dtype=d) for d in ("fp32", "bf16"))
    assert (bf16.params, bf16.grads, bf16.optimizer) == (6 * n, 4 * n, fp32.optimizer)
    assert bf16.main_grads and not fp32.main_grads
    assert fp32.between_steps - bf16.between_steps == 2 * n and bf16.between_steps == 6 * n + bf16.optimizer
    # the distributed optimizer with bf16 parameters: the fp32 main parameters sharded with the states, Megatron's
    # 2 + 4 + 12 / dp bytes per parameter (the buckets' padding and the step counters aside)
    for dp in (2, 4, 8):
        sharded = state_bytes(cfg, Layout(dp=dp, sharding="optim"), dp_rank=None, params_dtype="bf16")
        assert sharded.grads == 4 * n and sharded.params < 6 * n
        assert sharded.total / n == pytest.approx(static_bytes_per_param("bf16", True, dp), rel=1e-5), dp
    hw = load_hardware("h200")
    layout = Layout(micro_batch_size=4)
    fp32, bf16 = (predict(layout, Workload(cfg, 2048, 4, params_dtype=d, store_param_remainders=False), hw) for d in ("fp32", "bf16"))
    measured = {"fp32": (35.58, 18.89), "bf16": (34.17, 16.54)}
    for d, p in (("fp32", fp32), ("bf16", bf16)):
        assert abs(p.peak_gib / measured[d][0] - 1) <= MEMORY_BOUND, (d, p.peak_gib)
        state = state_bytes(cfg, layout, params_dtype=d).between_steps / 2 ** 30
        assert state == pytest.approx(measured[d][1], rel=0.01), (d, state)
    assert fp32.peak_gib - bf16.peak_gib == pytest.approx(35.58 - 34.17, abs=0.15), (fp32.peak_gib, bf16.peak_gib)
    states = [state_bytes(cfg, layout, params_dtype=d).between_steps / 2 ** 30 for d in ("fp32", "bf16")]
    assert states[0] - states[1] == pytest.approx(18.89 - 16.54, abs=0.01), states
    assert bf16.memory["params"] == pytest.approx(6 * n / 2 ** 30)
    assert bf16.memory["grads"] == pytest.approx(4 * n / 2 ** 30)
    # main gradients at the forward peak only while a step has several micro-batches: no DDP bucket keeps them
    accumulate = predict(Layout(micro_batch_size=4, num_microbatches=2), Workload(cfg, 2048, 8, params_dtype="bf16", store_param_remainders=False),
                         hw)
    assert accumulate.peak_gib - bf16.peak_gib == pytest.approx(4 * n / 2 ** 30), accumulate.peak_gib
    dp2 = {d: predict(Layout(dp=2, micro_batch_size=4), Workload(cfg, 2048, 8, params_dtype=d, store_param_remainders=False), hw).peak_gib
           for d in ("fp32", "bf16")}
    assert dp2["bf16"] == pytest.approx(bf16.peak_gib) and dp2["fp32"] == pytest.approx(fp32.peak_gib + 4 * n / 2 ** 30)
    with pytest.raises(ValueError, match="params_dtype='fp16' must be one of 'fp32', 'bf16'"):
        plan(cfg, 1, 4, params_dtype="fp16")


def test_bf16_params_run_under_fsdp_as_fsdp2_holds_them():
    """FSDP's levels with bf16 parameters: FSDP2 holds them (fp32 sharded main parameters, bf16 compute copies
    gathered per unit by its mixed-precision policy), so the plan ranks those layouts with the static state of fp32
    parameters under the same level; no_shard and the distributed optimizer keep MainParams' bytes."""
    cfg = GPTConfig.llama_1b_bench()
    result = plan(cfg, 4, 16, hardware="h200", recompute=("none",), params_dtype="bf16")
    assert result.work.params_dtype == "bf16"
    for level in ("optim_grads", "optim_grads_params"):
        rows = [r for r in result.rows if r.layout.sharding == level]
        assert rows and any(r.feasible for r in rows), (level, {r.reason for r in rows})
        bf16 = state_bytes(cfg, Layout(dp=4, sharding=level), params_dtype="bf16")
        fp32 = state_bytes(cfg, Layout(dp=4, sharding=level))
        assert bf16.total == fp32.total, (level, bf16, fp32)
    assert {r.layout.sharding for r in result.feasible} == {"no_shard", "optim", "optim_grads", "optim_grads_params"}


def test_cli_plans_bf16_params_with_megatrons_flag():
    """``--accumulate-allreduce-grads-in-fp32`` (Megatron's flag, as the pretraining command line maps it) and
    ``--params-dtype bf16`` plan bf16 parameters: the printed peak is the bf16 prediction, the printed flags hold the
    precision, FSDP rows are planned too (FSDP2 holds bf16 parameters itself); without them the parameters are fp32."""
    flags = "--model llama_1b_bench --gpus 1 --global-batch-size 4 --micro-batch-sizes 4 --recompute none".split()
    cfg = GPTConfig.llama_1b_bench()
    want = predict(Layout(micro_batch_size=4), Workload(cfg, 2048, 4, params_dtype="bf16"), load_hardware("h200"))
    for extra, dtype in (([], "fp32"), (["--accumulate-allreduce-grads-in-fp32"], "bf16"),
                         (["--params-dtype", "bf16"], "bf16")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = main(flags + extra)
        assert result.work.params_dtype == dtype, extra
        row = result.feasible[0]
        assert (row.prediction.peak_gib == pytest.approx(want.peak_gib)) == (dtype == "bf16"), extra
        assert f"| {row.prediction.peak_gib:7.1f} |" in out.getvalue()
        assert ("bf16 parameters" in out.getvalue()) == (dtype == "bf16"), extra
        # the printed Megatron flags carry the precision, and parse back with the library's parser
        from lightning_megatron.cli import build_parser

        printed = next(l for l in out.getvalue().splitlines() if l.startswith("flags: "))[len("flags: "):]
        assert build_parser().parse_args(printed.split()).bf16 == (dtype == "bf16")   # Megatron's bf16
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = main("--model llama_1b_bench --gpus 4 --global-batch-size 16 --recompute none --sharding "
                      "optim_grads_params --accumulate-allreduce-grads-in-fp32".split())
    assert result.feasible and all(r.layout.sharding == "optim_grads_params" for r in result.feasible)


def test_enumeration_refuses_by_the_library_rules():
    """The reasons are ParallelConfig's own errors (tp not dividing the heads, layers over pipeline stages), and
    no refused layout is ranked."""
    result = plan(GPTConfig.tiny(num_layers=6), 8, 16, hardware="h200", recompute=("none",))
    reasons = {r.reason for r in result.rows if r.reason}
    assert "num_attention_heads=4 is not divisible by tp=8" in reasons
    assert any(r.startswith("num_layers=6 is not divisible by the 4 pipeline stages") for r in reasons), reasons
    for row in result.feasible:
        row.layout.parallel_config(result.work.model)   # accepted by the library
        assert row.layout.tp != 8 and 6 % row.layout.pp == 0
    speeds = [r.prediction.tokens_per_s_per_gpu for r in result.feasible]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 10


def test_hardware_and_precision_change_the_prediction():
    cfg = GPTConfig.llama3_8b()
    work = Workload(cfg, 8192, 64)
    layout = Layout(tp=2, dp=4, sequence_parallel=True, sharding="optim", recompute="full", num_microbatches=16)
    h100, h200 = load_hardware("h100"), load_hardware("h200")
    a, b = predict(layout, work, h100), predict(layout, work, h200)
    assert a.peak_gib == b.peak_gib and a.step_s > b.step_s       # same bytes, slower HBM
    fp8 = predict(layout, Workload(cfg, 8192, 64, "fp8"), h200)
    assert fp8.step_s < b.step_s
    assert not h100.fits(78.0) and h200.fits(78.0)


#: the seed's reference rows: (CLI flags, the reference layout)
REFERENCE = {
    "llama3_8b": ("--model llama3_8b --gpus 8 --seq-length 8192 --global-batch-size 128", "tp=1,pp=1,cp=2"),
    "llama3_70b": ("--model llama3_70b --gpus 64 --seq-length 8192 --global-batch-size 128", "tp=4,pp=4,cp=2"),
    "gpt3_175b": ("--model gpt3_175b --gpus 512 --seq-length 2048 --global-batch-size 1536", "tp=4,pp=8"),
    "mixtral_8x7b": ("--model mixtral_8x7b --gpus 64 --seq-length 4096 --global-batch-size 256", "pp=4,ep=8"),
}


@pytest.mark.parametrize("name", list(REFERENCE))
def test_cli_ranks_the_reference_rows_quickly(name):
    """``python -m lightning_megatron.planner`` (its main) prints the ranked table for each reference row within 5 s
    of CPU time, with the reference layout's rank or rejection, and the row recorded in docs/planner.md."""
    flags, show = REFERENCE[name]
    out = io.StringIO()
    start = time.process_time()
    with contextlib.redirect_stdout(out):
        result = main(flags.split() + ["--hardware", "h100", "--gpu-memory", "80", "--precision", "fp8", "--show", show])
    assert time.process_time() - start < 5.0
    text = out.getvalue()
    assert text.startswith("| rank | tp | pp |") and f"{show}: " in text and "flags: --tensor-model-parallel-size" in text
    line = next(l for l in text.splitlines() if l.startswith(f"{show}: "))
    docs = (ROOT / "docs" / "planner.md").read_text()
    assert f"`{show}`: {line[len(show) + 2:]}" in docs, line
    best = result.feasible[0]
    assert best.prediction.mfu > 0.2 and result.best == best.layout


def test_from_plan_builds_the_best_layout():
    result = plan(GPTConfig.llama_1b_bench(), 8, 64, hardware="h200", recompute=("none", "full"))
    best = result.best
    strategy = MegatronStrategy.from_plan(result)
    config = strategy.parallel_config
    assert (config.tp, config.pp, config.cp, config.sequence_parallel) == (best.tp, best.pp, best.cp,
                                                                          best.sequence_parallel)
    assert config.data_parallel_sharding_strategy == best.sharding
    other = MegatronStrategy.from_plan(Layout(tp=2, sequence_parallel=True, recompute="full"), grad_reduce_in_bf16=True)
    assert other.parallel_config.tp == 2 and other.parallel_config.recompute_granularity == "full"
    assert other.parallel_config.grad_reduce_in_bf16


def test_measured_case_layouts_are_valid():
    """The measured layouts are ones the library accepts (the check runs real configurations)."""
    for row in json.loads(MEASURED_FILE.read_text())["rows"]:
        layout, work, model = row_case(row)
        layout.parallel_config(model)


def test_printed_flags_parse_to_the_layout():
    """The Megatron flags the CLI prints for a layout are the library's own (lightning_megatron.cli) and give back
    the layout's sizes and options."""
    from lightning_megatron.cli import build_parser

    layout = Layout(tp=2, pp=4, vp=2, cp=2, dp=2, sequence_parallel=True, sharding="optim",
                    recompute="selective_mlp", micro_batch_size=1, num_microbatches=8)
    args = build_parser().parse_args(" ".join(layout.flags(16)).split())
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size, args.context_parallel_size) == (2, 4, 2, 2)
    assert args.sequence_parallel and args.use_distributed_optimizer and args.global_batch_size == 16
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["core_attn", "layernorm", "mlp"]
    full = build_parser().parse_args(" ".join(Layout(recompute="full").flags()).split())
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    for level in ("optim_grads", "optim_grads_params"):
        fsdp = build_parser().parse_args(" ".join(Layout(tp=2, dp=4, sharding=level).flags()).split())
        assert fsdp.use_custom_fsdp and fsdp.data_parallel_sharding_strategy == level
        assert not fsdp.use_distributed_optimizer


def test_fsdp_levels_are_ranked_layouts():
    """optim_grads / optim_grads_params are ranked like the other levels, refused only by the library's own rules
    (ParallelConfig: vp > 1; the strategy: FP8 layers), and reach MegatronStrategy as
    data_parallel_sharding_strategy; ZeRO-3 trades memory for a second all-gather per micro-batch."""
    cfg = GPTConfig.llama3_8b()
    result = plan(cfg, 8, 128, 8192, hardware="h100", gpu_memory_gib=80)
    fsdp = [r for r in result.feasible if r.layout.sharding in ("optim_grads", "optim_grads_params")]
    assert fsdp and {r.layout.sharding for r in fsdp} == {"optim_grads", "optim_grads_params"}
    assert all((r.layout.vp or 1) == 1 for r in fsdp)
    refused = {r.reason for r in result.rows if r.reason and (r.layout.vp or 1) > 1
               and r.layout.sharding == "optim_grads_params"}
    assert refused == {"data_parallel_sharding_strategy='optim_grads_params' with vp=2"}, refused
    reference = result.rank_of(tp=1, pp=1, cp=2, sharding="optim_grads_params")
    assert reference.feasible and not result.rank_of(tp=1, pp=1, cp=2, sharding="optim").feasible
    strategy = MegatronStrategy.from_plan(reference.layout)
    assert strategy.parallel_config.data_parallel_sharding_strategy == "optim_grads_params"
    assert strategy.parallel_config.fsdp
    fp8 = plan(cfg, 8, 128, 8192, hardware="h100", gpu_memory_gib=80, precision="fp8", recompute=("full",))
    # FP8 layers run under FSDP's levels as under the others (tests/test_parity_recipes.py): nothing refuses them
    assert not any("FP8" in (r.reason or "") for r in fp8.rows)
    assert any(r.layout.sharding.startswith("optim_grads") for r in fp8.feasible)
    # one layout across two nodes (dp over InfiniBand): ZeRO-3 holds less and gathers more than ZeRO-2
    work, hw = Workload(cfg, 8192, 16), load_hardware("h100")
    zero2, zero3 = (predict(Layout(dp=16, sharding=level), work, hw) for level in ("optim_grads", "optim_grads_params"))
    optim = predict(Layout(dp=16, sharding="optim"), work, hw)
    assert zero3.peak_gib < zero2.peak_gib < optim.peak_gib
    assert zero3.time["dp"] > zero2.time["dp"] > 0 and zero3.step_s > zero2.step_s


def test_python_m_planner_prints_the_readme_table():
    """``python -m lightning_megatron.planner`` with the README's command prints the table the README shows."""
    import os
    import subprocess

    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`python -m lightning_megatron\.planner ([^`]+)`", readme.replace("\n", " ")).group(1)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "lightning_megatron.planner", *command.split()], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300, check=True).stdout
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) >= 5 and "\n".join(table) in readme


@pytest.mark.parametrize("argv", [["--help"], ["verify", "--help"]], ids=["planner", "verify"])
def test_help_is_plain_text_with_aligned_tables(argv, capsys, monkeypatch):
    """``--help`` of the planner and of ``verify`` is written for a terminal: no reST markup, its own paragraphs
    within 79 columns, and the sharding table's descriptions (continuation lines included) in one column."""
    from lightning_megatron.planner.memory import SHARDING_LEVELS

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":class:", ":func:", ":mod:", ":data:", ":meth:", "::", ".. "):
        assert markup not in text, (markup, text)
    head, _, flags = text.partition("\noptions:\n")
    description, epilog = head.split("\n\n", 1)[1], flags.split("\n\n", 1)[1]   # around argparse's own text
    assert all(len(line) <= 79 for line in (description + "\n" + epilog).splitlines()), text
    if argv[0] == "verify":
        assert "python -m lightning_megatron.planner verify" in epilog
        return
    table = text[text.index("sharding levels ("):].split("\n\n")[0].splitlines()[2:]
    rows = [line for line in table if not line.startswith("    ")]   # the others continue the row above
    assert [line.split()[0] for line in rows] == list(SHARDING_LEVELS), table

    def value_column(line: str) -> int:
        body = line[2 + len(line.split()[0]):] if line in rows else line
        return len(line) - len(body.lstrip())

    assert len({value_column(line) for line in table}) == 1, table
