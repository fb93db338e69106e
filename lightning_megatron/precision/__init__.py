"""Precision: :class:`MegatronPrecision`, the Lightning precision plugin (bf16 / fp16 semantics, Megatron's bf16
parameters, FP8), and the FP8 GEMMs it applies (:mod:`lightning_megatron.precision.fp8`: the torch-native backend
on ``torch._scaled_mm`` and the Transformer Engine backend). The package owns precision end to end: the plugin's
two entry points (:meth:`MegatronPrecision.param_precision`, :meth:`MegatronPrecision.parallelize_step`), the FP8
step of ``parallelize`` and its handle (end-of-step hook, checkpoint state).

The names are imported on first use (PEP 562)."""
from __future__ import annotations

from typing import Dict, List

from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS: Dict[str, str] = {
    "MegatronPrecision": "lightning_megatron.precision.plugin",
    "PRECISIONS": "lightning_megatron.precision.plugin",
    "ParamPrecision": "lightning_megatron.precision.plugin",
}
__all__: List[str] = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
