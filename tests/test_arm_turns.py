"""``benchmarks/arm_turns.py``: benchmark arms started together take turns for their measured steps.

Real processes (small Python arms) coordinate through the marker files: no arm's measured window starts before every
arm is warmed up, the windows never overlap and come in the given order, an arm that crashes before it is ready does
not hold the others, and an arm still running at the time limit is killed with its output so far kept.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ARM = """
import json, sys, time
began = time.time()
sys.path.insert(0, {benchmarks!r})
from arm_turns import Turns
warmup, measured, crash, hang = (float(a) for a in sys.argv[1:5])
turns = Turns.parse(sys.argv[sys.argv.index("--turns") + 1])
time.sleep(warmup)                          # compiling and warming up, side by side with the other arms
if crash:
    sys.exit(3)
ready = time.time()
turns.wait_for_my_turn()
start = time.time()
print("STARTED", flush=True)
time.sleep(hang or measured)                # the measured steps, alone
end = time.time()
turns.done()
print("RESULT " + json.dumps(dict(began=began, ready=ready, start=start, end=end)), flush=True)
"""


@pytest.fixture()
def run_together():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from arm_turns import run_together
        yield run_together
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _arms(tmp_path: Path, specs):
    script = tmp_path / "arm.py"
    script.write_text(ARM.format(benchmarks=str(ROOT / "benchmarks")))
    return [[sys.executable, str(script), *(str(v) for v in spec)] for spec in specs]


def _results(runs):
    return [json.loads(r.stdout.split("RESULT ", 1)[1]) if "RESULT " in r.stdout else None for r in runs]


def test_arms_warm_up_together_and_take_turns_in_order(tmp_path, run_together):
    # warm-up times out of order: the last arm is ready first, the first arm last
    specs = [(1.1, 0.3, 0, 0), (0.8, 0.3, 0, 0), (0.5, 0.3, 0, 0)]
    runs = run_together(_arms(tmp_path, specs), tmp_path / "turns", timeout_s=60)
    assert [r.rc for r in runs] == [0, 0, 0], [r.stderr for r in runs]
    res = _results(runs)
    assert max(r["began"] for r in res) < min(r["ready"] for r in res), res   # the warm-ups ran side by side
    last_ready = max(r["ready"] for r in res)
    assert all(r["start"] >= last_ready for r in res), res          # nobody measured while another warmed up
    for before, after in zip(res, res[1:]):
        assert after["start"] >= before["end"], res                  # one at a time, in the given order


def test_a_crashed_arm_does_not_hold_the_others(tmp_path, run_together):
    specs = [(0.0, 0.2, 0, 0), (0.2, 0.2, 1, 0), (0.0, 0.2, 0, 0)]
    runs = run_together(_arms(tmp_path, specs), tmp_path / "turns", timeout_s=60)
    assert [r.rc for r in runs] == [0, 3, 0]
    first, crashed, last = _results(runs)
    assert crashed is None and last["start"] >= first["end"]


def test_the_time_limit_kills_a_hanging_arm_and_keeps_its_output(tmp_path, run_together):
    specs = [(0.0, 0.2, 0, 60), (0.0, 0.2, 0, 0)]
    t0 = time.time()
    runs = run_together(_arms(tmp_path, specs), tmp_path / "turns", timeout_s=3)
    assert time.time() - t0 < 20
    assert runs[0].rc is None and "STARTED" in runs[0].stdout and "RESULT" not in runs[0].stdout
    assert runs[1].rc is None and "STARTED" not in runs[1].stdout   # still waiting for its turn when killed
