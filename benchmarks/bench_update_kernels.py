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
* ``maxabs_<chunk>_<block>``: :class:`~lightning_megatron.utils.max_abs.MaxAbsPerTensor` over the bf16 gradients
  with those chunk and block sizes (the library's: 16384 and 2048).

    python benchmarks/bench_update_kernels.py
"""
from __future__ import annotations

import json

import torch
from _timing import cuda_timed  # sibling module (run as a script)

from lightning_megatron.optimizer.param_remainders import split_fp32
from lightning_megatron.optimizer.precision_aware_adamw import adamw_multi_update_
from lightning_megatron.utils import max_abs

H, F, V, L = 2048, 5632, 32000, 24


def main() -> None:
    dev = "cuda"
    sizes = [V * H] + [n for _ in range(L) for n in (4096 * H, H * H, 2 * F * H, H * F)] + [V * H] + [H] * (2 * L + 1)
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
    for name, params, extra, options in (
            ("compiled_fp32main", views(main_fp32), dict(param_copies=views(copy)), {}),
            ("compiled_rem", views(high), dict(remainders=views(rem)), {}),
            ("compiled_rem_combo", views(high), dict(remainders=views(rem)), {"combo_kernels": True})):
        torch._dynamo.reset()
        update = torch.compile(adamw_multi_update_, dynamic=False, fullgraph=True, options=options)
        out[name] = cuda_timed(lambda: update(params, *args, count_steps=False, **extra))
    reference = max_abs.MaxAbsPerTensor()(grads)
    for chunk, block in ((16384, 2048), (65536, 4096), (32768, 2048), (65536, 2048), (8192, 1024)):
        max_abs._CHUNK, max_abs._BLOCK = chunk, block
        check = max_abs.MaxAbsPerTensor()
        assert torch.equal(check(grads), reference)
        out[f"maxabs_{chunk}_{block}"] = cuda_timed(lambda: check(grads))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
