"""Bandwidth of the transfers a cp=2 ring step makes, on NCCL between 2 GPUs.

    torchrun --nproc_per_node=2 benchmarks/probe_nccl_p2p.py      # one JSON line per case (rank 0)

Cases, per MiB size: ``sendrecv`` (batch_isend_irecv to the next rank and from the previous: the ring shift),
``all_gather`` (all_gather_into_tensor of the same tensor: at cp=2 the same exchange) and ``reduce_scatter``
(reduce_scatter_tensor, the cp=2 return of dK/dV). GB/s counts the bytes one rank receives.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from _timing import cuda_timed  # sibling module (run as a script)


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for mib in (16, 32, 64):
        x = torch.randn(mib * 2**19, device="cuda", dtype=torch.bfloat16)  # mib MiB of bf16
        recv = torch.empty_like(x)
        gathered = torch.empty(world * x.numel(), device="cuda", dtype=x.dtype)
        big = torch.randn(world * x.numel(), device="cuda", dtype=x.dtype)

        def sendrecv():
            ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, recv, prv)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()

        cases = {"sendrecv": sendrecv,
                 "all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(recv, big)}
        for name, fn in cases.items():
            ms = cuda_timed(fn, iters=20)
            if rank == 0:
                received = mib * 2**20 * (1 if name == "sendrecv" else world - 1)
                gbs = received / ms / 1e6
                print(json.dumps(dict(case=name, mib=mib, ms=round(ms, 4), recv_gb_s=round(gbs, 1))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
