"""Precision arms on one GPU: tokens/s and peak memory of ``ParallelGPTModule(GPTConfig.llama_1b_bench())`` through
the public Trainer API (``MegatronStrategy`` + ``MegatronPrecision``), seq 2048, micro-batch 4, 4 warm-up and 10
timed steps, AdamW; plus the compiled plain-PyTorch peer in the same call. Prints a markdown table at the end.

    python benchmarks/end_to_end/bench_precision.py [--arms a,b,...] [--budget-s 330] [--peer PATH]

Each arm runs in a child process of its own (a crash, an out-of-memory or a missing Transformer Engine costs that
arm only: its error is printed and the table says why); arms not started within ``--budget-s`` are reported as
skipped. The compiled arms come after the eager ones. Arms:

  bf16-autocast          MegatronPrecision("bf16-mixed"): fp32 parameters, autocast
  bf16-params            + params_dtype=torch.bfloat16: bf16 parameters, fp32 main parameters and gradients
  fp8-tensorwise / fp8-rowwise / fp8-delayed   torch-native FP8 (torch._scaled_mm), hybrid format
  fp8-te-delayed         Transformer Engine backend, hybrid delayed scaling (needs transformer_engine importable)
  <arm>-bf16-moments     bf16-params / fp8-tensorwise / fp8-delayed with the precision-aware AdamW: both moments
                         stored in bf16 (ParallelGPTModule(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
  <arm>-compile          the same with MegatronStrategy(compile=True)
  peer-compile           the shared plain-PyTorch peer (``peer_baseline.py compile``)
  peer-fp8               the same with torchao float8, tensorwise (``peer_baseline.py fp8``; torchao importable)
  peer-megatron-<mode>   Megatron-Core 0.19.2 with Transformer Engine layers (``peer_megatron_te.py <mode>``, mode
                         bf16 / fp8-delayed / fp8-tensorwise: bf16 parameters and torch's fused AdamW on them);
                         ``peer-megatron-full-<mode>`` with ``FULL=1``: Megatron's own DDP (fp32 gradient buffer)
                         and optimizer (fp32 main parameters, clipping). Needs megatron-core and TE importable.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]
PEAK = 989e12
BASE_ARMS = {
    "bf16-autocast": dict(precision="bf16-mixed"),
    "bf16-params": dict(precision="bf16-mixed", params_dtype="bfloat16", store_param_remainders=False),
    "fp8-tensorwise": dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="tensorwise", fp8_backend="torch"),
    "fp8-rowwise": dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="rowwise", fp8_backend="torch"),
    "fp8-delayed": dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="delayed", fp8_backend="torch"),
    "fp8-te-delayed": dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="delayed", fp8_backend="te"),
    "bf16-params-bf16-moments": dict(precision="bf16-mixed", params_dtype="bfloat16", store_param_remainders=False,
                                     exp_avg_dtype="bf16",
                                     exp_avg_sq_dtype="bf16"),
    "fp8-tensorwise-bf16-moments": dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="tensorwise",
                                        fp8_backend="torch", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
    "fp8-delayed-bf16-moments": dict(precision="bf16-mixed", fp8="hybrid", fp8_recipe="delayed", fp8_backend="torch",
                                     exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
}
#: arm keys that are ParallelGPTModule arguments (the precision-aware optimizer), not MegatronPrecision ones
MODULE_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype")
#: eager arms, the peer, then the compiled arms (the most asked-for first: arms past the budget are skipped)
ARMS = list(BASE_ARMS) + ["peer-compile"] + [f"{a}-compile" for a in (
    "bf16-params", "bf16-params-bf16-moments", "bf16-autocast", "fp8-te-delayed", "fp8-tensorwise",
    "fp8-tensorwise-bf16-moments", "fp8-delayed-bf16-moments", "fp8-delayed", "fp8-rowwise")] + [
    "peer-fp8"] + [f"peer-megatron-{full}{mode}" for full in ("", "full-")
                   for mode in ("bf16", "fp8-delayed", "fp8-tensorwise")]


def run_arm(name: str, warmup: int, timed: int, mbs: int, accelerator: str = "gpu", tiny: bool = False) -> dict:
    """One arm in this process; returns its result row."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "benchmarks" / "end_to_end"))
    from bench_tp import RandomTokens, StepTimer

    from lightning_megatron import GPTConfig, MegatronPrecision, MegatronStrategy, ParallelGPTModule
    from lightning_megatron.callbacks.flops import flops_per_token

    compile_ = name.endswith("-compile")
    kwargs = dict(BASE_ARMS[name[:-len("-compile")] if compile_ else name])
    if "params_dtype" in kwargs:
        kwargs["params_dtype"] = getattr(torch, kwargs["params_dtype"])
    module_kwargs = {k: kwargs.pop(k) for k in MODULE_KEYS if k in kwargs}
    cfg = GPTConfig.llama_1b_bench() if not tiny else GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                                  ffn_hidden_size=128, vocab_size=256, seq_length=64)
    timer = StepTimer(start=warmup, stop=warmup + timed)
    module = ParallelGPTModule(cfg, lr=1e-4, min_lr=1e-5, lr_warmup_iters=1, lr_decay_iters=1000, weight_decay=0.1,
                               **module_kwargs)
    plugin = MegatronPrecision(**kwargs)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=MegatronStrategy(compile=compile_),
                         plugins=[plugin], max_steps=warmup + timed, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[timer])
    trainer.fit(module, DataLoader(RandomTokens(cfg), batch_size=mbs, num_workers=2, pin_memory=accelerator == "gpu"))
    dt = timer.times[1] - timer.times[0]
    tokens = mbs * cfg.seq_length * timed / dt
    if len(timer.times) < 2:
        raise RuntimeError(f"the timed window did not complete (times {timer.times})")
    fp8 = trainer.strategy.parallelized.fp8
    return dict(arm=name, tokens_per_s=round(tokens), tflops=round(tokens * flops_per_token(cfg) / 1e12, 1),
                mfu_bf16=round(tokens * flops_per_token(cfg) / PEAK, 4),
                peak_mem_gib=round(timer.peak_mem / 2**30, 2), base_mem_gib=round(timer.base_mem / 2**30, 2),
                peak_reserved_gib=round(timer.peak_reserved / 2**30, 2),
                loss=round(timer.losses[-1], 4) if timer.losses else None,
                note=(f"backend={fp8.config.backend} fp8 layers={len(fp8.converted)}" if fp8 is not None else ""))


def run_peer(arm: str, peers: Dict[str, Path], timeout: float) -> dict:
    """A peer arm as a child process (``peer-compile`` / ``peer-fp8``: ``peer_baseline.py compile|fp8``;
    ``peer-megatron-[full-]<mode>``: ``peer_megatron_te.py <mode>``); its JSON line as a row."""
    env = dict(os.environ)
    if arm.startswith("peer-megatron-"):
        mode = arm[len("peer-megatron-"):]
        if mode.startswith("full-"):
            env["FULL"], mode = "1", mode[len("full-"):]
        cmd = [sys.executable, str(peers["megatron"]), mode]
    else:
        cmd = [sys.executable, str(peers["baseline"]), arm[len("peer-"):]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{") and '"name"' in line]
    if not rows:
        raise RuntimeError(f"peer printed no result (rc {out.returncode}): {out.stderr[-800:]}")
    r = rows[-1]
    if "error" in r:
        raise RuntimeError(r["error"])
    tokens = r.get("tokens_per_s", r.get("tokens_per_s_per_gpu"))
    return dict(arm=arm, tokens_per_s=tokens, tflops=r.get("tflops", round(PEAK * r["mfu"] / 1e12, 1)),
                mfu_bf16=r["mfu"], peak_mem_gib=r["peak_mem_gib"], base_mem_gib=None, loss=r.get("loss"),
                note=r.get("name", ""))


def find_peer(root: Path, name: str) -> Path:
    """``shared/bench/<name>`` in or beside the repository, else ``benchmarks/peers/<name>``."""
    candidates = [root / "shared" / "bench" / name, root.parent / "shared" / "bench" / name,
                  root / "benchmarks" / "peers" / name]
    return next((c for c in candidates if c.exists()), candidates[-1])


def child(name: str, args) -> None:
    """Run one arm and print its row as one ``RESULT {json}`` line."""
    try:
        row = run_arm(name, args.warmup, args.timed, args.mbs, args.accelerator, args.tiny)
    except Exception as e:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        first = e
        while first.__context__ is not None:   # Lightning's teardown may raise again over the cause
            first = first.__context__
        cause = f"{type(first).__name__}: {first}" + (f" (then {type(e).__name__}: {e})" if first is not e else "")
        row = dict(arm=name, error=cause[:400])
    print("RESULT " + json.dumps(row), flush=True)


def table(rows) -> str:
    base = next((r["tokens_per_s"] for r in rows if r["arm"] == "bf16-autocast" and "tokens_per_s" in r), None)
    lines = ["| arm | tokens/s | vs bf16-autocast | TFLOP/s | MFU (bf16 peak) | peak GiB | params+grads+states GiB "
             "| loss | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['arm']} | - | - | - | - | - | - | - | {r.get('error', '')} |")
            continue
        rel = f"{r['tokens_per_s'] / base:.3f}x" if base else "-"
        lines.append(f"| {r['arm']} | {r['tokens_per_s']} | {rel} | {r['tflops']} | {r['mfu_bf16']} | "
                     f"{r['peak_mem_gib']} | {r['base_mem_gib']} | {r['loss']} | {r['note']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {ARMS}")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no arm after this many seconds")
    p.add_argument("--arm-timeout-s", type=float, default=150.0,
                   help="per arm; an arm started late gets at most budget + 60 s - elapsed (total <= ~400 s)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--timed", type=int, default=10)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--peer", default=None, help="the plain-PyTorch peer (default: shared/bench/peer_baseline.py "
                   "in or beside the repository, else benchmarks/peers/peer_baseline.py, the same file)")
    p.add_argument("--peer-megatron", default=None, help="the Megatron-Core + TE peer (default: "
                   "shared/bench/peer_megatron_te.py in or beside the repository)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--accelerator", default="gpu", help=argparse.SUPPRESS)   # cpu + --tiny: a smoke run of the script
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args)
        return
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {ARMS}")
    peers = {"baseline": Path(args.peer) if args.peer else find_peer(ROOT, "peer_baseline.py"),
             "megatron": Path(args.peer_megatron) if args.peer_megatron else find_peer(ROOT, "peer_megatron_te.py")}
    start, rows = time.perf_counter(), []
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    for arm in arms:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            rows.append(dict(arm=arm, error=f"skipped: time budget ({elapsed:.0f} s > {args.budget_s:.0f} s)"))
            continue
        left = max(30.0, min(args.arm_timeout_s, args.budget_s + 60 - elapsed))
        print(f"== {arm} (t={elapsed:.0f}s, limit {left:.0f}s)", flush=True)
        try:
            if arm.startswith("peer-"):
                row = run_peer(arm, peers, left)
            else:
                out = subprocess.run([sys.executable, __file__, "--child", arm, "--warmup", str(args.warmup),
                                      "--timed", str(args.timed), "--mbs", str(args.mbs),
                                      "--accelerator", args.accelerator] + (["--tiny"] if args.tiny else []),
                                     capture_output=True, text=True, timeout=left, env=env, cwd=ROOT)
                found = [line[len("RESULT "):] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                if not found:
                    raise RuntimeError(f"no result (rc {out.returncode}): {out.stderr[-600:]}")
                row = json.loads(found[-1])
                if "error" in row:
                    print(out.stderr[-1500:], flush=True)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row = dict(arm=arm, error=f"{type(e).__name__}: {str(e)[-300:]}")
        row["wall_s"] = round(time.perf_counter() - start - elapsed, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\npeers: {peers['baseline']}, {peers['megatron']}; seq 2048, micro-batch {args.mbs}, {args.warmup} warm-up + {args.timed} timed steps, 1 {args.accelerator.upper()}; "
          f"total {time.perf_counter() - start:.0f} s\n", flush=True)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
