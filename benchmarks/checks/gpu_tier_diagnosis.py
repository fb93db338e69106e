"""One GPU, about a minute: the two causes behind the GPU tier's failures at 6af3812 (benchmarks/RESULTS.md,
"GPU test tier").

A. Inductor's CUDA lowering of ``torch._scaled_mm`` with a scale that is a view at a storage offset of a graph input
   (``scales[0, 0]`` of a ``[2, 3]`` tensor) against scales that are 0-d tensors of their own: prints OK (and the
   largest difference to eager) or the lowering error.
B. Recompute against none on the recompute test's model (``tests/gpu/test_recompute_memory.py``), per SDPA backend
   (default, math, flash, cuDNN, memory-efficient): loss difference, largest gradient difference, worst relative
   Frobenius difference and the number of differing gradient elements, with two runs without recompute first (the
   kernels' own run-to-run spread).

    PYTHONPATH=$PWD python3 benchmarks/checks/gpu_tier_diagnosis.py
"""
import sys, time, traceback
sys.path.insert(0, ".")
import torch

def section(name): print(f"\n===== {name}", flush=True)

section("A scaled_mm lowering")
dev = "cuda"
a = (torch.randn(256, 512, device=dev)).to(torch.float8_e4m3fn)
b = (torch.randn(384, 512, device=dev)).to(torch.float8_e4m3fn).t()
scales = torch.rand(2, 3, device=dev) + 0.5
own0, own1 = scales[0, 0].clone(), scales[1, 1].clone()
def mm_view(a, b, s): return torch._scaled_mm(a, b, scale_a=s[0, 0], scale_b=s[1, 1], out_dtype=torch.bfloat16)
def mm_own(a, b, s0, s1): return torch._scaled_mm(a, b, scale_a=s0, scale_b=s1, out_dtype=torch.bfloat16)
for name, fn, args in (("view-of-input", mm_view, (a, b, scales)), ("own-tensors", mm_own, (a, b, own0, own1))):
    torch._dynamo.reset()
    try:
        ref = fn(*args)
        got = torch.compile(fn)(*args)
        print(name, "OK max diff", float((got.float() - ref.float()).abs().max()), flush=True)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:1200], flush=True)

section("B recompute vs none")
from torch.nn.attention import SDPBackend, sdpa_kernel
import tests.gpu.test_recompute_memory as rm
def cmp(x, y):
    worst_abs = max(float((a - b).abs().max()) for a, b in zip(x["grads"], y["grads"]))
    worst_rel = max(float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(x["grads"], y["grads"]))
    n_diff = sum(int((a != b).sum()) for a, b in zip(x["grads"], y["grads"]))
    return f"loss diff {float((x['loss'] - y['loss']).abs()):.3e} grad max abs {worst_abs:.3e} worst rel fro {worst_rel:.3e} elements differing {n_diff}"
for backend in ("default", "math", "flash", "cudnn", "efficient"):
    try:
        ctx = {"default": None, "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
        def step(mode):
            if ctx is None:
                return rm._step(mode)
            with sdpa_kernel([ctx]):
                return rm._step(mode)
        t = time.time()
        base = step(None); again = step(None)
        print(backend, "none vs none:", cmp(again, base), flush=True)
        for name, mode in rm.MODES.items():
            if mode:
                print(backend, name, "vs none:", cmp(step(mode), base), flush=True)
        print(backend, "took", round(time.time() - t, 1), flush=True)
    except Exception as e:
        print(backend, "FAILED", type(e).__name__, str(e)[:500], flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    rm._step(None)
names = sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in ("flash", "fmha", "cudnn", "attention", "sdpa"))})
print("attention kernels (default):", names[:10])
