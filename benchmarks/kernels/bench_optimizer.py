"""The optimizer step alone on one GPU, over the parameters of ``GPTConfig.llama_1b_bench()`` (1.26B, fp32 as the
optimizer sees them: the main parameters): torch's fused AdamW (fp32 moments) against
:class:`~lightning_megatron.PrecisionAwareAdamW` with bf16 and with fp32 moments (and, as an experiment, with bf16
moments compiled for the parameter group's fixed shapes), and with ``--flat`` the bf16-moment update over
:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`' contiguous buffers (bf16 parameters: one flat tensor per
bucket, the bf16 copies written in the same pass) compiled three ways. Prints one JSON line per optimizer:
device ms per step (CUDA events), host ms per step (the time ``step()`` takes to return, without waiting for the
GPU) and the optimizer states' GiB.

    python benchmarks/kernels/bench_optimizer.py [--steps 20] [--warmup 3] [--flat]
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


def all_shapes(**kwargs):
    """A :class:`PrecisionAwareAdamW` whose update is compiled once for all shapes (``dynamic=True``: the library's
    before it compiled for the lists' fixed shapes)."""
    from lightning_megatron import PrecisionAwareAdamW
    from lightning_megatron.optimizer.precision_aware_adamw import adamw_multi_update_

    class AllShapes(PrecisionAwareAdamW):
        def _update_fn(self, device):
            if self._compiled is None:
                self._compiled = torch.compile(adamw_multi_update_, dynamic=True, fullgraph=True)
            return self._compiled

    return lambda ps: AllShapes(ps, **kwargs)


def per_tensor(**kwargs):
    """A :class:`PrecisionAwareAdamW` whose update is :func:`adamw_update_` compiled once and called per tensor (an
    experiment: one kernel per tensor, where the library's one compiled call over the lists lets Inductor fuse the
    updates of equally sized tensors into one kernel)."""
    from lightning_megatron import PrecisionAwareAdamW
    from lightning_megatron.optimizer.precision_aware_adamw import adamw_update_, count_steps_

    class PerTensor(PrecisionAwareAdamW):
        def _update_fn(self, device):
            if self._compiled is None:
                one = torch.compile(adamw_update_, dynamic=True, fullgraph=True)

                def each(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                         grad_scale=None, found_inf=None, count_steps=True, param_copies=None):
                    if count_steps:
                        count_steps_(steps, found_inf)
                    copies = param_copies if param_copies is not None else [None] * len(params)
                    for p, g, m, v, s, c in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
                        one(p, g, m, v, s, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf, c)
                self._compiled = each
            return self._compiled

    return lambda ps: PerTensor(ps, **kwargs)


def flat_parameters(device: str):
    """The benchmark model's parameters as bf16 parameters in MainParams' buffers, in the main view (the fp32 main
    parameters, as the optimizer sees them), with their main gradients as views of the gradient buckets."""
    from lightning_megatron import GPTConfig, GPTModel
    from lightning_megatron.parallel.param_buffer.buffer import MainParams

    with torch.device("meta"):
        model = GPTModel(GPTConfig.llama_1b_bench())
    model.to_empty(device=device)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    main = MainParams(model)
    main.to_main()
    for p in main.params:
        p.grad = main._grad_view(p).normal_(std=1e-3)
    return main


def measure(name: str, make, params, steps: int, warmup: int, main=None) -> dict:
    if main is None:
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    if main is not None:   # the update writes the bf16 copies; stay in the main view between steps
        opt.write_param_copies(main.compute_copy)
        opt.found_inf = torch.zeros((), device="cuda")   # as in training: the non-finite guard's device flag
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
    if main is None:
        for p in params:
            p.grad = None
    torch.cuda.empty_cache()
    return row


def main() -> None:
    from lightning_megatron import PrecisionAwareAdamW

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--flat", action="store_true", help="only the arms over MainParams' contiguous buffers")
    args = ap.parse_args()
    if args.flat:
        flat_arms(args)
        return
    params = parameters("cuda")

    arms = {
        "torch AdamW fused, fp32 moments": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
        "PrecisionAwareAdamW, bf16 moments": lambda ps: PrecisionAwareAdamW(
            ps, lr=1e-4, weight_decay=0.1, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
        "PrecisionAwareAdamW, fp32 moments": lambda ps: PrecisionAwareAdamW(ps, lr=1e-4, weight_decay=0.1),
        "PrecisionAwareAdamW, bf16 moments, compiled for all shapes (the previous library)": all_shapes(
            lr=1e-4, weight_decay=0.1, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
    }
    for name, make in arms.items():
        print(json.dumps(measure(name, make, params, args.steps, args.warmup)), flush=True)


def flat_arms(args) -> None:
    """The bf16-moment update over the contiguous buffers (about 40 flat tensors for 147 parameters): one call over the
    lists compiled for their fixed shapes (the library's), one compiled call per flat tensor, and the list call
    compiled for all shapes (the library's before)."""
    from lightning_megatron import PrecisionAwareAdamW

    main = flat_parameters("cuda")
    params = main.params

    kw = dict(lr=1e-4, weight_decay=0.1, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    arms = {"flat buffers: one call over the lists, compiled for their fixed shapes (the library's)":
            lambda ps: PrecisionAwareAdamW(ps, **kw),
            "flat buffers: one compiled call per flat tensor (experiment)": per_tensor(**kw),
            "flat buffers: one call over the lists, compiled for all shapes (the library's before)": all_shapes(**kw)}
    for name, make in arms.items():
        print(json.dumps(measure(name, make, params, args.steps, args.warmup, main)), flush=True)


if __name__ == "__main__":
    main()
