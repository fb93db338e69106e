"""Fit the planner's few free constants to their named rows of benchmarks/planner_measured.json (each row with a
"fit" key, in file order) and write them into lightning_megatron/planner/calibration.json.

Each constant is solved by bisection so that the predicted step time of its row equals the measured one; the
other rows stay predictions (tests/test_planner.py checks all of them). Run: ``python benchmarks/fit_planner.py``.
"""
from __future__ import annotations

import dataclasses
import json

from lightning_megatron.planner.calibration import CALIBRATION_FILE, load_hardware
from lightning_megatron.planner.model import predict
from lightning_megatron.planner.check import MEASURED_FILE, row_case

#: constant -> (low, high, does the predicted step time grow with it)
RANGES = {"elementwise_passes": (0.0, 60.0, True), "tp_bandwidth_gbps": (5.0, 900.0, False),
          "dp_overlap": (0.0, 1.0, False), "cp_passes": (0.0, 60.0, True), "moe_rows_half": (0.0, 1e6, True)}


def fit(write: bool = True) -> dict:
    """The fitted constants (rounded to 3 decimals); written into calibration.json when ``write``."""
    data = json.loads(MEASURED_FILE.read_text())
    calib = json.loads(CALIBRATION_FILE.read_text())
    hw = load_hardware("h200")
    for row in data["rows"]:
        name = row.get("fit")
        if name not in RANGES:
            continue
        layout, work, _ = row_case(row)
        measured = work.global_batch_size * work.seq_length / (row["tokens_per_s"] * layout.world)
        lo, hi, grows = RANGES[name]
        for _ in range(60):
            mid = (lo + hi) / 2
            step = predict(layout, work, dataclasses.replace(hw, **{name: mid})).step_s
            if (step < measured) == grows:
                lo = mid
            else:
                hi = mid
        value = round((lo + hi) / 2, 3)
        hw = dataclasses.replace(hw, **{name: value})
        calib["fitted"][name] = value
        print(f"{name} = {value} (row {row['id']})")
    if write:
        CALIBRATION_FILE.write_text(json.dumps(calib, indent=2, ensure_ascii=False) + "\n")
    return {k: v for k, v in calib["fitted"].items() if k in RANGES}


if __name__ == "__main__":
    fit()
