"""``benchmarks/end_to_end/arm_turns.py``: benchmark arms started together take turns for their measured steps.

Real processes (small Python arms) coordinate through the marker files: no arm's measured window starts before every
arm is warmed up, the windows never overlap and come in the given order, an arm that crashes before it is ready does
not hold the others, an arm still running at the time limit is killed with its output so far kept, and stopping the
driver (SIGTERM) leaves no arm behind.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ARM = """
import json, os, sys, time
began = time.time()
sys.path.insert(0, {benchmarks!r})
from arm_turns import Turns
warmup, measured, crash, hang = (float(a) for a in sys.argv[1:5])
turns = Turns.parse(sys.argv[sys.argv.index("--turns") + 1])
if sys.argv[5] != "--turns":                # where the test wants this arm's process id
    open(sys.argv[5], "a").write(str(os.getpid()) + "\\n")
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
    sys.path.insert(0, str(ROOT / "benchmarks" / "end_to_end"))
    try:
        from arm_turns import run_together
        yield run_together
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "end_to_end"))


def _arms(tmp_path: Path, specs):
    script = tmp_path / "arm.py"
    script.write_text(ARM.format(benchmarks=str(ROOT / "benchmarks" / "end_to_end")))
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


DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {benchmarks!r})
from arm_turns import run_together
run_together({commands!r}, Path({folder!r}), timeout_s=60)
"""


def test_stopping_the_driver_stops_every_arm(tmp_path):
    """SIGTERM to the process running the arms (a device call's own time limit) kills every arm it started: none is
    left waiting for its turn, holding the GPU."""
    import os
    import signal
    import subprocess

    pids = tmp_path / "pids"
    commands = [cmd + [str(pids)] for cmd in _arms(tmp_path, [(0.0, 0.2, 0, 60), (0.0, 0.2, 0, 60)])]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(benchmarks=str(ROOT / "benchmarks" / "end_to_end"), commands=commands,
                                    folder=str(tmp_path / "turns")))
    proc = subprocess.Popen([sys.executable, str(driver)])
    deadline = time.time() + 30
    while time.time() < deadline and not (pids.exists() and len(pids.read_text().split()) == 2):
        time.sleep(0.1)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in started):
        time.sleep(0.1)
    assert not any(alive(p) for p in started), started
