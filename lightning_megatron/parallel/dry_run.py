"""Dry runs: one process plays one rank of a large job over torch's fake communication backend.

``MegatronStrategy(tp=4, pp=4, cp=2, dry_run=DryRun(world_size=64, rank=63))`` with ``Trainer(devices=1)`` builds
exactly the parameters, gradients and optimizer states rank 63 of a 64-GPU job holds, and runs its real forward,
backward and optimizer steps; every collective of the world (and of the mesh's groups) returns at once without moving
data (torch's ``FakeProcessGroup``: ``torch.testing._internal.distributed.fake_pg.FakeStore`` +
``init_process_group("fake")``, as torchtitan's ``COMM_MODE=fake_backend`` and Megatron-LM's
``--fake-process-group`` do). Memory and compute are real; communication time is absent.

What a fake collective "receives" is whatever the receiving buffer held: the input itself for in-place collectives
(all-reduce, broadcast), uninitialised memory for the others (all-gather into a new tensor, receives). The library
keeps a dry run meaningful where that matters:

- the pipeline's stages take static shapes (no metadata exchange) and fill their receive buffers once with small
  random values (:func:`lightning_megatron.parallel.pipeline.PipelineRunner`);
- the expert dispatcher assumes balanced routing: every expert-parallel peer sends each local expert the same share
  of its tokens x top-k (the counts it would receive; :mod:`lightning_megatron.moe.dispatcher`);
- the non-finite checks are off (a loss read from unfilled buffers means nothing).

Losses and gradient values are therefore meaningless; shapes, bytes and the work per step are a real rank's.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["DryRun", "init_fake_process_group", "is_fake_group", "FAKE_BACKEND"]

#: torch's fake communication backend (registered when ``torch.testing._internal.distributed.fake_pg`` loads)
FAKE_BACKEND = "fake"


@dataclass(frozen=True)
class DryRun:
    """Play rank ``rank`` of a job of ``world_size`` processes in this one process (fake collectives).

    Args:
        world_size: processes of the job played (``tp * pp * cp * dp``; dp follows from it as in a real run).
        rank: the global rank this process plays, ``0 <= rank < world_size``; the layout's rank order is the mesh's
            (tp fastest, then cp, dp, pp), so ``rank = world_size - 1`` is a rank of the last pipeline stage.
    """

    world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("world_size", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"DryRun({name}={value!r}): give an int")
        if self.world_size < 1:
            raise ValueError(f"DryRun(world_size={self.world_size}): the job needs at least 1 process")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DryRun(rank={self.rank}) is outside the job of world_size={self.world_size}: "
                             f"give 0 <= rank < {self.world_size}")


def init_fake_process_group(dry_run: DryRun, timeout: Optional[timedelta] = None) -> None:
    """Start the default process group on torch's fake backend as rank ``dry_run.rank`` of ``dry_run.world_size``.
    Every later ``new_group`` / ``DeviceMesh`` group is fake too. RuntimeError if a process group already exists."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a dry run starts its own (fake) process group, but one is already initialised in this "
                           "process: run the dry run in a fresh process")
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=dry_run.rank, world_size=dry_run.world_size,
                            **kwargs)


def is_fake_group(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group`` (default: the world) runs on the fake backend, i.e. this process is a dry run."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        return dist.get_backend(group) == FAKE_BACKEND
    except (RuntimeError, ValueError):
        return False
