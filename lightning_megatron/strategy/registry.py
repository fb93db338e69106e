"""Registers ``strategy="megatron"`` / ``"megatron_spawn"`` with Lightning without importing Lightning first.

``import lightning_megatron`` is cheap (its names load on first use), so the strategy module, whose import
registers the names in Lightning's ``StrategyRegistry``, is imported at the moment Lightning itself is: at once
when ``lightning.pytorch`` is already loaded, otherwise right after ``lightning.pytorch`` finishes loading (a
finder on ``sys.meta_path`` that wraps that one package's loader and removes itself afterwards).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Any, Optional, Sequence

_TARGET = "lightning.pytorch"


def _register(strategy_module: str) -> None:
    try:
        importlib.import_module(strategy_module)  # its last line registers the names
    except Exception as err:  # never break ``import lightning`` for a process that does not use us
        warnings.warn(f"lightning-megatron could not register strategy='megatron' with Lightning: {err!r}; "
                      "pass MegatronStrategy(...) instead of the string", RuntimeWarning, stacklevel=2)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for ``lightning.pytorch`` it returns the real spec with a loader that registers our
    strategy names once the package has executed (by importing ``strategy_module``)."""

    def __init__(self, strategy_module: str) -> None:
        self.strategy_module = strategy_module

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _TARGET:
            return None
        self._remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register(self.strategy_module)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec

    def _remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def register_strategy_names(strategy_class: Any, strategy_registry: Any) -> None:
    """Register ``strategy_class`` in Lightning's ``strategy_registry`` as ``"megatron"`` (popen launch) and
    ``"megatron_spawn"`` (spawn launch), unless the names are taken."""
    if "megatron" not in strategy_registry:
        strategy_registry.register("megatron", strategy_class, description="lightning-megatron MegatronStrategy")
    if "megatron_spawn" not in strategy_registry:
        strategy_registry.register("megatron_spawn", strategy_class, description="MegatronStrategy, spawn launch",
                                   start_method="spawn")


def register_when_lightning_loads(strategy_module: str) -> None:
    """Import ``strategy_module`` (the module defining the strategy, whose import registers its names) now if
    Lightning is loaded, else as soon as ``lightning.pytorch`` is. The package's ``__init__`` names the module, so
    this one, which the strategy module imports, does not import it back."""
    if _TARGET in sys.modules:
        _register(strategy_module)
    elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning(strategy_module))
