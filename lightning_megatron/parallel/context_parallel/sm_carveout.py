"""Keeping cuBLAS's GEMMs off some SMs while an a2a exchange is in flight (experimental torch API, CUDA).

A GEMM launched next to a running NCCL kernel is sized for every SM; the SMs NCCL holds make its last wave
wait, so the two serialise instead of overlapping. Inside a window the GEMMs target ``n`` SMs fewer (torch's
``_set_sm_carveout_experimental``; no effect on non-cuBLAS kernels). ``delay_wgrad_compute``'s weight-gradient
GEMMs run in one, with ``n`` = ``ParallelConfig.cp_sm_carveout``: by default (None)
:data:`DELAYED_WGRAD_SM_CARVEOUT` on CUDA (measured on 2xH200: with it the option gained 0.7-0.9% over the plain
a2a backward, without it 0.3-0.7%); 0: no carveout. No communication happens here.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

DELAYED_WGRAD_SM_CARVEOUT = 16  # of H200's 132 SMs


def resolve_sm_carveout(sm_carveout: Optional[int]) -> Optional[int]:
    """The number of SMs a window leaves free: ``sm_carveout`` as given (0: none), or for None
    :data:`DELAYED_WGRAD_SM_CARVEOUT` where CUDA is available (on CPU there is no cuBLAS to configure)."""
    if sm_carveout is None:
        return DELAYED_WGRAD_SM_CARVEOUT if torch.cuda.is_available() else None
    return sm_carveout


@contextlib.contextmanager
def carveout_window(sm_carveout: Optional[int]) -> Iterator[None]:
    """GEMMs launched inside the ``with`` block leave :func:`resolve_sm_carveout` ``(sm_carveout)`` SMs free; None
    on CPU, 0, or a torch without the experimental API changes nothing. Restores the setting found on entry.

    Raises:
        ValueError: on CUDA, a carveout that leaves the current GPU no SM.
    """
    sm = resolve_sm_carveout(sm_carveout)
    if not sm or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if sm >= total:
            raise ValueError(f"cp_sm_carveout={sm} leaves no SM to the GEMMs: this GPU has {total}; choose fewer "
                             f"(default {DELAYED_WGRAD_SM_CARVEOUT}) or 0 for no carveout")
    saved = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sm)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(saved)
