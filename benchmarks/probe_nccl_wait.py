"""Does waiting on an NCCL operation block the host? For each way of issuing a 24 MiB exchange between 2 GPUs,
queue ~30 ms of GEMMs, issue the exchange, ``wait()`` on it, and report the host time the issue and the wait took
and whether the GEMMs had already finished when ``wait()`` returned (``blocked``: the host waited for the device).

    torchrun --nproc_per_node=2 benchmarks/probe_nccl_wait.py      # one JSON line per case (rank 0)
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    peer = 1 - rank
    x = torch.randn(12 * 2**20, device="cuda", dtype=torch.bfloat16)  # 24 MiB
    recv = torch.empty_like(x)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def batched():
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, recv, peer)]
        return dist.batch_isend_irecv(ops)

    def sync_all_to_all():  # no work to wait on: the call itself orders the current stream after the transfer
        dist.all_to_all_single(recv, x)
        return []

    cases = {
        "batch_isend_irecv": batched,
        "all_to_all_single_async": lambda: [dist.all_to_all_single(recv, x, async_op=True)],
        "all_reduce_async": lambda: [dist.all_reduce(x, async_op=True)],
        "all_to_all_single_sync": sync_all_to_all,
    }
    for name, issue in cases.items():
        for it in range(4):
            dist.barrier()
            torch.cuda.synchronize()
            b = a
            for _ in range(20):  # ~30 ms of device work queued ahead
                b = a @ b * 1e-4
            gemms_done = torch.cuda.Event()
            gemms_done.record()
            t0 = time.perf_counter()
            works = issue()
            t1 = time.perf_counter()
            for w in works:
                w.wait()
            t2 = time.perf_counter()
            blocked = gemms_done.query()
            torch.cuda.synchronize()
            if rank == 0 and it == 3:
                print(json.dumps(dict(case=name, issue_ms=round((t1 - t0) * 1e3, 3), wait_ms=round((t2 - t1) * 1e3, 3),
                                      blocked=bool(blocked))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
