"""The optimizer step alone on one GPU, over the parameters of ``GPTConfig.llama_1b_bench()`` (1.26B, fp32 as the
optimizer sees them: the main parameters): torch's fused AdamW (fp32 moments) against
:class:`~lightning_megatron.PrecisionAwareAdamW` with bf16 and with fp32 moments (and, as an experiment, with bf16
moments compiled for the parameter group's fixed shapes). Prints one JSON line per optimizer:
device ms per step (CUDA events), host ms per step (the time ``step()`` takes to return, without waiting for the
GPU) and the optimizer states' GiB.

    python benchmarks/bench_optimizer.py [--steps 20] [--warmup 3]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def parameters(device: str):
    from lightning_megatron import GPTConfig, GPTModel

    with torch.device("meta"):
        model = GPTModel(GPTConfig.llama_1b_bench())
    return [torch.nn.Parameter(torch.empty(p.shape, device=device).normal_(std=0.02)) for p in model.parameters()]


def measure(name: str, make, params, steps: int, warmup: int) -> dict:
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        host += time.perf_counter() - t
    end.record()
    torch.cuda.synchronize()
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    row = dict(optimizer=name, device_ms=round(start.elapsed_time(end) / steps, 3),
               host_ms=round(host * 1e3 / steps, 3),
               state_gib=round(states / 2**30, 2), params=sum(p.numel() for p in params))
    del opt
    for p in params:
        p.grad = None
    torch.cuda.empty_cache()
    return row


def main() -> None:
    from lightning_megatron import PrecisionAwareAdamW
    from lightning_megatron.optimizer import adamw_multi_update_

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    params = parameters("cuda")

    class StaticShapes(PrecisionAwareAdamW):
        """An experiment: the update compiled for the group's fixed shapes (``dynamic=False``) instead of once for
        all shapes (the library's), to see what the generic kernels cost on the device. It also specialises on the
        hyper-parameters (a new compile for every learning rate), which this benchmark keeps fixed."""

        def _update_fn(self, device):
            if self._compiled is None:
                self._compiled = torch.compile(adamw_multi_update_, dynamic=False, fullgraph=True)
            return self._compiled

    arms = {
        "torch AdamW fused, fp32 moments": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
        "PrecisionAwareAdamW, bf16 moments": lambda ps: PrecisionAwareAdamW(
            ps, lr=1e-4, weight_decay=0.1, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
        "PrecisionAwareAdamW, fp32 moments": lambda ps: PrecisionAwareAdamW(ps, lr=1e-4, weight_decay=0.1),
        "PrecisionAwareAdamW, bf16 moments, compiled for fixed shapes (experiment)": lambda ps: StaticShapes(
            ps, lr=1e-4, weight_decay=0.1, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
    }
    for name, make in arms.items():
        print(json.dumps(measure(name, make, params, args.steps, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
