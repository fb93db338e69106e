"""Keeping cuBLAS's GEMMs off some SMs while an a2a exchange is in flight (experimental, CUDA).

A GEMM launched next to a running NCCL kernel is sized for every SM; the SMs NCCL holds make its last wave
wait, so the two serialise instead of overlapping. ``LIGHTNING_MEGATRON_CP_SM_CARVEOUT=n`` makes the GEMMs
launched inside a window target ``n`` SMs fewer (torch's ``_set_sm_carveout_experimental``; no effect on CPU or
on non-cuBLAS kernels). Used by the a2a exchanges' overlapped work: ``overlap_cp_a2a``'s own-head projections
and ``delay_wgrad_compute``'s weight-gradient GEMMs. No communication happens here.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

SM_CARVEOUT_ENV = "LIGHTNING_MEGATRON_CP_SM_CARVEOUT"


def sm_carveout_from_env() -> Optional[int]:
    """``LIGHTNING_MEGATRON_CP_SM_CARVEOUT`` as a number of SMs (unset or empty: None)."""
    raw = os.environ.get(SM_CARVEOUT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{SM_CARVEOUT_ENV}={raw!r}: expected a number of SMs (0 or more), or unset")
    return int(raw)


class CarveoutWindow:
    """Opened when an exchange is launched and closed before it is waited for: GEMMs launched in between
    leave :attr:`sm` SMs free (None: the window does nothing). Restores the setting found at opening."""

    def __init__(self, sm: Optional[int]) -> None:
        self.sm, self._saved, self._open = sm, None, False

    def open(self) -> None:
        if self.sm is not None and not self._open:
            self._saved, self._open = torch._C._get_sm_carveout_experimental(), True
            torch._C._set_sm_carveout_experimental(self.sm)

    def close(self) -> None:
        if self._open:
            torch._C._set_sm_carveout_experimental(self._saved)
            self._open = False


@contextlib.contextmanager
def carveout_window() -> Iterator[None]:
    """A :class:`CarveoutWindow` with the environment's setting, open for the ``with`` block."""
    window = CarveoutWindow(sm_carveout_from_env())
    window.open()
    try:
        yield
    finally:
        window.close()
