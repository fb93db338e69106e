"""The GPU's SM clock, power draw and clock-event reasons, sampled beside a benchmark by ``nvidia-smi -lms`` and
summed up over a stretch of wall-clock time (an arm's timed steps): whether the GPU ran at its top clock or slowed
itself, at its power cap or for heat, while the steps were timed (benchmarks/RESULTS.md, "The slow step is the GPU's
power limit"). Reads nothing from the GPU itself and needs no torch; without ``nvidia-smi`` there are no samples.

    sampler = GpuSampler()
    sampler.start()                      # False where nvidia-smi is missing
    ...                                  # the benchmark; record time.time() around what is measured
    during(sampler.samples(), t0, t1)    # {"samples", "sm_mhz", "sm_mhz_min", "watts", "slowed"} or None
    sampler.stop()
"""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import IO, List, Optional, Sequence

#: what is sampled, in this order (``clocks_throttle_reasons`` is the name older drivers know; newer ones take it too)
QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
#: the clock-event reasons that mean the GPU slowed itself: software power cap (0x4), hardware slowdown (0x8),
#: software thermal slowdown (0x20), hardware thermal slowdown (0x40), hardware power brake (0x80)
SLOWDOWN_BITS = 0x04 | 0x08 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class Sample:
    """One ``nvidia-smi`` line: ``t`` seconds since the epoch (from its local-time stamp), the SM clock (MHz), the
    power draw (W) and the clock-event reason bits."""

    t: float
    sm_mhz: float
    watts: float
    reasons: int


def parse_line(line: str) -> Optional[Sample]:
    """A :data:`QUERY` line of ``--format=csv,noheader,nounits`` (``2026/12/04 16:45:57.204, 1410, 641.99,
    0x0000000000000004``) as a :class:`Sample`; None for anything else (a header, an error, ``[N/A]``, a line cut
    short)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return Sample(t, float(parts[1]), float(parts[2]), int(parts[3], 16))
    except ValueError:
        return None


class GpuSampler:
    """``nvidia-smi`` sampling GPU 0 every ``interval_ms`` into a temporary file, from :meth:`start` to :meth:`stop`
    (``command``: the program to run, for tests)."""

    def __init__(self, interval_ms: int = 100, command: Sequence[str] = ("nvidia-smi",)) -> None:
        if interval_ms < 10:
            raise ValueError(f"GpuSampler(interval_ms={interval_ms}): nvidia-smi samples at most every 10 ms")
        self.interval_ms = interval_ms
        self.command = list(command)
        self._proc: Optional[subprocess.Popen] = None
        self._file: Optional[IO[str]] = None

    def start(self) -> bool:
        """Start sampling; False (and no samples) where the program is not found."""
        if self._proc is not None:
            return True
        if shutil.which(self.command[0]) is None:
            return False
        self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        self._proc = subprocess.Popen(
            self.command + [f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", "0",
                            "-lms", str(self.interval_ms)],
            stdout=self._file, stderr=subprocess.DEVNULL)
        return True

    def samples(self) -> List[Sample]:
        """Every sample so far (sampling goes on)."""
        if self._file is None:
            return []
        with open(self._file.name) as f:
            return [s for s in map(parse_line, f) if s is not None]

    def stop(self) -> List[Sample]:
        """Stop sampling; every sample taken."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        out = self.samples()
        if self._file is not None:
            self._file.close()
            os.unlink(self._file.name)
            self._file = None
        return out


def during(samples: Sequence[Sample], t0: Optional[float], t1: Optional[float]) -> Optional[dict]:
    """The samples taken from ``t0`` to ``t1`` (seconds since the epoch) summed up: how many, the mean and lowest SM
    clock (MHz), the mean power draw (W), and the share of them with a :data:`SLOWDOWN_BITS` reason set; None when
    either bound is missing or no sample falls between them."""
    if t0 is None or t1 is None:
        return None
    inside = [s for s in samples if t0 <= s.t <= t1]
    if not inside:
        return None
    n = len(inside)
    slowed = sum(bool(s.reasons & SLOWDOWN_BITS) for s in inside)
    return dict(samples=n, sm_mhz=round(sum(s.sm_mhz for s in inside) / n),
                sm_mhz_min=round(min(s.sm_mhz for s in inside)), watts=round(sum(s.watts for s in inside) / n),
                slowed=round(slowed / n, 2))
