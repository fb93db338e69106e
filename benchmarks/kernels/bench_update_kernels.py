"""The compiled optimizer update and the non-finite check's max-abs pass alone on one GPU, over the 1.3B benchmark
model's parameter shapes as a direct step sees them (1.26B parameters: the bf16 compute copies in one flat buffer,
each bf16 gradient an allocation of its own, so the update is one pointwise kernel per parameter; bf16 moments).
Device ms per call (CUDA events, mean of 10 after 3 warm-up calls) of:

* ``compiled_fp32main``: :func:`~lightning_megatron.optimizer.precision_aware_adamw.adamw_multi_update_` compiled
  as :class:`~lightning_megatron.PrecisionAwareAdamW` compiles it, stepping fp32 main parameters and writing the bf16
  copies (20 bytes per parameter);
* ``compiled_rem``: the same over bf16 copies and int16 remainders (``store_param_remainders``: 18 bytes);
* ``compiled_rem_combo``: that with Inductor's combo kernels (several tensors' updates per kernel; an option the
  optimizer does not take: benchmarks/RESULTS.md);
* ``compiled_rem_coordesc``: ``compiled_rem`` with Inductor's coordinate-descent tuning (each kernel's block size
  and warps tuned by timing it at compile time);
* ``compiled_rem_one_config``: ``compiled_rem`` without Inductor's choice between two block sizes per pointwise kernel
  (``triton.autotune_pointwise=False``: each kernel takes the larger block);
* ``maxabs_<chunk>_<block>_<warps>``: :class:`~lightning_megatron.utils.max_abs.MaxAbsPerTensor` over the bf16
  gradients with those chunk and block sizes and warps per program (the library's: 16384, 2048 and 4);
* ``maxabs_inductor``: the same values as one compiled function (``abs().amax()`` per gradient, stacked).

    python benchmarks/kernels/bench_update_kernels.py [--arms compiled_rem,compiled_rem_one_config,maxabs] [--layers 24]

(``maxabs`` selects every max-abs arm; ``--layers``: the model's layers whose parameters are stepped, fewer to
compile faster: the same kernels, fewer launches of each.) Each arm's figure is printed as it is measured
(``ARM <name> <ms>``), then all of them as one JSON line.
"""
from __future__ import annotations

import argparse
import json

import torch
from _timing import cuda_timed  # sibling module (run as a script)

from lightning_megatron.optimizer.param_remainders import split_fp32
from lightning_megatron.optimizer.precision_aware_adamw import adamw_multi_update_
from lightning_megatron.utils import max_abs

H, F, V, L = 2048, 5632, 32000, 24


#: the update arms over bf16 copies and remainders -> the Inductor options each compiles with
REMAINDER_ARMS = {"compiled_rem": {}, "compiled_rem_combo": {"combo_kernels": True},
                  "compiled_rem_coordesc": {"coordinate_descent_tuning": True},
                  "compiled_rem_one_config": {"triton.autotune_pointwise": False}}
UPDATE_ARMS = ("compiled_fp32main", *REMAINDER_ARMS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(UPDATE_ARMS + ("maxabs",)))
    p.add_argument("--layers", type=int, default=L)
    args = p.parse_args()
    chosen, layers = args.arms.split(","), args.layers
    unknown = set(chosen) - set(UPDATE_ARMS) - {"maxabs"}
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}: choose from {', '.join(UPDATE_ARMS)}, maxabs")
    dev = "cuda"
    sizes = ([V * H] + [n for _ in range(layers) for n in (4096 * H, H * H, 2 * F * H, H * F)] + [V * H] +
             [H] * (2 * layers + 1))
    n = sum(sizes)

    def views(buf):
        return list(torch.split(buf, sizes))

    main_fp32 = torch.randn(n, device=dev) * 0.02
    copy = main_fp32.to(torch.bfloat16)
    high, rem = split_fp32(main_fp32)
    m = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    v = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    grads = [torch.randn(k, device=dev).to(torch.bfloat16) * 1e-3 for k in sizes]
    steps = [torch.ones((), device=dev) for _ in sizes]
    lr = torch.full((), 1e-4, device=dev)
    args = (grads, views(m), views(v), steps, lr, 0.9, 0.95, 1e-8, 0.1, None, None)
    out = {"parameters": n}
    arms = [("compiled_fp32main", views(main_fp32), dict(param_copies=views(copy)), {})]
    arms += [(name, views(high), dict(remainders=views(rem)), options) for name, options in REMAINDER_ARMS.items()]
    for name, params, extra, options in arms:
        if name not in chosen:
            continue
        torch._dynamo.reset()
        update = torch.compile(adamw_multi_update_, dynamic=False, fullgraph=True, options=options)
        out[name] = cuda_timed(lambda: update(params, *args, count_steps=False, **extra))
        print(f"ARM {name} {out[name]:.3f}", flush=True)
    if "maxabs" not in chosen:
        print(json.dumps(out), flush=True)
        return
    reference = max_abs.MaxAbsPerTensor()(grads)
    for chunk, block, warps in ((16384, 2048, 4), (16384, 4096, 4), (16384, 4096, 8), (32768, 4096, 8),
                                (65536, 8192, 8), (16384, 1024, 2)):
        max_abs._CHUNK, max_abs._BLOCK, max_abs._NUM_WARPS = chunk, block, warps
        check = max_abs.MaxAbsPerTensor()
        assert torch.equal(check(grads), reference)
        out[f"maxabs_{chunk}_{block}_{warps}"] = cuda_timed(lambda: check(grads))
    torch._dynamo.reset()
    inductor = torch.compile(lambda gs: torch.stack([g.abs().amax().float() for g in gs]), dynamic=False)
    assert torch.equal(inductor(grads), reference)
    out["maxabs_inductor"] = cuda_timed(lambda: inductor(grads))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
