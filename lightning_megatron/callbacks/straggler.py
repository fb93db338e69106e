"""``StragglerMonitor``: name the ranks that set everyone's pace (Megatron's straggler detector as a callback).

In synchronous training every rank's wall-clock step lasts as long as the slowest rank's: the others wait for it
inside the step's collectives. What differs is the time a rank is *busy* rather than waiting, so each rank measures

- inside the step (Lightning's ``on_train_batch_start`` to ``on_train_batch_end``): on CUDA the time between two
  CUDA events on the current stream (the GPU's busy time, read only at a report, no per-step sync); elsewhere the
  main thread's CPU time (a collective that waits blocks without using CPU);
- between steps (data loading, callbacks, host work): wall-clock time.

Every ``every_n_steps`` steps each rank's mean busy time per step, wall step time and layout coordinates
(pp stage, tp / cp / dp rank, from ``strategy.mesh``) are all-gathered over the world group (one all-gather of
seven numbers); a rank whose busy time exceeds ``slow_factor`` times the fastest rank's is named, slowest first,
with its relative speed (fastest busy time / its busy time), in a warning on global rank 0. Every rank keeps the
reports in :attr:`StragglerMonitor.reports`. Cost per step: two clock reads (or two CUDA event records).
"""
from __future__ import annotations

import logging
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

    ``reports``: one dict per report, the same on every rank: ``step``, ``busy_s`` and ``step_s`` (per rank, in
    seconds per step), ``relative_speed`` (per rank, fastest busy time / its own, 1.0 = the fastest), ``coords``
    (per rank: ``{"pp", "tp", "cp", "dp"}``) and ``slow`` (the named ranks, slowest first).
    """

    def __init__(self, every_n_steps: int = 100, slow_factor: float = 1.5, max_named: int = 4) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"StragglerMonitor: every_n_steps={every_n_steps!r} must be an integer >= 1")
        if isinstance(slow_factor, bool) or not isinstance(slow_factor, (int, float)) or not slow_factor > 1:
            raise ValueError(f"StragglerMonitor: slow_factor={slow_factor!r} must be a number > 1")
        if isinstance(max_named, bool) or not isinstance(max_named, int) or max_named < 1:
            raise ValueError(f"StragglerMonitor: max_named={max_named!r} must be an integer >= 1")
        self.every_n_steps, self.slow_factor, self.max_named = every_n_steps, float(slow_factor), max_named
        self.reports: List[Dict[str, Any]] = []
        self._reset()

    def _reset(self) -> None:
        self._busy = 0.0          # seconds busy (host gaps + CPU time or GPU time inside steps) since the last report
        self._steps = 0
        self._events: List[Any] = []   # CUDA: (start, end) event pairs of the steps since the last report
        self._wall_start: Optional[float] = None
        self._last_end: Optional[float] = None
        self._step_cpu: Optional[float] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset()

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._busy += now - self._last_end   # host work between steps: data, callbacks
        if self._wall_start is None:
            self._wall_start = now
        if trainer.strategy.root_device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append([start, None])
        else:
            self._step_cpu = time.thread_time()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._wall_start is None:   # resumed mid-step bookkeeping: start counting at the next step
            return
        if self._events and self._events[-1][1] is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1][1] = end
        elif self._step_cpu is not None:
            self._busy += time.thread_time() - self._step_cpu
        self._steps += 1
        self._last_end = time.perf_counter()
        if trainer.global_step % self.every_n_steps == 0 and self._steps:
            self._report(trainer)

    def _report(self, trainer: "pl.Trainer") -> None:
        busy = self._busy
        if self._events:
            self._events[-1][1].synchronize()
            busy += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        wall = (self._last_end - self._wall_start) if self._wall_start is not None else 0.0
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
        busy_now = self._last_end
        self._reset()
        self._last_end = busy_now

    def _judge(self, step: int, rows: List[torch.Tensor]) -> Dict[str, Any]:
        busy = [float(r[0]) for r in rows]
        fastest = min(busy) if busy else 0.0
        speed = [fastest / b if b > 0 else 1.0 for b in busy]
        slow = sorted((r for r, b in enumerate(busy) if b > self.slow_factor * fastest), key=lambda r: -busy[r])
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
