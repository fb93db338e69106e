"""Step time and a kernel profile of the 1.3B benchmark model in a plain loop (no Trainer), tp=1 or tp=2.

  python benchmarks/profile_tp.py                      # tp=1
  torchrun --nproc_per_node=2 benchmarks/profile_tp.py --sp
Prints the mean step time over 10 steps and (with --profile) the top CUDA kernels of 2 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from lightning_megatron import GPTConfig, GPTModel, ParallelConfig, ParallelMesh, apply_tp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--mbs", type=int, default=4)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(rank)
    cfg = GPTConfig.llama_1b_bench()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPTModel(cfg)
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        mesh = ParallelMesh(ParallelConfig(tp=world, sequence_parallel=a.sp), "cuda")
        apply_tp(model, mesh.group("tp"), a.sp)
    model.to_empty(device="cuda")
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)

    def step():
        ids = torch.randint(0, cfg.vocab_size, (a.mbs, cfg.seq_length + 1), device="cuda", generator=g)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(ids[:, :-1], None, ids[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 10 * 1e3
    if rank == 0:
        print(json.dumps(dict(name=f"loop-tp{world}{'-sp' if a.sp else ''}", step_ms=round(ms, 1),
                              peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))), flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
