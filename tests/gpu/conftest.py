"""GPU tier: numerics that only a GPU can check (NCCL parity of every parallel layout, the fused cuDNN / flash
context-parallel block kernels, the compiled ring merge, the SM carveout).

Run on a machine with CUDA (2 GPUs for the NCCL tests; one GPU runs the rest):

    python -m pytest -q tests/gpu

Without CUDA every test here is skipped at collection (the default CPU suite, ``python -m pytest -q tests``,
passes over this folder in well under a second). Errors measured by the tests (the ``measured`` fixture) are
printed as one table at the end of the run, for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

# NVLink multicast stays off on shared GPU hosts (a program using it can take the host's GPUs down); the ranks
# spawned by the NCCL tests inherit these.
for _name in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

_HERE = Path(__file__).resolve().parent
_MEASURED = pytest.StashKey[List[Tuple[str, Dict[str, float]]]]()


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Skip every GPU-tier test where CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: needs CUDA (run `python -m pytest -q tests/gpu` on a GPU machine)")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def measured(request: pytest.FixtureRequest):
    """``measured(name=value, ...)`` records errors a test measured; the run ends with a table of them."""
    rows = request.config.stash.setdefault(_MEASURED, [])

    def record(**values: float) -> None:
        rows.append((request.node.nodeid.split("::", 1)[-1], {k: float(v) for k, v in values.items()}))

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    rows = config.stash.get(_MEASURED, [])
    if not rows:
        return
    terminalreporter.section("GPU tier: measured errors (relative Frobenius norms unless named otherwise)")
    for test, values in rows:
        terminalreporter.write_line(f"{test}: " + ", ".join(f"{k}={v:.3e}" for k, v in values.items()))
