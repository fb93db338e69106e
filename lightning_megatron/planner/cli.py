"""The layout planner's command line (``python -m lightning_megatron.planner``, :mod:`lightning_megatron.planner`'s
``__main__``): this module only parses flags and prints; the planner's names for Python are
:mod:`lightning_megatron.planner`'s (``from lightning_megatron.planner import plan``).

Example::

    python -m lightning_megatron.planner --model llama3_70b --gpus 64 --gpu-memory 80 --seq-length 8192 \\
        --global-batch-size 512 --hardware h100 --show tp=4,pp=4,cp=2

prints the ranked table (predicted peak GiB per GPU, tokens/s per GPU, MFU; rejected layouts with the reason),
then the best layout as ``MegatronStrategy`` keywords and as Megatron flags.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Dict, Optional, Sequence

from lightning_megatron.models.config import GPTConfig
from lightning_megatron.planner import (Hardware, Layout, Plan, PlanRow, Prediction, StateBytes, Workload,
                                        enumerate_layouts, format_table, load_hardware, plan, predict,
                                        rank_parameters, state_bytes)
from lightning_megatron.planner.calibration import HARDWARE_NAMES
from lightning_megatron.planner.layout import RECOMPUTE_PRESETS, SUPPORTED_SHARDING
from lightning_megatron.planner.memory import SHARDING_LEVELS

__all__ = ["plan", "Plan", "PlanRow", "Layout", "Prediction", "Workload", "predict", "Hardware", "load_hardware",
           "StateBytes", "state_bytes", "rank_parameters", "enumerate_layouts", "format_table", "build_parser",
           "main", "MODELS", "parse_show"]

#: ``--model`` names: the ``GPTConfig`` presets
MODELS = ("llama3_8b", "llama3_70b", "gpt3_175b", "mixtral_8x7b", "llama_1b_bench", "mixtral_small_bench", "tiny",
          "tiny_moe")


#: ``--help`` is plain text for a terminal: paragraphs and table rows wrapped to this width
HELP_WIDTH = 79

#: what each ``--sharding`` level splits over the data-parallel (x context-parallel) ranks
SHARDING_HELP = {
    "no_shard": "nothing: every rank holds all parameters, gradients and optimizer states (DDP)",
    "optim": "the optimizer states (the distributed optimizer)",
    "optim_grads": "the optimizer states and gradients (FSDP2, ZeRO-2)",
    "optim_grads_params": "the optimizer states, gradients and parameters (FSDP2, ZeRO-3)",
}


def paragraph(text: str, indent: int = 0) -> str:
    """``text`` wrapped to :data:`HELP_WIDTH` columns, every line indented by ``indent`` spaces."""
    return textwrap.fill(text, HELP_WIDTH, initial_indent=" " * indent, subsequent_indent=" " * indent)


def rows(entries: Dict[str, str]) -> str:
    """``entries`` as a two-column table indented by 2: the keys, then the values in one column after the longest
    key, wrapped to :data:`HELP_WIDTH` columns with their continuation lines in the value column."""
    column = 2 + max(map(len, entries)) + 2
    lines = []
    for key, value in entries.items():
        wrapped = textwrap.wrap(value, HELP_WIDTH - column)
        lines.append(f"  {key:<{column - 4}}  {wrapped[0]}")
        lines.extend(" " * column + line for line in wrapped[1:])
    return "\n".join(lines)


def description() -> str:
    """``--help``'s text above the flags: what the planner does and an example."""
    return "\n".join([
        paragraph("Rank the parallel layouts of a model on a GPU job (every tp, pp, vp, cp, ep, dp, sharding level, "
                  "recompute preset and micro-batch size the library accepts) by predicted peak memory per GPU and "
                  "tokens/s per GPU. Prints the ranked table, rejected layouts with the reason, then the best "
                  "layout as MegatronStrategy keywords and as Megatron flags."),
        "",
        "example:",
        "  python -m lightning_megatron.planner --model llama3_70b --gpus 64 \\",
        "      --gpu-memory 80 --seq-length 8192 --global-batch-size 512 \\",
        "      --hardware h100 --show tp=4,pp=4,cp=2",
    ])


def epilog() -> str:
    """``--help``'s text below the flags: the models, the sharding levels and the ``verify`` sub-command."""
    return "\n".join([
        "models (--model: the GPTConfig presets):",
        paragraph(" ".join(MODELS), indent=2),
        "",
        "sharding levels (--sharding: Megatron's --data-parallel-sharding-strategy),",
        "what each splits over the data-parallel ranks:",
        rows(SHARDING_HELP),
        "",
        "sub-command:",
        rows({"verify": "run chosen ranks of a LightningCLI configuration in dry runs (fake collectives) beside "
                        "the planner's prediction (python -m lightning_megatron.planner verify --help)"}),
    ])


def build_parser() -> argparse.ArgumentParser:
    """The planner's flags; ``--help`` prints :func:`description`, the flags and :func:`epilog`."""
    p = argparse.ArgumentParser(prog="python -m lightning_megatron.planner", description=description(),
                                epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=MODELS, metavar="NAME", help="a GPTConfig preset (below)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job (8 per node)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="memory of one GPU in GiB as torch reports it (default: the hardware profile's)")
    p.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--exp-avg-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Adam's first moment (bf16: the precision-aware optimizer)")
    p.add_argument("--exp-avg-sq-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Adam's second moment (bf16: the precision-aware optimizer)")
    p.add_argument("--params-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="parameters (bf16: MegatronPrecision(params_dtype=torch.bfloat16), fp32 main parameters and "
                        "gradients, Megatron's --bf16; under FSDP's levels FSDP2's fp32 shards)")
    p.add_argument("--accumulate-allreduce-grads-in-fp32", dest="params_dtype", action="store_const", const="bf16",
                   help="Megatron's flag for bf16 parameters with fp32 main gradients: --params-dtype bf16")
    p.add_argument("--store-param-remainders", action=argparse.BooleanOptionalAction, default=None,
                   help="with bf16 parameters: fp32 main parameters held as 16-bit remainders next to the bf16 "
                        "parameters (2 bytes per parameter less; on by default with bf16 parameters, as "
                        "MegatronPrecision's and Megatron's)")
    p.add_argument("--recompute", nargs="+", default=["none", "selective", "full"], metavar="PRESET",
                   help=f"recompute presets to consider: {', '.join(RECOMPUTE_PRESETS)} or full_block:N")
    p.add_argument("--sharding", nargs="+", default=list(SUPPORTED_SHARDING), choices=SHARDING_LEVELS,
                   metavar="LEVEL", help="sharding levels to consider (below; default: all four)")
    p.add_argument("--hardware", choices=HARDWARE_NAMES, default="h200")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4], metavar="N",
                   help="micro-batch sizes to consider (default: 1 2 4)")
    p.add_argument("--top", type=int, default=10, help="feasible rows printed")
    p.add_argument("--rejected", type=int, default=5, help="rejected rows printed")
    p.add_argument("--show", action="append", default=[], metavar="SIZES",
                   help="also print the best row with these sizes, e.g. tp=4,pp=4,cp=2 (repeatable)")
    return p


def parse_show(spec: str) -> Dict[str, int]:
    """``"tp=4,pp=4,cp=2"`` -> ``{"tp": 4, "pp": 4, "cp": 2}``."""
    out: Dict[str, int] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in ("tp", "pp", "vp", "cp", "ep", "dp", "micro_batch_size") or not value.isdigit():
            raise ValueError(f"--show {spec!r}: give sizes as tp=4,pp=4,cp=2 (keys tp pp vp cp ep dp "
                             "micro_batch_size)")
        out[key] = int(value)
    return out


def main(argv: Optional[Sequence[str]] = None) -> Plan:
    """Plan, print the table and the best layout; returns the :class:`~lightning_megatron.planner.Plan`.
    ``verify ...`` runs chosen ranks of a configuration in dry runs instead
    (:mod:`lightning_megatron.planner.verify`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["verify"]:
        from lightning_megatron.planner.verify import main as verify

        return verify(argv[1:])
    args = build_parser().parse_args(argv)
    model = getattr(GPTConfig, args.model)()
    result = plan(model, args.gpus, args.global_batch_size, args.seq_length, args.hardware, args.gpu_memory,
                  args.precision, args.recompute, args.sharding, args.micro_batch_sizes, args.exp_avg_dtype,
                  args.exp_avg_sq_dtype, args.params_dtype, args.store_param_remainders)
    shown = []
    for spec in args.show:
        row = result.rank_of(**parse_show(spec))
        if row is not None:
            shown.append(row.layout)
    print(format_table(result, args.top, args.rejected, shown))
    for spec, layout in zip(args.show, shown):
        row = result.rank_of(**parse_show(spec))
        where = f"rank {result.index(row)}" if row.feasible else f"rejected ({row.reason})"
        mfu = f", predicted MFU {100 * row.prediction.mfu:.1f}%" if row.prediction else ""
        print(f"{spec}: {where}{mfu}")
    if result.feasible:
        best = result.best
        bf16_params = args.params_dtype == "bf16"
        remainders = ", store_param_remainders=False" if not result.work.store_param_remainders else ""
        plugin = (f", plugins=[MegatronPrecision('bf16-mixed', params_dtype=torch.bfloat16{remainders})]"
                  if bf16_params else "")
        print(f"best: MegatronStrategy(**{best.strategy_kwargs()}) with micro-batch {best.micro_batch_size} and "
              f"Trainer(accumulate_grad_batches={best.num_microbatches}{plugin}); MegatronStrategy.from_plan(plan) "
              "builds it")
        flags = best.flags(args.global_batch_size) + (["--bf16"] if bf16_params else []) + (
            ["--no-store-param-remainders"] if bf16_params and not result.work.store_param_remainders else [])
        print("flags: " + " ".join(flags))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
