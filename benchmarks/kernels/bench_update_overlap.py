"""Does the optimizer update, run on a second stream while the next step's forward runs, shorten a step on one GPU?

A stand-in for the 1.3B benchmark model's step (24 layers of bf16 GEMMs shaped as the model's: fused QKV, cuDNN
causal attention with 16 query / 8 KV heads, output projection, fused SwiGLU up-projection, down-projection; then a
real autograd backward through them) and the compiled update of the model's 1.26B parameters (bf16 parameters and
int16 remainders, bf16 moments: :func:`~lightning_megatron.optimizer.precision_aware_adamw.adamw_multi_update_`
compiled as the optimizer compiles it), one update call per layer. Arms, mean ms per step over the timed steps (CUDA
events on the compute stream, after warm-up steps so the GPU sits at its power limit as in training):

* ``serial``: forward, backward, then the update on the same stream (what a step does today);
* ``overlap``: the update on a second stream, started when the backward ends; layer ``i``'s forward of the next step
  waits for the event recorded after layer ``i``'s update (and the embedding's);
* ``overlap_hi``: the same with the second stream at high priority;
* ``update_only``: the update alone, the same stream (its cost inside the serial step).

    python benchmarks/kernels/bench_update_overlap.py [--steps 20] [--arms serial,overlap,overlap_hi,update_only]

An arm may be named more than once (each run is listed). Each arm's figure is printed as measured
(``ARM <name> <ms>``), then all as one JSON line.
"""
from __future__ import annotations

import argparse
import json
from typing import List

import torch
import torch.nn.functional as F

from lightning_megatron.optimizer.param_remainders import split_fp32
from lightning_megatron.optimizer.precision_aware_adamw import adamw_multi_update_

H, FFN, V, L, HEADS, GROUPS, SEQ, BATCH = 2048, 5632, 32000, 24, 16, 8, 2048, 4
D = H // HEADS
ARMS = ("serial", "overlap", "overlap_hi", "update_only")


class Layer(torch.nn.Module):
    """GEMMs and attention of one transformer layer (no norms: they are not what this measures)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(H, H + 2 * GROUPS * D, bias=False)
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.fc1 = torch.nn.Linear(H, 2 * FFN, bias=False)
        self.fc2 = torch.nn.Linear(FFN, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [s, b, h]
        s, b, _ = x.shape
        q, k, v = self.qkv(x).split([H, GROUPS * D, GROUPS * D], dim=-1)
        q = q.view(s, b, HEADS, D).permute(1, 2, 0, 3)
        k = k.view(s, b, GROUPS, D).permute(1, 2, 0, 3)
        v = v.view(s, b, GROUPS, D).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, H))
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H).to(dev, torch.bfloat16)
    layers = torch.nn.ModuleList(Layer() for _ in range(L)).to(dev, torch.bfloat16)
    head = torch.nn.Linear(H, V, bias=False).to(dev, torch.bfloat16)
    groups: List[List[torch.nn.Parameter]] = [list(emb.parameters())] + [list(m.parameters()) for m in layers]
    groups.append(list(head.parameters()))
    state = []
    for params in groups:
        grads = [torch.randn_like(q) * 1e-3 for q in params]
        rems = [split_fp32(q.detach().float())[1] for q in params]
        state.append(([q.data for q in params], grads, [torch.zeros_like(q) for q in params],
                      [torch.zeros_like(q) for q in params], [torch.ones((), device=dev) for _ in params], rems))
    lr = torch.full((), 1e-5, device=dev)
    update = torch.compile(adamw_multi_update_, dynamic=False, fullgraph=True,
                           options={"triton.autotune_pointwise": False})

    def run_update(events=None):
        for i, (params, grads, m, v, steps, rems) in enumerate(state):
            update(params, grads, m, v, steps, lr, 0.9, 0.95, 1e-8, 0.1, None, None, count_steps=False,
                   remainders=rems)
            if events is not None:
                events[i].record()

    tokens = torch.randint(0, V, (SEQ, BATCH), device=dev)
    labels = torch.randint(0, V, (SEQ * BATCH,), device=dev)

    def fwd_bwd(events=None):
        if events is not None:
            torch.cuda.current_stream().wait_event(events[0])
        x = emb(tokens)
        for i, layer in enumerate(layers):
            if events is not None:
                torch.cuda.current_stream().wait_event(events[i + 1])
            x = layer(x)
        if events is not None:
            torch.cuda.current_stream().wait_event(events[-1])
        loss = F.cross_entropy(head(x).view(-1, V).float(), labels)
        loss.backward()
        for q in (*emb.parameters(), *layers.parameters(), *head.parameters()):
            q.grad = None

    out = {}
    for name in args.arms.split(","):
        if name not in ARMS:
            p.error(f"unknown arm {name!r}: choose from {', '.join(ARMS)}")
        side = torch.cuda.Stream(priority=-1 if name == "overlap_hi" else 0)
        events = [torch.cuda.Event() for _ in state]

        def step():
            if name == "update_only":
                run_update()
            elif name == "serial":
                fwd_bwd()
                run_update()
            else:
                fwd_bwd(events)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    run_update(events)

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        torch.cuda.current_stream().wait_stream(side)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.steps
        out.setdefault(name, []).append(round(ms, 3))
        print(f"ARM {name} {ms:.3f}", flush=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
