"""What the fused attention kernels accept, and how fast: native GQA (K/V with fewer heads than Q) and strided
inputs (the model's ``[s, b, n, d]`` activations viewed as ``[b, n, s, d]``), forward and backward, flash and cuDNN.

    python benchmarks/probe_cp_kernels.py      # one JSON line per case (1 GPU)

Each case is compared with the same kernel on contiguous inputs with K/V heads repeated to the query heads (what
the ring does when a kernel lacks native GQA): relative Frobenius errors of out, lse, dq, dk, dv, and
forward+backward time. Shapes: the cp=2 ring blocks of the 1.3B benchmark model at seq 16384 (16 query / 8 KV
heads, head dim 128, a causal block of 8192 and a full block of 4096 x 8192).
"""
from __future__ import annotations

import json

import torch


from _timing import cuda_timed  # sibling module (run as a script)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, n_kv, s, d] -> [b, n_kv*groups, s, d]`` (query head ``i`` uses kv head ``i // groups``)."""
    return t.repeat_interleave(groups, dim=1)


def _fold_kv_grad(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`_repeat_kv` for gradients: sum over each kv head's query-head group."""
    b, n, s, d = t.shape
    return t.reshape(b, n // groups, groups, s, d).sum(2)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def fwd(kernel, q, k, v, causal, scale):
    if kernel == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], r[1]
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1].reshape(r[1].shape[:3])


def bwd(kernel, q, k, v, dout, out, lse, causal, scale):
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty, scale=scale)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1), empty, empty, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t [b, n, s, d]`` laid out as the model's ``[s, b, n, d]`` (a permuted view)."""
    return t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    nq, nkv, d, s = 16, 8, 128, 8192
    scale = d ** -0.5
    for kernel in ("cudnn", "flash"):
        for causal, sq, sk in ((True, s, s), (False, s // 2, s)):
            q = torch.randn(1, nq, sq, d, device=dev, generator=g).bfloat16()
            k = torch.randn(1, nkv, sk, d, device=dev, generator=g).bfloat16()
            v = torch.randn(1, nkv, sk, d, device=dev, generator=g).bfloat16()
            dout = torch.randn(1, nq, sq, d, device=dev, generator=g).bfloat16()
            kr, vr = _repeat_kv(k, 2).contiguous(), _repeat_kv(v, 2).contiguous()
            out, lse = fwd(kernel, q, kr, vr, causal, scale)
            ref = (out, lse) + tuple(bwd(kernel, q, kr, vr, dout, out, lse, causal, scale)[:3])
            ref = ref[:3] + (_fold_kv_grad(ref[3], 2), _fold_kv_grad(ref[4], 2))

            def repeated():
                kk, vv = _repeat_kv(k, 2).contiguous(), _repeat_kv(v, 2).contiguous()
                o, l = fwd(kernel, q, kk, vv, causal, scale)
                gq, gk, gv = bwd(kernel, q, kk, vv, dout, o, l, causal, scale)[:3]
                return _fold_kv_grad(gk, 2), _fold_kv_grad(gv, 2)

            name = f"{kernel}-{'causal' if causal else 'full'}-{sq}x{sk}"
            print(json.dumps(dict(case=f"{name}-repeated", ms=round(cuda_timed(repeated), 3))), flush=True)
            variants = {
                "gqa": (q, k, v, dout),
                "strided": (strided(q), strided(kr), strided(vr), strided(dout)),
                "gqa-strided": (strided(q), strided(k), strided(v), strided(dout)),
            }
            for vname, (qq, kk, vv, dd) in variants.items():
                try:
                    o, l = fwd(kernel, qq, kk, vv, causal, scale)
                    gq, gk, gv = bwd(kernel, qq, kk, vv, dd, o, l, causal, scale)[:3]
                    if gk.shape[1] != nkv:
                        gk, gv = _fold_kv_grad(gk, 2), _fold_kv_grad(gv, 2)
                    errs = {n: rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), (o, l, gq, gk, gv), ref)}
                    ms = cuda_timed(lambda: bwd(kernel, qq, kk, vv, dd, *fwd(kernel, qq, kk, vv, causal, scale), causal,
                                           scale))
                    print(json.dumps(dict(case=f"{name}-{vname}", ms=round(ms, 3), errors=errs,
                                          out_strides=list(o.stride()), dq_strides=list(gq.stride()),
                                          dk_shape=list(gk.shape), ok=all(e < 2e-2 for e in errs.values()))),
                          flush=True)
                except RuntimeError as e:
                    print(json.dumps(dict(case=f"{name}-{vname}", error=str(e).splitlines()[0][:300])), flush=True)


if __name__ == "__main__":
    main()
