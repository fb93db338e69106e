"""A device scalar's value on the host without waiting for the device: for what only needs to be shown (the progress
bar's loss), where reading the tensor (``float(t)``, Lightning's progress-bar conversion) would make the host wait for
the whole step queued ahead of it, and the GPU then wait for the host's work between steps."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["LaggedHostValue"]


class LaggedHostValue:
    """The newest value of a stream of 0-d tensors that has already reached the host.

    :meth:`send` queues a copy of a CUDA value into pinned host memory (two landing buffers, used in turn) behind the
    work that produces it, and returns the newest value whose copy has landed (``torch.cuda.Event.query``: no wait),
    or the one returned before (None until a first copy lands). When both buffers are still in flight (the GPU more
    than a step behind) the new value is not sent. A CPU value is returned as it is. No communication.
    """

    def __init__(self) -> None:
        self._buffers: List[Tensor] = []
        self._in_flight: List[Tuple[int, torch.cuda.Event]] = []   # (buffer index, its copy's event), oldest first
        self._last: Optional[float] = None

    def __getstate__(self) -> dict:
        """Copies and pickles start empty (pinned buffers and CUDA events are this process's)."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def send(self, value: Tensor) -> Optional[float]:
        """Queue ``value`` (a 0-d tensor) for the host; the newest value known there (see the class docstring)."""
        value = value.detach().reshape(())
        if not value.is_cuda:
            self._last = float(value)
            return self._last
        while self._in_flight and self._in_flight[0][1].query():
            index, _ = self._in_flight.pop(0)
            self._last = float(self._buffers[index])
        if not self._buffers:
            self._buffers = [torch.empty((), dtype=torch.float32, pin_memory=True) for _ in range(2)]
        busy = {index for index, _ in self._in_flight}
        free = [index for index in range(len(self._buffers)) if index not in busy]
        if free:
            self._buffers[free[0]].copy_(value.float(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(value.device))
            self._in_flight.append((free[0], event))
        return self._last
