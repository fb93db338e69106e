"""Run a function in N real processes (no mocking of torch.distributed): on CPU with gloo, or one GPU per process
with NCCL (tests/gpu).

On a CPU-only machine workers are forked from a fork server that imported torch, Lightning, the library and
``tests.parity`` once (:data:`PRELOAD`), so a worker starts in a fraction of a second instead of importing them again
(seconds of CPU per rank, most of a multi-rank test on a 2-core machine); each still starts from the server's
untouched state, never from the pytest process, and gets the test's environment as it was when the test called
:func:`run_distributed`.

Each worker gets torchrun-style environment variables (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK), so a
Lightning ``Trainer`` inside it joins as one rank of an externally launched job, exactly as under torchrun (with
``accelerator="gpu"`` Lightning puts rank ``LOCAL_RANK`` on ``cuda:LOCAL_RANK`` and uses NCCL); a worker that
starts its own group calls :func:`init_gloo` or :func:`init_nccl`. Return CPU tensors from workers.
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: modules the fork server imports once for every worker it forks
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_megatron", "tests.parity")


def _context() -> Any:
    """The ``forkserver`` context with :data:`PRELOAD` (takes effect when the server starts, at the first run); on a
    machine with CUDA the ``spawn`` context (a process forked after anything touched the CUDA driver cannot use it,
    and the GPU tier's runs are few) or where there is no fork server (Windows)."""
    if torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(rank: int, world_size: int, port: int, out_dir: str, environ: Dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)   # the caller's environment now, not the fork server's from its start
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        fn, args = torch.load(os.path.join(out_dir, "task.pt"), weights_only=False)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    # Skip interpreter teardown: gloo's background threads can abort a process that exits normally
    # ("terminate called without an active exception") after all its work is done.
    os._exit(0)


PORT_ERRORS = ("address already in use", "eaddrinuse", "errno 98")


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return each rank's result.

    A run that failed only because another job took the rendezvous port is retried once on a new port.
    """
    try:
        return _run_once(fn, world_size, args, timeout)
    except AssertionError as e:
        if not any(p in str(e).lower() for p in PORT_ERRORS):
            raise
        return _run_once(fn, world_size, args, timeout)


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> List[Any]:
    ctx = _context()
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        # the task travels as a file: tensors in a forkserver process's arguments would each take a file descriptor
        torch.save((fn, args), os.path.join(out_dir, "task.pt"))
        environ = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir, environ)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        errors = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                errors.append(f"rank {r}: timed out after {timeout}s")
            err = os.path.join(out_dir, f"{r}.err")
            if os.path.exists(err):
                errors.append(f"rank {r}:\n" + open(err).read())
            elif p.exitcode != 0 and not p.is_alive():
                errors.append(f"rank {r}: exit code {p.exitcode}")
        if errors:
            raise AssertionError("distributed workers failed:\n" + "\n".join(errors))
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def init_gloo(rank: int, world_size: int) -> None:
    """Start the default gloo process group from the worker's environment."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def init_nccl(rank: int, world_size: int) -> torch.device:
    """Start the default NCCL process group from the worker's environment on GPU ``LOCAL_RANK`` (made the current
    device and bound to the group); returns that device."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    return device


def run_each(rank: int, world: int, fn: Callable, cases: List[Tuple[str, tuple]]) -> Dict[str, Any]:
    """Worker for :func:`run_distributed`: ``fn(rank, world, *args)`` for each ``(name, args)`` of ``cases`` in turn,
    in this one process group (one spawn and import for all). A case that raises gives its traceback instead of a
    result and the others still run (every rank raises alike, so the ranks stay in step)."""
    out: Dict[str, Any] = {}
    for name, args in cases:
        try:
            out[name] = fn(rank, world, *args)
        except Exception:  # noqa: BLE001 - reported by the case's test
            out[name] = traceback.format_exc()
    return out
