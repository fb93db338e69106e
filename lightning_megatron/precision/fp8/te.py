"""The Transformer Engine backend: TE's import (only when asked for), its recipe objects, a layer's local GEMM
through ``te.Linear`` and TE's autocast context."""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from lightning_megatron.utils.optional import TRANSFORMER_ENGINE

log = logging.getLogger(__name__)

TE_INSTALL_HINT = (
    "install Transformer Engine for your CUDA and torch (`pip install --no-build-isolation "
    "transformer_engine[pytorch]`, see https://github.com/NVIDIA/TransformerEngine#installation; this "
    "repository's GPU machines: shared/te/README.md), or use fp8_backend='torch' (torch._scaled_mm)"
)

def import_transformer_engine() -> Any:
    """``transformer_engine.pytorch`` (imported here, only when asked for); ImportError saying how to install."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
    except ImportError as e:
        raise ImportError(f"fp8_backend='te' needs Transformer Engine, which is not importable here ({e}): "
                          f"{TE_INSTALL_HINT}") from e
    return te


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` imports here (it is imported: call only where it would be used). A
    broken installation (e.g. its library not loadable) counts as unavailable; the reason is logged."""
    if not TRANSFORMER_ENGINE:   # not installed (lightning_utilities RequirementCache)
        return False
    try:
        import_transformer_engine()
    except (ImportError, OSError, RuntimeError) as e:
        log.warning("fp8_backend='auto': Transformer Engine is installed but does not import (%s); using the torch "
                    "backend", e)
        return False
    return True


def transformer_engine_recipe(config: Any) -> Any:
    """The Transformer Engine recipe object of ``config`` (a :class:`~lightning_megatron.precision.fp8.Float8Config`;
    imports ``transformer_engine``)."""
    import_transformer_engine()
    from transformer_engine.common import recipe as te_recipe

    fmt = te_recipe.Format.HYBRID if config.fp8_format == "hybrid" else te_recipe.Format.E4M3
    if config.recipe == "delayed":
        return te_recipe.DelayedScaling(fp8_format=fmt, margin=config.margin,
                                        amax_history_len=config.amax_history_len,
                                        amax_compute_algo=config.amax_compute_algo)
    if config.recipe == "tensorwise":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if config.recipe == "mxfp8":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0):
            cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
            raise ValueError(f"fp8_recipe='mxfp8' needs a GPU with compute capability >= 10.0 (Blackwell); this one "
                             f"has {cap}; use fp8_recipe='delayed' or 'tensorwise'")
        return te_recipe.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"fp8_recipe={config.recipe!r} has no Transformer Engine recipe")


class TransformerEngineGemm:
    """A layer's local GEMM through Transformer Engine's ``te.Linear`` (no bias, ``parallel_mode=None``: the
    layer's own tensor-parallel communication stays around it), which uses the layer's weight parameter.
    Runs in FP8 inside TE's autocast (the precision plugin's forward context).

    Under ``MegatronStrategy(compile=True)`` the call is left out of the compiled graph (``torch.compiler.disable``):
    dynamo cannot trace TE's modules (torch 2.11 fails guarding them), so a compiled layer runs its norms, rotary
    embedding, attention and activation as compiled graphs between TE's own FP8 GEMMs."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features
        self._linear: Optional[nn.Module] = None

    @torch.compiler.disable
    def __call__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        if self._linear is None:
            te = import_transformer_engine()
            self._linear = te.Linear(self.in_features, self.out_features, bias=False, params_dtype=weight.dtype,
                                     device=weight.device)
        if self._linear.weight is not weight:
            self._linear.weight = weight   # the layer's parameter (materialisation replaces it once)
        y = self._linear(x)
        return y + bias.to(y.dtype) if bias is not None else y


def transformer_engine_context(config: Any, amax_group: Any = None) -> Callable[[], ContextManager]:
    """Context factory entering Transformer Engine's autocast with ``config``'s recipe (a ``Float8Config``), amaxes
    reduced over ``amax_group``: ``te.autocast`` where TE has it (``fp8_autocast`` is its deprecated wrapper, one
    ``DeprecationWarning`` per call), else ``te.fp8_autocast`` (older TE)."""
    te = import_transformer_engine()
    recipe = transformer_engine_recipe(config)
    if hasattr(te, "autocast"):
        return lambda: te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)
