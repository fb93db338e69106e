"""FP8 against bf16 over a whole short run on the shipped corpus: ``examples/pretrain_gpt.py`` (the public flags, so
Trainer + MegatronStrategy + MegatronPrecision + ParallelGPTModule) trains the benchmark model's shape twice from
the same seed, once with ``--bf16`` and once with ``--bf16 --fp8-format hybrid --fp8-recipe <recipe>``, and the
two loss curves are compared: the mean train loss of the last 10 steps and the final validation loss.

    python benchmarks/end_to_end/fp8_convergence.py [--train-iters 200] [--fp8-recipe tensorwise] [--out DIR]

One GPU (``--accelerator gpu --devices 1``). Prints one table row per arm and the FP8 / bf16 ratios; writes the
loss curves (``<out>/<arm>.csv``) and ``<out>/fp8_convergence.json``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]


def model_flags() -> List[str]:
    """``GPTConfig.llama_1b_bench()``'s shape as Megatron flags (the shipped corpus brings its own vocabulary), with
    the benchmark's micro-batch of 4 on one GPU."""
    sys.path.insert(0, str(ROOT))
    from lightning_megatron import GPTConfig

    c = GPTConfig.llama_1b_bench()
    return ["--num-layers", str(c.num_layers), "--hidden-size", str(c.hidden_size), "--ffn-hidden-size",
            str(c.ffn_hidden_size), "--num-attention-heads", str(c.num_attention_heads), "--group-query-attention",
            "--num-query-groups", str(c.num_query_groups), "--seq-length", str(c.seq_length),
            "--micro-batch-size", "4", "--tensor-model-parallel-size", "1"]


def run_arm(name: str, extra: List[str], args: argparse.Namespace, out: Path) -> Dict[str, float]:
    cmd = [sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), *model_flags(),
           "--train-iters", str(args.train_iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "20",
           "--eval-interval", str(args.train_iters), "--eval-iters", "8", "--log-interval", "20",
           "--bf16", "--compile", "--accelerator", "gpu", "--devices", "1", "--loss-curve", str(out / name), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    with open(out / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    train = [float(r["train_loss"]) for r in rows]
    val = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    return dict(steps=len(train), first_loss=train[0], last10_train_loss=sum(train[-10:]) / len(train[-10:]),
                final_val_loss=val[-1] if val else float("nan"), wall_s=round(wall, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "delayed"])
    p.add_argument("--out", default="fp8_convergence")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = {"bf16": [], f"fp8-{args.fp8_recipe}": ["--fp8-format", "hybrid", "--fp8-recipe", args.fp8_recipe]}
    results = {name: run_arm(name, extra, args, out) for name, extra in arms.items()}
    bf16, fp8 = results["bf16"], results[f"fp8-{args.fp8_recipe}"]
    ratios = {k: fp8[k] / bf16[k] for k in ("last10_train_loss", "final_val_loss")}
    print("| arm | steps | first loss | train loss, mean of last 10 steps | final val loss | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['steps']} | {r['first_loss']:.4f} | {r['last10_train_loss']:.4f} | "
              f"{r['final_val_loss']:.4f} | {r['wall_s']} |")
    print("FP8 / bf16:", {k: round(v, 4) for k, v in ratios.items()})
    (out / "fp8_convergence.json").write_text(json.dumps(dict(results=results, ratios=ratios), indent=1))


if __name__ == "__main__":
    main()
