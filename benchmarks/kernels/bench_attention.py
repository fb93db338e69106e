"""Forward+backward time of one attention call on one GPU: SDPA per backend against the ring's block kernels.

    python benchmarks/kernels/bench_attention.py      # one JSON line per case

Shapes of the 1.3B benchmark model (16 query heads, 8 KV heads, head dim 128), bf16, batch 1:
- ``sdpa-<backend>``: ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on the whole sequence
  (what the model runs at cp=1), forced to one backend;
- ``ring-<kernel>``: the blocks one cp=2 rank computes for the same sequence (a causal block of s/2 and a full
  block of s/4 x s/2, forward and backward through the ring's fused kernel), i.e. half the causal work.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_megatron.parallel.context_parallel.kernels import _FUSED

from _timing import cuda_timed  # sibling module (run as a script)


def main() -> None:
    dev = torch.device("cuda")
    nq, nkv, d = 16, 8, 128
    for s in (4096, 16384):
        q = torch.randn(1, nq, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, nkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, nkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(1, nq, s, d, device=dev, dtype=torch.bfloat16)
        causal_flops = 2 * 2 * nq * d * s * s / 2 * 3.5  # fwd (2 GEMMs) + bwd (~2.5x), causal half
        for name, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def step():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.backward(dout)

            try:
                if backend is None:
                    ms = cuda_timed(step)
                else:
                    with sdpa_kernel([backend]):
                        ms = cuda_timed(step)
                print(json.dumps(dict(case=f"sdpa-{name}", seq=s, ms=round(ms, 3),
                                      tflops=round(causal_flops / ms / 1e9, 1))), flush=True)
            except RuntimeError as e:
                print(json.dumps(dict(case=f"sdpa-{name}", seq=s, error=str(e).splitlines()[0][:200])), flush=True)
        h, c = s // 2, s // 4  # cp=2: local tokens s/2 = two chunks of s/4
        ql, kl, vl, dl = q.detach()[:, :, :h], k.detach()[:, :, :h], v.detach()[:, :, :h], dout[:, :, :h]
        for kernel, (fwd, bwd) in _FUSED.items():
            def ring_step():
                o0, l0 = fwd(ql, kl, vl, True, d ** -0.5)
                o1, l1 = fwd(ql[:, :, c:], kl, vl, False, d ** -0.5)
                bwd(ql, kl, vl, dl, o0, l0, True, d ** -0.5)
                bwd(ql[:, :, c:], kl, vl, dl[:, :, c:], o1, l1, False, d ** -0.5)

            try:
                ms = cuda_timed(ring_step)
                print(json.dumps(dict(case=f"ring-{kernel}-cp2-rank-blocks", seq=s, ms=round(ms, 3),
                                      tflops=round(causal_flops / 2 / ms / 1e9, 1))), flush=True)
            except RuntimeError as e:
                print(json.dumps(dict(case=f"ring-{kernel}", seq=s, error=str(e).splitlines()[0][:200])), flush=True)


if __name__ == "__main__":
    main()
