"""One transformer layer of ``GPTConfig.llama_1b_bench()`` on one GPU (bf16 parameters, bf16 autocast, seq 2048,
micro-batch 4), forward + backward, compiled in several ways: how Inductor lowers the layer's two concatenations
(SwiGLU's gradient ``[d gate; d up]`` and RoPE's rotated half) and what that costs.

Arms (``--arms``, comma-separated):

* ``default``: ``torch.compile`` as the library compiles a layer.
* ``torch-swiglu``: ``default`` with the MLP's SwiGLU as plain torch operations (``silu(gate) * up``, autograd's
  backward) instead of :func:`~lightning_megatron.models.swiglu.swiglu` and its one-pass backward.
* ``concat``: Inductor option ``max_pointwise_cat_inputs=1`` (and ``max_complex_pointwise_cat_inputs=1`` where torch
  has it): every cat is a
  concat kernel whose inputs are computed straight into the output's slices, instead of one pointwise kernel that
  evaluates each input for each output element.
* ``rope-halves``: ``default`` with RoPE written as the cat of its two rotated halves (``x1 c - x2 s``, ``x2 c + x1 s``),
  the same values (the tables' halves are equal).
* ``concat-rope-halves``: both.
* ``rmsnorm-ops``: ``default`` with RMSNorm written as torch operations (fp32 mean of squares, ``rsqrt``, scale,
  weight, back to the input's dtype), which Inductor compiles whole, instead of ``F.rms_norm``.
* ``swiglu-default`` / ``swiglu-concat``: SwiGLU alone (``[8192, 11264]`` in) as torch operations, forward +
  backward; ``swiglu-kernel``: :func:`~lightning_megatron.models.swiglu.swiglu` alone.

Prints one JSON line per arm: ms per forward + backward (CUDA events, median of ``--iters`` after ``--warmup``) and
the profiled iteration's largest kernels. Not part of the library: a measurement for ``benchmarks/RESULTS.md``.

    python benchmarks/kernels/bench_layer_kernels.py [--arms default,concat] [--iters 20]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import torch.nn.functional as F

ARMS = ("default", "torch-swiglu", "concat", "rope-halves", "concat-rope-halves", "rmsnorm-ops", "swiglu-default",
        "swiglu-concat", "swiglu-kernel")
#: the Inductor options of the ``concat`` arms (those this torch has)
CONCAT = {k: 1 for k in ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")
          if hasattr(torch._inductor.config, k)}


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` as the cat of the two rotated halves (the tables' two halves are equal)."""
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., :half], x[..., half:], cos[..., :half], sin[..., :half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rms_norm_ops(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as torch operations, in fp32 (float64 for float64 inputs), returned in ``x``'s dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def time_arm(fn, inputs, grad, warmup: int, iters: int) -> dict:
    """Median ms of ``fn(*inputs).backward(grad)`` and the profiled iteration's largest kernels."""
    def once():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad)
    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, round(e.device_time_total / 1e3, 3), e.count) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda k: -k[1])
    return {"ms": round(statistics.median(times), 3), "kernels": [[k[:90], ms, n] for k, ms, n in kernels[:12]],
            "kernel_ms_total": round(sum(k[1] for k in kernels), 3)}


def main() -> None:
    from lightning_megatron import GPTConfig, GPTModel
    from lightning_megatron.models import gpt as gpt_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig.llama_1b_bench(num_layers=1)
    model = GPTModel(config).cuda().to(torch.bfloat16)
    layer = next(iter(model.decoder.layers.values()))
    s, b, h = config.seq_length, 4, config.hidden_size
    x = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    pos = torch.arange(s, device="cuda").unsqueeze(1).expand(s, b)
    rotary = model.rotary(pos, x)
    original_rope, library_swiglu, library_norm = gpt_module.apply_rotary, gpt_module.swiglu, gpt_module.rms_norm
    for arm in args.arms.split(","):
        torch._dynamo.reset()
        gpt_module.apply_rotary = rope_halves if arm.endswith("rope-halves") else original_rope
        gpt_module.swiglu = swiglu if arm == "torch-swiglu" else library_swiglu
        gpt_module.rms_norm = rms_norm_ops if arm == "rmsnorm-ops" else library_norm
        options = CONCAT if arm.startswith("concat") or arm == "swiglu-concat" else None
        if arm.startswith("swiglu"):
            fn = torch.compile(library_swiglu if arm == "swiglu-kernel" else swiglu, options=options)
            hin = torch.randn(s * b, 2 * config.ffn_hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            row = time_arm(fn, (hin,), torch.randn(s * b, config.ffn_hidden_size, device="cuda", dtype=torch.bfloat16),
                           args.warmup, args.iters)
        else:
            compiled = torch.compile(copy.deepcopy(layer), options=options)

            def fn(inp, compiled=compiled):
                with torch.autocast("cuda", torch.bfloat16):
                    return compiled(inp, rotary)
            row = time_arm(fn, (x,), grad, args.warmup, args.iters)
        print(json.dumps({"arm": arm, **row}), flush=True)
    gpt_module.apply_rotary, gpt_module.swiglu, gpt_module.rms_norm = original_rope, library_swiglu, library_norm


if __name__ == "__main__":
    main()
