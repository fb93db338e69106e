"""Fit the planner's few free constants to their named rows of benchmarks/planner/planner_measured.json (each row
with a "fit" key, in file order).

Each constant is solved by bisection so that the predicted step time of its row equals the measured one; the
other rows stay predictions (tests/test_planner.py checks all of them). The script prints the fitted constants and
writes nothing unless given ``--out``: then it writes the package's calibration file with the fitted constants
replaced to that path. To update the package's constants, write over its file and review the difference:

    python benchmarks/planner/fit_planner.py                                  # print the fit only
    python benchmarks/planner/fit_planner.py --out /tmp/calibration.json      # the whole file, fitted, elsewhere
    python benchmarks/planner/fit_planner.py --out lightning_megatron/planner/calibration.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Optional, Sequence

from lightning_megatron.planner.calibration import CALIBRATION_FILE, load_hardware
from lightning_megatron.planner.model import predict
from lightning_megatron.planner.check import MEASURED_FILE, row_case

#: constant -> (low, high, does the predicted step time grow with it)
RANGES = {"elementwise_passes": (0.0, 60.0, True), "tp_bandwidth_gbps": (5.0, 900.0, False),
          "dp_overlap": (0.0, 1.0, False), "cp_passes": (0.0, 60.0, True), "moe_rows_half": (0.0, 1e6, True)}


def fit(out: Optional[Path] = None) -> dict:
    """The fitted constants (rounded to 3 decimals), printed one per line. With ``out``, the package's calibration
    file with these constants in its ``fitted`` section is written to ``out`` (the package's file is read only)."""
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
    if out is not None:
        Path(out).write_text(json.dumps(calib, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {out}")
    return {k: v for k, v in calib["fitted"].items() if k in RANGES}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help=f"write the calibration file with the fitted constants here (default: print only; the "
                        f"package reads {CALIBRATION_FILE.name} from lightning_megatron/planner/)")
    fit(p.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
