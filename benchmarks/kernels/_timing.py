"""Timing helper shared by the single-kernel benchmarks (imported as a sibling module: run them as scripts)."""
from __future__ import annotations

from typing import Callable

import torch


def cuda_timed(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> float:
    """Mean milliseconds of ``fn()`` over ``iters`` calls after ``warmup`` calls, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
