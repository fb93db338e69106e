"""Host time of the FP8 delayed recipe's per-step amax update (``Float8Layers.end_step``) for as many GEMMs as the
1.3B benchmark model has (96: four per transformer layer), each with a use of every kind recorded, on the CPU with
one thread (the tensors are 3 and 3 x history elements: the time is the operations' dispatch, what the host spends
launching them on a GPU too).

    python benchmarks/kernels/bench_fp8_end_step.py [--gemms 96] [--steps 200] [--pipeline]
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from lightning_megatron.precision.fp8 import Float8Config, Float8Gemm, Float8Layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemms", type=int, default=96)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pipeline", action="store_true", help="the pipeline schedules' update (last uses of a ring)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = Float8Config(recipe="delayed", backend="torch")
    gemms = [Float8Gemm(config) for _ in range(args.gemms)]
    layers = Float8Layers(config=config, gemms=gemms, converted=[f"layer{i}" for i in range(args.gemms)],
                          gemm_names=[f"layer{i}" for i in range(args.gemms)])
    layers.allocate(torch.device("cpu"), ring=args.pipeline)
    last = 1 if args.pipeline else None
    amax = torch.tensor(1.0)

    def record() -> None:
        for gemm in gemms:
            for kind in range(3):
                gemm._record(kind, amax)

    record()
    layers.end_step(last)          # the histories start
    total = 0.0
    for _ in range(args.steps):
        record()
        start = time.perf_counter()
        layers.end_step(last)
        total += time.perf_counter() - start
    print(f"end_step: {total / args.steps * 1e3:.3f} ms per step, {args.gemms} GEMMs"
          + (", pipeline" if args.pipeline else ""))


if __name__ == "__main__":
    main()
