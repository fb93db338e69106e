"""Quick-start loop without the Lightning Trainer: the library's pieces in a plain PyTorch loop.

    torchrun --nproc_per_node=2 examples/run_simple_train_loop.py            # tp=2, CPU (gloo) or GPUs (nccl)
    torchrun --nproc_per_node=4 examples/run_simple_train_loop.py --tp 2      # tp=2 x dp=2

Builds the process grid (:class:`ParallelMesh`), a tiny GPT on the meta device, and drives the same run object the
Lightning strategy drives, :class:`ParallelRun`: ``parallelize`` (tensor + sequence parallelism, materialisation and
layout-independent initialisation; the parameters and gradients in the contiguous buffer that reduces them over the
dp x cp group; the gradient finaliser), ``prepare_data_parallel`` and ``shard_optimizers`` (the replicas equal, the
post-step hook of the buffer), then per step ``start_step`` and ``finalize`` (the once-per-step reductions). Trains a
few steps on mock data (the same batch on TP peers, different ones across data-parallel ranks) and prints the loss,
the same on every rank.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from lightning_megatron import GPTConfig, GPTModel, ParallelConfig, ParallelMesh, ParallelRun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: all processes)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=4)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    tp = args.tp or world
    mesh = ParallelMesh(ParallelConfig(tp=tp, sequence_parallel=tp > 1), device.type)

    config = GPTConfig.tiny(seq_length=64, vocab_size=1000)
    mesh.config.validate_model(config)
    seed = 1234
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPTModel(config)
    # the same weights at any layout, held in the buffer that averages the gradients over dp x cp
    run = ParallelRun(mesh, device)
    run.parallelize(model, seed=seed)
    run.prepare_data_parallel(model)   # the data-parallel replicas made equal
    # after each step the buffer starts the next one afresh (and the distributed optimizer's shards, if asked for)
    optimizer, = run.shard_optimizers([torch.optim.AdamW(model.parameters(), lr=1e-3)], model)

    # Mock data: a fixed stream of batches, sharded by data-parallel rank (TP peers read the same one).
    gen = torch.Generator().manual_seed(0)
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (dp, args.micro_batch_size, config.seq_length + 1), generator=gen)
        ids = ids[dp_rank].to(device)
        run.start_step(1)   # one micro-batch: the buffer's buckets reduce in the backward as they complete
        loss = model(ids[:, :-1], None, ids[:, 1:]).mean()
        loss.backward()
        run.finalize()   # the step's reductions (dp x cp, SP parameters over tp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        shown = loss.detach().clone()
        dist.all_reduce(shown, group=mesh.group("dp_cp"))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {shown.item() / mesh.size('dp_cp'):.4f}", flush=True)
    if dist.get_rank() == 0:
        print(f"done: {mesh}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
