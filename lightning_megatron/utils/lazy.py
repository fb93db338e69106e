"""Lazy package exports (PEP 562): a package lists ``name -> defining module`` and imports a module only when one
of its names is first used, so importing the package (or one light submodule of it, such as the planner) does not
import torch or Lightning through its siblings."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, MutableMapping, Tuple


def lazy_exports(namespace: MutableMapping[str, Any],
                 exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """Return the ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``: ``exports`` maps
    each public name to the module that defines it; a resolved name is cached in ``namespace``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
