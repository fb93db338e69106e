"""Keeping cuBLAS's GEMMs off some SMs while an a2a exchange is in flight (experimental torch API, CUDA).

A GEMM launched next to a running NCCL kernel is sized for every SM; the SMs NCCL holds make its last wave
wait, so the two serialise instead of overlapping. Inside a window the GEMMs target ``n`` SMs fewer (torch's
``_set_sm_carveout_experimental``; no effect on non-cuBLAS kernels). ``delay_wgrad_compute``'s weight-gradient
GEMMs run in one, with ``n`` = :data:`DELAYED_WGRAD_SM_CARVEOUT` on CUDA (measured on 2xH200: with it the option
gained 0.7-0.9% over the plain a2a backward, without it 0.3-0.7%); ``LIGHTNING_MEGATRON_CP_SM_CARVEOUT=n`` sets
another ``n`` (0: no carveout). No communication happens here.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

SM_CARVEOUT_ENV = "LIGHTNING_MEGATRON_CP_SM_CARVEOUT"
DELAYED_WGRAD_SM_CARVEOUT = 16  # of H200's 132 SMs


def sm_carveout_from_env(default: Optional[int] = None) -> Optional[int]:
    """``LIGHTNING_MEGATRON_CP_SM_CARVEOUT`` as a number of SMs (unset or empty: ``default``)."""
    raw = os.environ.get(SM_CARVEOUT_ENV, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{SM_CARVEOUT_ENV}={raw!r}: expected a number of SMs (0 or more), or unset")
    return int(raw)


@contextlib.contextmanager
def carveout_window(default: Optional[int] = None) -> Iterator[None]:
    """GEMMs launched inside the ``with`` block leave SMs free: the environment's number, else ``default`` where
    CUDA is available (on CPU there is no cuBLAS to configure); None or 0, or a torch without the experimental
    API, changes nothing. Restores the setting found on entry."""
    sm = sm_carveout_from_env(default if torch.cuda.is_available() else None)
    if not sm or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    saved = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sm)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(saved)
