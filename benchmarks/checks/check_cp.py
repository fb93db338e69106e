"""GPU numerics check of context-parallel attention (fused flash kernels, NCCL).

    torchrun --nproc_per_node=2 benchmarks/checks/check_cp.py      # prints one JSON line per check (rank 0)

1. Fused (flash and cuDNN) vs math block kernels on one GPU (bf16, GQA): ``_attention_block`` output/lse and
   ``_attention_block_backward`` gradients, square causal and full blocks.
2. cp = world size for each comm type and fused kernel against full causal attention (``F.scaled_dot_product_attention`` on
   the whole sequence, same bf16 inputs on every rank): outputs and q/k/v gradients of the local zigzag rows.

Errors are relative Frobenius norms; bf16 inputs, so ~1e-2 is the expected scale. ``ok`` uses 3e-2.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.parallel.context_parallel import context_parallel_attention, zigzag_split
from lightning_megatron.parallel.context_parallel.kernels import (
    _attention_block,
    _attention_block_backward,
    _math_attention_block,
)

TOL = 3e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def emit(rank: int, **kw) -> None:
    if rank == 0:
        print(json.dumps(kw), flush=True)


def check_blocks(rank: int, device: torch.device) -> None:
    for kernel in ("flash", "cudnn"):
        try:
            check_blocks_with(rank, device, kernel)
        except RuntimeError as e:  # a kernel this build/GPU lacks: say so, keep checking the rest
            emit(rank, check=f"fused-vs-math-{kernel}", error=str(e).splitlines()[0][:300], ok=False)


def check_blocks_with(rank: int, device: torch.device, kernel: str) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    b, nq, nkv, s, d = 1, 16, 8, 1024, 128
    for mask in ("causal", "full"):
        q = torch.randn(b, nq, s, d, device=device, generator=g).bfloat16()
        k = torch.randn(b, nkv, s, d, device=device, generator=g).bfloat16()
        v = torch.randn(b, nkv, s, d, device=device, generator=g).bfloat16()
        dout = torch.randn(b, nq, s, d, device=device, generator=g).bfloat16()
        scale = d ** -0.5
        out_f, lse_f = _attention_block(q, k, v, mask, scale, kernel)
        out_m, lse_m = _math_attention_block(q, k, v, mask, scale)
        delta = (dout.float() * out_m).sum(-1)
        grads_f = _attention_block_backward(q, k, v, dout, out_f, lse_f, delta, mask, scale, kernel)
        grads_m = _attention_block_backward(q.float(), k.float(), v.float(), dout.float(), out_m, lse_m, delta,
                                            mask, scale)
        errs = dict(out=rel(out_f, out_m), lse=rel(lse_f, lse_m),
                    **{f"d{n}": rel(gf, gm) for n, gf, gm in zip("qkv", grads_f, grads_m)})
        emit(rank, check=f"fused-{kernel}-vs-math-{mask}", fused_dtype=str(out_f.dtype), errors=errs,
             ok=all(e < TOL for e in errs.values()))


def check_cp(rank: int, world: int, device: torch.device) -> None:
    for kernel in ("flash", "cudnn"):
        try:
            check_cp_with(rank, world, device, kernel)
        except RuntimeError as e:
            emit(rank, check=f"cp{world}-{kernel}", error=str(e).splitlines()[0][:300], ok=False)


def check_cp_with(rank: int, world: int, device: torch.device, kernel: str) -> None:
    g = torch.Generator(device=device).manual_seed(1)
    b, nq, nkv, s, d = 1, 16, 8, 4096, 128
    q = torch.randn(b, nq, s, d, device=device, generator=g).bfloat16().requires_grad_()
    k = torch.randn(b, nkv, s, d, device=device, generator=g).bfloat16().requires_grad_()
    v = torch.randn(b, nkv, s, d, device=device, generator=g).bfloat16().requires_grad_()
    dout = torch.randn(b, nq, s, d, device=device, generator=g).bfloat16()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    split = lambda t: zigzag_split(t.detach(), world, rank, 2)  # noqa: E731
    for comm in ("p2p", "all_gather", "a2a"):
        ql, kl, vl = (split(t).requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, group=dist.group.WORLD, comm_type=comm, causal=True,
                                         attention_kernel=kernel)
        out.backward(split(dout))
        errs = dict(out=rel(out, split(ref)), dq=rel(ql.grad, split(q.grad)), dk=rel(kl.grad, split(k.grad)),
                    dv=rel(vl.grad, split(v.grad)))
        worst = torch.tensor(max(errs.values()), device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        emit(rank, check=f"cp{world}-{comm}-{kernel}-vs-full-sdpa", seq=s, errors_rank0=errs,
             worst_over_ranks=float(worst), ok=float(worst) < TOL)


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:  # a CPU smoke test of the script (math path only)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_blocks(rank, device)
    check_cp(rank, world, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
