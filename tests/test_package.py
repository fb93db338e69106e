"""The package's import surface: every public name resolves (names load on first use), ``import lightning_megatron``
and the planner's command line load neither torch nor Lightning, the planner prints within 5 s of wall time in a
fresh interpreter, and ``strategy="megatron"`` is registered whichever of Lightning and lightning_megatron is
imported first. Each check runs in a fresh interpreter, where imports have not happened yet."""
from __future__ import annotations

import importlib
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Dict, List

import pytest

import lightning_megatron

PACKAGES = ["lightning_megatron", "lightning_megatron.models", "lightning_megatron.callbacks", "lightning_megatron.moe",
            "lightning_megatron.parallel", "lightning_megatron.run"]


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):   # a module named as its function (parallelize) is callable as it
            value = getattr(value, name)
        assert getattr(value, "__name__", name) == name or not callable(value), (package, name, value)
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(module, "not_a_name")


def test_top_level_names_are_the_defining_objects():
    from lightning_megatron.parallel.config import ParallelConfig
    from lightning_megatron.strategy import MegatronStrategy

    assert lightning_megatron.MegatronStrategy is MegatronStrategy
    assert lightning_megatron.ParallelConfig is ParallelConfig


@pytest.mark.parametrize("first", ["", "from lightning_megatron import MegatronStrategy\n"],
                         ids=["alone", "after-the-strategy"])
def test_parallelize_parallelises_whatever_was_imported_first(first):
    """``from lightning_megatron import parallelize`` calls the function, also after an import of the module
    ``lightning_megatron/parallelize.py`` (``MegatronStrategy``'s) bound the package attribute to the module: the
    call reaches the function (its own error for missing arguments), never "'module' object is not callable"."""
    out = _python(first + "from lightning_megatron import parallelize\n"
                  "try:\n    parallelize()\nexcept TypeError as e:\n    print(e)\n")
    assert "parallelize() missing 3 required positional arguments" in out, out


def test_import_and_planner_load_neither_torch_nor_lightning():
    out = _python(
        "import contextlib, io, sys\n"
        "import lightning_megatron\n"
        "print('after import', 'torch' in sys.modules, 'lightning' in sys.modules)\n"
        "from lightning_megatron.planner.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main('--model llama3_70b --gpus 64 --gpu-memory 80 --seq-length 8192 --global-batch-size 128'.split())\n"
        "print('after plan', 'torch' in sys.modules, 'lightning' in sys.modules)\n")
    assert out.split("\n")[:2] == ["after import False False", "after plan False False"], out


def test_the_run_object_loads_without_lightning():
    """The Lightning-free run (:class:`~lightning_megatron.run.ParallelRun`) that the strategy and the plain loop
    share imports neither Lightning nor the strategy."""
    out = _python("import sys\nfrom lightning_megatron.run import ParallelRun\nParallelRun.start_step\n"
                  "print('lightning' in sys.modules, 'lightning_megatron.strategy.megatron_strategy' in sys.modules)\n")
    assert out.split() == ["False", "False"], out


def test_planner_cli_wall_time_under_5s():
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "lightning_megatron.planner", "--model", "gpt3_175b", "--gpus", "512",
                             "--seq-length", "2048", "--global-batch-size", "1536", "--hardware", "h100",
                             "--gpu-memory", "80", "--precision", "fp8"], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("| rank | tp | pp |"), result.stdout[:200]
    assert wall < 5.0, f"python -m lightning_megatron.planner took {wall:.2f} s"


@pytest.mark.parametrize("first", ["lightning_megatron", "lightning", "lightning.pytorch",
                                   "lightning_megatron.precision.plugin", "lightning_megatron.callbacks"])
def test_strategy_names_registered_whichever_package_loads_first(first):
    """Also when the first import is a module of ours that loads Lightning while it is itself being imported (the
    strategy module, imported as Lightning finishes loading, must not need that module yet)."""
    second = "lightning.pytorch" if first == "lightning_megatron" else "lightning_megatron"
    out = _python(
        f"import {first}\nimport {second}\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('megatron' in StrategyRegistry)\n"   # before anything imports the strategy module by name
        "from lightning_megatron.strategy import MegatronStrategy\n"
        "print(isinstance(StrategyRegistry.get('megatron'), MegatronStrategy),\n"
        "      StrategyRegistry.get('megatron_spawn')._start_method)\n")
    assert out.split() == ["True", "True", "spawn"], out


#: the package's layers, lowest first: a module may import from its own layer and the layers below it only
#: (docs/architecture.md, "The tree")
LAYERS = [{"utils"}, {"contract"}, {"parallel", "data", "optimizer"}, {"moe"}, {"models"}, {"precision"},
          {"parallelize"}, {"checkpoint"}, {"run"}, {"callbacks"}, {"planner"}, {"strategy"}, {"hf", "cli"},
          {"__init__", "__main__"}]


def _import_graph() -> Dict[str, set]:
    """``{module: modules of the package it imports}`` for every module of ``lightning_megatron`` (any import
    statement, also inside functions and ``TYPE_CHECKING`` blocks; ``from package import name`` counts the
    submodule ``name`` where there is one)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "lightning_megatron"
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(("lightning_megatron",) + path.relative_to(root).with_suffix("").parts)
        modules[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: Dict[str, set] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                    "lightning_megatron"):
                targets |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.startswith("lightning_megatron")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_package_layers_import_only_downwards_and_no_module_imports_itself_back():
    """No import from a lower layer into a higher one (:data:`LAYERS`), and no circle of imports between modules:
    the architecture as the folders show it."""
    graph = _import_graph()
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    rooms = {_room(m) for m in graph}
    assert rooms <= set(layer), f"folders without a layer in LAYERS: {sorted(rooms - set(layer))}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if layer[_room(a)] < layer[_room(b)])
    assert upward == [], upward
    # circles: depth-first search for a back edge
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
