"""The planner against the measurements: the layouts of ``benchmarks/planner/planner_measured.json`` (rows copied from
``benchmarks/RESULTS.md``) as planner cases, and their predicted-vs-measured errors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from lightning_megatron.models.config import GPTConfig
from lightning_megatron.planner.calibration import Hardware, load_hardware
from lightning_megatron.planner.layout import Layout
from lightning_megatron.planner.model import Prediction, Workload, predict

__all__ = ["MEASURED_FILE", "row_case", "compare"]

MEASURED_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "planner" / "planner_measured.json"


def row_case(row: Dict[str, Any]) -> Tuple[Layout, Workload, GPTConfig]:
    """The layout and workload of one measured row (``model``: a ``GPTConfig`` preset name)."""
    model = getattr(GPTConfig, row["model"])(seq_length=row["seq"])
    kwargs = dict(row["layout"])
    layout = Layout(micro_batch_size=row["mbs"], num_microbatches=row["m"], **kwargs)
    work = Workload(model, row["seq"], row["mbs"] * row["m"] * layout.dp,
                    grads_kept_between_steps=row["grads_kept"])
    return layout, work, model


def compare(path: Optional[Path] = None, hw: Optional[Hardware] = None) -> List[Dict[str, Any]]:
    """Per measured row: predicted and measured peak GiB and step ms, and the relative errors
    (``memory_error`` = predicted / measured - 1, ``time_error`` the same for the step time)."""
    hw = hw or load_hardware("h200")
    data = json.loads((path or MEASURED_FILE).read_text())
    out = []
    for row in data["rows"]:
        layout, work, _ = row_case(row)
        p: Prediction = predict(layout, work, hw)
        measured_step = work.global_batch_size * work.seq_length / (row["tokens_per_s"] * layout.world)
        out.append(dict(id=row["id"], fit=row.get("fit"), peak_gib=p.peak_gib, measured_peak_gib=row["peak_gib"],
                        step_ms=p.step_s * 1e3, measured_step_ms=measured_step * 1e3,
                        memory_error=p.peak_gib / row["peak_gib"] - 1, time_error=p.step_s / measured_step - 1))
    return out
