"""Tensor-parallel-aware random number generation (Megatron's seeds).

Megatron keeps two streams per process: the default one, identical across the TP group (so dropout on
replicated activations drops the same elements on every TP rank), and a tensor-parallel one, different
per TP rank, used inside TP regions (attention dropout on split heads; everything between the SP
all-gather and reduce-scatter under sequence parallelism). Seeds: default ``seed + 100*pp_rank``,
tensor-parallel ``seed + 2718 + tp_rank``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100


def default_seed(seed: int, pp_rank: int) -> int:
    """Seed of the default stream (shared by the TP group)."""
    return seed + PP_SEED_STRIDE * pp_rank


def tensor_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0) -> int:
    """Seed of the per-TP-rank stream."""
    return default_seed(seed, pp_rank) + TP_SEED_OFFSET + tp_rank


class TensorParallelRNG:
    """A separate RNG stream for one device, entered with :meth:`fork` around TP-region randomness.

    Args:
        seed: seed of this rank's tensor-parallel stream (see :func:`tensor_parallel_seed`).
        device: the device whose default generator is swapped (``cpu`` or a CUDA device).
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.seed = seed
        self._state = self._seeded_state(seed)

    def _get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _seeded_state(self, seed: int) -> torch.Tensor:
        saved = self._get_state()
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        state = self._get_state()
        self._set_state(saved)
        return state

    def get_state(self) -> torch.Tensor:
        """This stream's current state (a new tensor each time the stream is used; safe to keep as a snapshot).
        Activation recompute keeps one per checkpointed region and replays the region from it."""
        return self._state

    def set_state(self, state: torch.Tensor) -> None:
        """Continue this stream from ``state`` (one :meth:`get_state` returned)."""
        self._state = state

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on this stream; the default stream is left exactly as it was."""
        saved = self._get_state()
        self._set_state(self._state)
        try:
            yield
        finally:
            self._state = self._get_state()
            self._set_state(saved)


def seed_rank_streams(seed: int, tp_rank: int, pp_rank: int, device: torch.device) -> TensorParallelRNG:
    """Seed this rank's default stream (:func:`default_seed`: shared by its TP group, different per pipeline stage)
    and return its tensor-parallel stream (:func:`tensor_parallel_seed`), Megatron's seeding of a rank."""
    torch.manual_seed(default_seed(seed, pp_rank))
    return TensorParallelRNG(tensor_parallel_seed(seed, tp_rank, pp_rank), device)
