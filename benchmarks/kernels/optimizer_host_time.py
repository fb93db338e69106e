"""The host time of :class:`~lightning_megatron.PrecisionAwareAdamW`'s step outside its update kernels, on the CPU.

The benchmark model's structure (``GPTConfig.llama_1b_bench()``: 24 layers, 147 parameters) at hidden size 64, its
parameters in :class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`' bf16 buckets, two parameter groups (matrices
with weight decay, vectors without) and bf16 moments, as ``ParallelGPTModule`` builds them for bf16 parameters. The
update kernels are replaced by a no-op, so what is timed is the host's own work per step: finding the parameters with
gradients, the flat update lists, the step counts and the switch back to the compute view. Prints one JSON line:
the minimum and median ms per step.

    python benchmarks/kernels/optimizer_host_time.py [--steps 50] [--warmup 10]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    from lightning_megatron import GPTConfig, GPTModel, PrecisionAwareAdamW
    from lightning_megatron.parallel.param_buffer.buffer import MainParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig.llama_1b_bench(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                                      vocab_size=128, seq_length=16)
    model = GPTModel(config)
    main_params = MainParams(model, torch.bfloat16, bucket_size=50_000)
    groups = [{"params": [p for p in main_params.params if p.dim() >= 2]},
              {"params": [p for p in main_params.params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = PrecisionAwareAdamW(groups, lr=1e-3, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    main_params.attach(optimizer)
    optimizer._update_fn = lambda device: (lambda *a, **k: None)   # time the host's work, not the update
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    times = []
    for _ in range(args.warmup + args.steps):
        main_params.to_compute()
        model(tokens).float().sum().backward()
        main_params.to_main()
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    timed = sorted(times[args.warmup:])
    print(json.dumps({"parameters": len(main_params.params), "buckets": len(main_params.buckets),
                      "host_ms_min": round(timed[0] * 1e3, 3),
                      "host_ms_median": round(timed[len(timed) // 2] * 1e3, 3)}))


if __name__ == "__main__":
    main()
