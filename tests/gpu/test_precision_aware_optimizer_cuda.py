"""The precision-aware AdamW's compiled update on one GPU (:class:`~lightning_megatron.PrecisionAwareAdamW`):

- the ``torch.compile``d per-tensor update equals the eager one (the CPU suite's numerics) to fp32 round-off, over
  tensors of several shapes and a learning rate that changes every step, compiled once for all of them;
- a step with the non-finite guard's ``found_inf`` flag set makes no synchronising CUDA call, and skips;
- over MainParams' contiguous buffers (bf16 parameters) it equals the eager update and writes the bf16 copies;
- with the main parameters held as bf16 copy plus int16 remainder, too, and its halves join to the main parameters.
"""
from __future__ import annotations

import warnings

import torch

from lightning_megatron import PrecisionAwareAdamW

SHAPES = [(1024, 512), (512,), (1408, 512), (33, 7), (5,)]


def _params(device: str):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _grads(steps: int):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=g) * 10.0 ** -(i % 3) for i, s in enumerate(SHAPES)] for _ in range(steps)]


def _run(device: str, grads):
    params = _params(device)
    opt = PrecisionAwareAdamW(params, lr=1e-2, weight_decay=0.1, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    for step, gs in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)     # a scheduler's change: no recompilation
        for p, g in zip(params, gs):
            p.grad = g.to(device)
        opt.step()
    return params, opt


def test_compiled_update_equals_eager_and_compiles_once(measured):
    """6 steps, learning rates 1e-2 / (1 + step): one graph for every shape and learning rate. The compiled kernels
    round a few fp32 intermediates differently (lerp), so a stored bf16 moment can land one bf16 step away; a
    parameter then moves by at most that share of its updates: ``sum(lr) * 2**-7`` (1.9e-4). A wrong bias
    correction, decay or moment would be 1e-3 and more off."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    grads = _grads(6)
    gpu, gpu_opt = _run("cuda", grads)
    cpu, cpu_opt = _run("cpu", grads)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs compiled for {len(SHAPES)} shapes and 6 learning rates"
    worst_p = worst_m = flipped = total = 0.0
    for a, b in zip(gpu, cpu):
        worst_p = max(worst_p, float((a.detach().cpu() - b.detach()).abs().max()))
        for key in ("exp_avg", "exp_avg_sq"):
            assert gpu_opt.state[a][key].dtype == torch.bfloat16
            sa, sb = gpu_opt.state[a][key].cpu().float(), cpu_opt.state[b][key].float()
            worst_m = max(worst_m, float(((sa - sb).abs() / sb.abs().clamp(min=1e-30)).max()))
            flipped += float((sa != sb).sum())
            total += sb.numel()
    measured(param_abs=worst_p, moment_rel=worst_m, moments_flipped=flipped / total)
    bound = sum(1e-2 / (1 + step) for step in range(6)) * 2 ** -7
    assert worst_p <= bound, (worst_p, bound)
    assert worst_m <= 2 ** -6, worst_m          # one or two bf16 rounding steps
    assert flipped <= 0.01 * total, (flipped, total)


def test_step_with_found_inf_makes_no_synchronising_call_and_skips():
    params = _params("cuda")
    opt = PrecisionAwareAdamW(params, lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.found_inf = torch.zeros((), device="cuda")
    opt.step()                                  # compiles
    before = [p.detach().clone() for p in params]
    opt.found_inf.fill_(1.0)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(r.message) for r in records if "synchroniz" in str(r.message).lower()
             and "prototype" not in str(r.message).lower()]
    assert syncs == [], syncs
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(float(opt.state[p]["step"]) == 1 for p in params)


def test_step_counts_left_on_the_cpu_by_zero_loading_move_back():
    """ZeroRedundancyOptimizer's loading puts 0-dim states (``step``) on the CPU: the next step moves them back to
    the parameter's GPU and steps as before."""
    params = _params("cuda")
    opt = PrecisionAwareAdamW(params, lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        opt.state[p]["step"] = opt.state[p]["step"].cpu()
    opt.step()
    assert all(opt.state[p]["step"].is_cuda and float(opt.state[p]["step"]) == 2 for p in params)


def _flat_run(device: str, steps: int, remainders: bool = False):
    """bf16 parameters in MainParams' bucketed buffers, two groups, the update writing the bf16 copies; ``steps``
    steps of fixed gradients. Returns the fp32 main parameters, the bf16 copies and the optimizer. ``remainders``: the
    main parameters held as bf16 copy plus int16 remainder (``store_param_remainders``)."""
    from lightning_megatron.parallel.param_buffer.buffer import MainParams

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    main = MainParams(model.to(device), bucket_size=3 * 256 * 256,   # 4 matrices over 2 buckets, vectors apart
                      store_param_remainders=remainders)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = PrecisionAwareAdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    main.attach(opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        main.to_main()
        for p in model.parameters():   # gradients as views of the buffers, as the backward hook leaves them
            p.grad = main._grad_view(p).copy_(torch.randn(p.shape, generator=g).to(device))
        opt.step()
    return [main.main_param(p).detach().cpu() for p in model.parameters()], [p.detach().cpu() for p in
                                                                            model.parameters()], opt


def test_update_over_contiguous_buffers_equals_eager_and_writes_the_bf16_copies(measured):
    """The compiled update over MainParams' flat buckets (three flat tensors per step instead of eight) equals the
    eager CPU update within the compiled kernels' rounding (as above), and the bf16 copies it writes in the same pass
    are exactly the fp32 main parameters rounded."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gpu_main, gpu_bf16, _ = _flat_run("cuda", 4)
    cpu_main, cpu_bf16, _ = _flat_run("cpu", 4)
    worst = max(float((a - b).abs().max()) for a, b in zip(gpu_main, cpu_main))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    measured(param_abs=worst, graphs=graphs)
    assert worst <= 4 * 1e-2 * 2 ** -7, worst
    for main, copy in zip(gpu_main, gpu_bf16):
        assert copy.dtype == torch.bfloat16 and torch.equal(copy, main.to(torch.bfloat16))
    assert graphs <= 2, graphs   # one per group's list length, never one per step


def test_update_over_bf16_copies_and_remainders_equals_eager(measured):
    """``store_param_remainders``: the compiled update reads and writes the two halves (bf16 copy, int16 remainder)
    of each fp32 main parameter in its pass. It equals the eager CPU update within the compiled kernels' rounding (as
    above) and the compiled fp32-main-parameter update on the GPU; the bf16 copies are the main parameters' bf16
    halves, and no fp32 main parameter is kept between steps."""
    import torch._dynamo

    from lightning_megatron.optimizer.param_remainders import split_fp32

    torch._dynamo.reset()
    gpu_main, gpu_bf16, gpu_opt = _flat_run("cuda", 4, remainders=True)
    cpu_main, _, _ = _flat_run("cpu", 4, remainders=True)
    fp32_main, _, _ = _flat_run("cuda", 4)
    worst = max(float((a - b).abs().max()) for a, b in zip(gpu_main, cpu_main))
    against_fp32 = max(float((a - b).abs().max()) for a, b in zip(gpu_main, fp32_main))
    measured(param_abs=worst, against_fp32_main=against_fp32)
    assert worst <= 4 * 1e-2 * 2 ** -7, worst
    assert against_fp32 <= 4 * 1e-2 * 2 ** -7, against_fp32
    for main, copy in zip(gpu_main, gpu_bf16):
        assert copy.dtype == torch.bfloat16
        assert torch.equal(copy.view(torch.int16), split_fp32(main)[0].view(torch.int16))
    plan = next(iter(gpu_opt._plans.values()))
    assert plan.remainders is not None and all(r.dtype == torch.int16 and r.is_cuda for r in plan.remainders)
