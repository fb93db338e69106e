"""``StragglerMonitor``: name the ranks that set everyone's pace (Megatron's straggler detector as a callback).

In synchronous training every rank's wall-clock step lasts as long as the slowest rank's: the others wait for it
inside the step's collectives. What differs is the time a rank is *busy* rather than waiting, so each rank
measures

- on CUDA: the GPU time of each step (two CUDA events on the current stream around Lightning's
  ``on_train_batch_start`` / ``on_train_batch_end``, read only at a report: no per-step sync);
- elsewhere: the share of wall-clock time its main thread spends outside ``torch.distributed``'s collectives,
  sampled by a daemon thread every ``sample_interval_s`` (it looks at the main thread's Python stack for a frame
  of ``torch/distributed/``); work, data loading, callbacks and sleeping all count as busy, waiting for peers does
  not.

Every ``every_n_steps`` steps each rank's mean busy time per step, wall step time and layout coordinates
(pp stage, tp / cp / dp rank, from ``strategy.mesh``) are all-gathered over the world group (one all-gather of
six numbers per rank); a rank whose busy time exceeds ``slow_factor`` times the fastest rank's (and the fastest's by
``min_excess_s``) is named, slowest
first, with its relative speed (fastest busy time / its own), in a warning on global rank 0. Every rank keeps the
reports in :attr:`StragglerMonitor.reports`.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["StragglerMonitor"]

_COORDS = ("pp", "tp", "cp", "dp")


class StragglerMonitor(pl.Callback):
    """Every ``every_n_steps`` training steps, gather each rank's busy time per step and name the slow ranks.

    Args:
        every_n_steps: steps per report (>= 1).
        slow_factor: a rank is named when its busy time per step exceeds ``slow_factor`` (> 1) times the fastest
            rank's.
        max_named: at most this many ranks are named per report (the slowest).
        sample_interval_s: off CUDA, how often the main thread's stack is sampled (default 10 ms).
        min_excess_s: a named rank is also at least this much busier per step than the fastest (default 20 ms:
            tiny steps on a loaded host differ by a few milliseconds of scheduling).

    ``reports``: one dict per report, the same on every rank: ``step``, ``busy_s`` and ``step_s`` (per rank, in
    seconds per step), ``relative_speed`` (per rank, fastest busy time / its own, 1.0 = the fastest), ``coords``
    (per rank: ``{"pp", "tp", "cp", "dp"}``) and ``slow`` (the named ranks, slowest first).
    """

    def __init__(self, every_n_steps: int = 100, slow_factor: float = 1.5, max_named: int = 4,
                 sample_interval_s: float = 0.01, min_excess_s: float = 0.02) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"StragglerMonitor: every_n_steps={every_n_steps!r} must be an integer >= 1")
        if isinstance(slow_factor, bool) or not isinstance(slow_factor, (int, float)) or not slow_factor > 1:
            raise ValueError(f"StragglerMonitor: slow_factor={slow_factor!r} must be a number > 1")
        if isinstance(max_named, bool) or not isinstance(max_named, int) or max_named < 1:
            raise ValueError(f"StragglerMonitor: max_named={max_named!r} must be an integer >= 1")
        if isinstance(sample_interval_s, bool) or not isinstance(sample_interval_s, (int, float)) \
                or not sample_interval_s > 0:
            raise ValueError(f"StragglerMonitor: sample_interval_s={sample_interval_s!r} must be a number > 0")
        self.every_n_steps, self.slow_factor, self.max_named = every_n_steps, float(slow_factor), max_named
        self.sample_interval_s = float(sample_interval_s)
        if isinstance(min_excess_s, bool) or not isinstance(min_excess_s, (int, float)) or min_excess_s < 0:
            raise ValueError(f"StragglerMonitor: min_excess_s={min_excess_s!r} must be a number >= 0")
        self.min_excess_s = float(min_excess_s)
        self.reports: List[Dict[str, Any]] = []
        self._sampler: Optional[_CollectiveWaitSampler] = None
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._events: List[Any] = []   # CUDA: (start, end) event pairs of the steps since the last report
        self._wall_start: Optional[float] = None
        if self._sampler is not None:
            self._sampler.reset()

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.strategy.root_device.type != "cuda" and self._sampler is None:
            self._sampler = _CollectiveWaitSampler(self.sample_interval_s)
        self._reset()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._wall_start is None:
            self._wall_start = time.perf_counter()
        if self._sampler is None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append([start, None])

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._wall_start is None:
            return
        if self._events and self._events[-1][1] is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1][1] = end
        self._steps += 1
        if trainer.global_step % self.every_n_steps == 0:
            self._report(trainer)

    def _report(self, trainer: "pl.Trainer") -> None:
        wall = time.perf_counter() - self._wall_start
        if self._events:
            self._events[-1][1].synchronize()
            busy = sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        else:
            busy = wall * self._sampler.busy_share()
        mesh = getattr(trainer.strategy, "mesh", None)
        coords = [mesh.rank(n) if mesh is not None else (trainer.global_rank if n == "dp" else 0) for n in _COORDS]
        mine = torch.tensor([busy / self._steps, wall / self._steps, *coords], dtype=torch.float64)
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = trainer.strategy.root_device
            local = mine.to(device)
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, local)   # world group
            rows = [r.cpu() for r in rows]
        report = self._judge(trainer.global_step, rows)
        self.reports.append(report)
        if trainer.is_global_zero:
            self._log(report)
        self._reset()

    def _judge(self, step: int, rows: List[torch.Tensor]) -> Dict[str, Any]:
        busy = [float(r[0]) for r in rows]
        fastest = min(busy) if busy else 0.0
        speed = [fastest / b if b > 0 else 1.0 for b in busy]
        slow = sorted((r for r, b in enumerate(busy)
                       if b > self.slow_factor * fastest and b - fastest > self.min_excess_s), key=lambda r: -busy[r])
        return {"step": step, "busy_s": busy, "step_s": [float(r[1]) for r in rows], "relative_speed": speed,
                "coords": [{n: int(r[2 + i]) for i, n in enumerate(_COORDS)} for r in rows],
                "slow": slow[:self.max_named]}

    @staticmethod
    def _log(report: Dict[str, Any]) -> None:
        if not report["slow"]:
            log.info("StragglerMonitor step %d: no slow rank (busy per step %.1f-%.1f ms)", report["step"],
                     1e3 * min(report["busy_s"]), 1e3 * max(report["busy_s"]))
            return
        fastest = 1e3 * min(report["busy_s"])
        named = "; ".join(
            f"rank {r} ({', '.join(f'{k} {v}' for k, v in report['coords'][r].items())}): "
            f"{report['relative_speed'][r]:.2f}x the fastest's speed, busy {1e3 * report['busy_s'][r]:.1f} ms "
            "per step" for r in report["slow"])
        log.warning("StragglerMonitor step %d: slowest ranks: %s (fastest rank busy %.1f ms per step)",
                    report["step"], named, fastest)


class _CollectiveWaitSampler:
    """A daemon thread that samples, every ``interval_s``, whether the main thread is inside ``torch.distributed``
    (waiting for peers in a collective); :meth:`busy_share` is the share of samples outside it since
    :meth:`reset`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._main = threading.main_thread().ident
        self._busy = self._total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-megatron-straggler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._main)
            waiting = False
            while frame is not None:
                name = frame.f_code.co_filename
                if "torch/distributed/" in name or "torch\\distributed\\" in name:
                    waiting = True
                    break
                frame = frame.f_back
            self._total += 1
            self._busy += not waiting

    def busy_share(self) -> float:
        """Share of the samples since :meth:`reset` in which the main thread was not in a collective (1.0 when
        there was none)."""
        return self._busy / self._total if self._total else 1.0

    def reset(self) -> None:
        self._busy = self._total = 0

    def stop(self) -> None:
        self._stop.set()
