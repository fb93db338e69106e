"""Registers ``strategy="megatron"`` / ``"megatron_spawn"`` with Lightning without importing Lightning first.

``import lightning_megatron`` is cheap (its names load on first use), so the names are registered in Lightning's
``StrategyRegistry`` at the moment Lightning itself is loaded: at once when ``lightning.pytorch`` is already loaded,
otherwise right after ``lightning.pytorch`` finishes loading (a finder on ``sys.meta_path`` that wraps that one
package's loader and removes itself afterwards). What they name is a builder that imports the strategy module at its
first call (:class:`LazyStrategy`): registering imports nothing of ours, so it works whichever module of ours loads
Lightning first (one that does so while it is itself being imported, ``precision/plugin.py``, included).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

_TARGET = "lightning.pytorch"


@dataclass(frozen=True)
class LazyStrategy:
    """What Lightning's registry holds for our names: called with the registered ``init_params`` (Lightning's
    ``StrategyRegistry.get``), it imports ``module`` and returns ``module.class_name(**init_params)``."""

    module: str
    class_name: str = "MegatronStrategy"

    def __call__(self, **init_params: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.class_name)(**init_params)


def _register(strategy_module: str) -> None:
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        register_strategy_names(LazyStrategy(strategy_module), StrategyRegistry)
    except Exception as err:  # never break ``import lightning`` for a process that does not use us
        warnings.warn(f"lightning-megatron could not register strategy='megatron' with Lightning: {err!r}; "
                      "pass MegatronStrategy(...) instead of the string", RuntimeWarning, stacklevel=2)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for ``lightning.pytorch`` it returns the real spec with a loader that registers our
    strategy names once the package has executed (:class:`LazyStrategy` of ``strategy_module``)."""

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
    """Register ``strategy_class`` (the class, or a :class:`LazyStrategy` that builds it) in Lightning's
    ``strategy_registry`` as ``"megatron"`` (popen launch) and ``"megatron_spawn"`` (spawn launch), unless the names
    are taken."""
    if "megatron" not in strategy_registry:
        strategy_registry.register("megatron", strategy_class, description="lightning-megatron MegatronStrategy")
    if "megatron_spawn" not in strategy_registry:
        strategy_registry.register("megatron_spawn", strategy_class, description="MegatronStrategy, spawn launch",
                                   start_method="spawn")


def register_when_lightning_loads(strategy_module: str) -> None:
    """Register the strategy names for ``strategy_module`` (the module defining ``MegatronStrategy``, imported at the
    first use of a name: :class:`LazyStrategy`) now if Lightning is loaded, else as soon as ``lightning.pytorch`` is.
    The package's ``__init__`` names the module, so this one, which the strategy module imports, does not import it
    back."""
    if _TARGET in sys.modules:
        _register(strategy_module)
    elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning(strategy_module))
