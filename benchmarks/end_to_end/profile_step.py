"""Where one training step's time goes, ours against the plain-PyTorch peer, on one GPU: for each arm 10 timed steps
(tokens/s, peak allocated and peak reserved memory: reserved counts CUDA graph pools; printed at once as a ``TIMED``
line, so an arm cut short while profiling keeps them), then one profiled step whose device time is split into kernel
families (GEMM, attention, fused elementwise / Triton, optimizer, FP8 casts and amax, copies, NCCL) and device idle
time.

    python benchmarks/end_to_end/profile_step.py [--arms peer-compile,ours-bf16-compile,...] [--out results.json] [--together]
                                      [--no-profile]

With ``--no-profile`` each arm stops after its timed steps (no profiled step): tokens/s and memory only.
With ``--trace-dir DIR`` each arm's profiled step(s) are also written as a gzipped Chrome trace, ``DIR/<arm>.json.gz``
(each kernel linked to the host operation that launched it).
With ``--profiled-steps N`` the profile covers N steps in a row (its figures are per step, averaged over them), so
the time between steps shows: ``gaps`` lists the longest stretches with no kernel running and the kernels on either
side of each.
An arm name may carry a ``#<tag>`` suffix to run the same arm again in one call (``peer-compile,peer-compile#2``:
two runs of the peer, two rows).

With ``--together`` the arms compile and warm up side by side and then take turns for their measured steps
(``arm_turns.py``): several arms fit into one call's time on a fresh machine, so their ratios come from one call.

Arms (each in a child process of its own):
  peer-eager          the shared peer's model and loop without ``torch.compile``: ``peer_baseline.py eager``
  peer-compile        the shared peer's model (``peer_baseline.py``'s ``GPT``) under ``torch.compile``, autocast bf16,
                      fused AdamW: the same loop as ``peer_baseline.py compile``
  peer-fp8            the same with torchao float8 (tensorwise, all linears but the head): ``peer_baseline.py fp8``
                      (needs torchao importable)
  ours-bf16-compile   ``ParallelGPTModule(GPTConfig.llama_1b_bench())`` through Trainer + ``MegatronStrategy(compile=True)``
                      + ``MegatronPrecision("bf16-mixed")``
  ours-bf16-eager     the same with ``MegatronStrategy()`` (no compile)
  ours-bf16-params-compile   + ``params_dtype=torch.bfloat16``
  ours-fp8-compile    + ``fp8="hybrid", fp8_recipe="tensorwise"`` (torch-native FP8)
  ours-fp8-compile-nocheck   the same with ``check_for_nan_in_loss_and_grad=False`` (what the non-finite checks cost)
  ours-fp8-bf16m-compile     FP8 tensorwise with both Adam moments in bf16 (``ParallelGPTModule(exp_avg_dtype="bf16",
                             exp_avg_sq_dtype="bf16")``)
  ours-fp8-delayed-compile / ours-fp8-delayed-bf16m-compile   the delayed recipe (amax histories), without / with
                             bf16 moments
  ours-fp8-bf16p-bf16m-compile   FP8 tensorwise with bf16 parameters and fp32 main parameters and gradients
                             (``params_dtype=torch.bfloat16``) and bf16 moments
  ours-fp8-delayed-bf16p-bf16m-compile   the delayed recipe with bf16 parameters and bf16 moments
  ours-bf16p-bf16m-compile   bf16 (no FP8) with bf16 parameters (fp32 main parameters and gradients) and bf16 moments
  ours-bf16p-bf16m-compile-nocheck   the same with ``check_for_nan_in_loss_and_grad=False``
  ours-bf16p-bf16m-rem-compile / ours-fp8-delayed-bf16p-bf16m-rem-compile   the bf16-parameter arms with
                             ``store_param_remainders=True`` (fp32 main parameters as bf16 copy plus int16 remainder)
  ours-bf16p-bf16m-rem-compile-nocheck   the bf16 one with ``check_for_nan_in_loss_and_grad=False`` (what the
                             non-finite check costs the fastest bf16 setup, with ``-cudagraph``)
  <ours arm>-cudagraph       the same with ``MegatronStrategy(enable_cuda_graph=True)``: each compiled layer's forward and
                             backward replayed as CUDA graphs (docs/performance.md, "Fewer launches")
  <ours arm>-manualgc        the same with ``MemoryHousekeeping(manual_gc=True)``: Python's automatic garbage collection
                             off while training (Megatron's ``--manual-gc``), so no collection pauses a timed step
  <ours arm>-split<N>        (last) the layers compiled with a norm backward's weight-gradient split N
                             (``triton.mix_order_reduction_split_size``) instead of the library's
                             (``parallel/compile.py``: ``LAYER_COMPILE_OPTIONS``); ``-splitauto``: Inductor's own choice

Every arm lists, in ``host_lead_ms``, its timed steps' GPU times (``gpu_steps_ms``) and the garbage collections that
ran during them (``gc_pauses``: step, generation, ms).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "end_to_end"))
sys.path.insert(1, str(ROOT / "benchmarks" / "peers"))   # peer_baseline
from arm_turns import Turns, run_together  # noqa: E402
from bench_precision import BASE_ARMS, MODULE_KEYS  # noqa: E402

ARMS = ("peer-compile", "peer-fp8", "ours-bf16-compile", "ours-bf16-params-compile", "ours-fp8-compile")
PEERS = ("peer-eager", "peer-compile", "peer-fp8")
#: MegatronStrategy options of the production arms
PRODUCTION = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
#: arm keys that are MegatronStrategy options, not MegatronPrecision ones
STRATEGY_KEYS = tuple(PRODUCTION)
#: our arms -> their MegatronPrecision arguments (bench_precision.py's arms of the same meaning)
OURS = {"ours-bf16-compile": BASE_ARMS["bf16-autocast"], "ours-bf16-params-compile": BASE_ARMS["bf16-params"],
        "ours-fp8-compile": BASE_ARMS["fp8-tensorwise"], "ours-fp8-compile-nocheck": BASE_ARMS["fp8-tensorwise"],
        "ours-fp8-bf16m-compile": BASE_ARMS["fp8-tensorwise-bf16-moments"],
        "ours-fp8-delayed-compile": BASE_ARMS["fp8-delayed"],
        "ours-fp8-delayed-bf16m-compile": BASE_ARMS["fp8-delayed-bf16-moments"],
        "ours-fp8-bf16p-bf16m-compile": dict(BASE_ARMS["fp8-tensorwise-bf16-moments"], params_dtype="bfloat16",
                                             store_param_remainders=False),
        "ours-bf16p-bf16m-compile": BASE_ARMS["bf16-params-bf16-moments"],
        "ours-bf16p-bf16m-compile-nocheck": BASE_ARMS["bf16-params-bf16-moments"],
        "ours-fp8-delayed-bf16p-bf16m-compile": dict(BASE_ARMS["fp8-delayed-bf16-moments"], params_dtype="bfloat16",
                                                     store_param_remainders=False),
        "ours-bf16p-bf16m-rem-compile": dict(BASE_ARMS["bf16-params-bf16-moments"], store_param_remainders=True),
        "ours-bf16p-bf16m-rem-compile-nocheck": dict(BASE_ARMS["bf16-params-bf16-moments"], store_param_remainders=True),
        "ours-fp8-delayed-bf16p-bf16m-rem-compile": dict(BASE_ARMS["fp8-delayed-bf16-moments"], params_dtype="bfloat16",
                                                         store_param_remainders=True),
        "ours-bf16-eager": BASE_ARMS["bf16-autocast"],
        # Megatron's production recipe (examples/llama/train_llama3_8b_fp8.sh: --bf16 --use-distributed-optimizer
        # --overlap-grad-reduce --overlap-param-gather --fp8-format hybrid): bf16 parameters with remainders (the
        # default), fp32 moments, FP8 delayed, the distributed optimizer and both overlaps (on one GPU, dp = 1:
        # nothing to shard or reduce); "-bf16m": with bf16 moments
        "ours-production-compile": dict(BASE_ARMS["fp8-delayed"], params_dtype="bfloat16", **PRODUCTION),
        "ours-production-bf16m-compile": dict(BASE_ARMS["fp8-delayed-bf16-moments"], params_dtype="bfloat16",
                                              **PRODUCTION)}
CUDAGRAPH = "-cudagraph"
MANUAL_GC = "-manualgc"
#: ``-split<N>`` / ``-splitauto`` (last): the layers compiled with ``triton.mix_order_reduction_split_size`` N instead
#: of the library's (``LAYER_COMPILE_OPTIONS``), or with Inductor's own choice
SPLIT = re.compile(r"-split(\d+|auto)$")
EAGER = "-eager"
#: kernel family -> substrings of kernel names (first match wins, in this order)
FAMILIES = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_", "scaled_mm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy_")),
)
WARMUP, TIMED = 4, 10


def base_arm(name: str) -> str:
    """The arm an arm name runs: ``peer-compile#2`` runs ``peer-compile``."""
    return name.split("#", 1)[0]


@dataclass(frozen=True)
class OursArm:
    """One of our arm names taken apart: the :data:`OURS` entry it runs (``key``; ``-eager`` and ``-nocheck`` stay in
    it) and its suffixes, in the order they may follow it: ``-cudagraph``, ``-manualgc``, ``-split<N>``
    (``split``: ``"auto"``, the number, or None)."""

    key: str
    cudagraph: bool
    manual_gc: bool
    split: Optional[str]


def ours_arm(base: str) -> Optional[OursArm]:
    """``base`` (an arm name without its ``#<tag>``) as one of our arms, or None when it is not one (a peer's name, a
    suffix a peer or an eager arm does not take, an unknown entry)."""
    split = SPLIT.search(base)
    name = base[:split.start()] if split else base
    manual_gc = name.endswith(MANUAL_GC)
    if manual_gc:
        name = name[:-len(MANUAL_GC)]
    cudagraph = name.endswith(CUDAGRAPH) and not name.endswith(EAGER + CUDAGRAPH)
    if cudagraph:
        name = name[:-len(CUDAGRAPH)]
    if name not in OURS:
        return None
    return OursArm(name, cudagraph, manual_gc, split.group(1) if split else None)


def known_arm(name: str) -> bool:
    """Whether ``name`` (``#<tag>`` suffix allowed) is an arm this script runs."""
    base = base_arm(name)
    return base in PEERS or ours_arm(base) is not None


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other eager"


def breakdown(prof, steps: int = 1) -> dict:
    """Device time per kernel family (ms), the step's device window and idle time (ms), the top kernels: per step,
    over the ``steps`` profiled steps. ``gaps``: the longest stretches of the whole window without a kernel (ms from
    the window's start, length in ms, the kernels before and after)."""
    from bench_tp import _merged, device_kernels

    kern = device_kernels(prof)
    fams: dict = {}
    per_kernel: dict = {}
    for a, b, n in kern:
        f = family(n)
        fams[f] = fams.get(f, 0.0) + (b - a) / 1e3
        k = per_kernel.setdefault(n[:90], [0.0, 0, f])
        k[0] += (b - a) / 1e3
        k[1] += 1
    busy = sum(b - a for a, b in _merged([(a, b) for a, b, _ in kern])) / 1e3
    window = (kern[-1][1] - kern[0][0]) / 1e3 if kern else 0.0
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return dict(window_ms=round(window / steps, 2), busy_ms=round(busy / steps, 2),
                idle_ms=round((window - busy) / steps, 2), kernels=round(len(kern) / steps),
                families_ms={k: round(v / steps, 2) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
                top_kernels=[[n, round(v[0] / steps, 3), v[1] // steps, v[2]] for n, v in top], host=host_time(prof),
                all_kernels=sorted([[n, v[1] // steps, round(v[0] / steps, 3)] for n, v in per_kernel.items()],
                                   key=lambda r: -r[1]),
                profiled_steps=steps, gaps=longest_gaps(kern), idle_by_length=idle_by_length(kern, steps),
                idle_by_neighbours=idle_by_neighbours(kern, steps))


def _gaps_between(kern: list) -> list:
    """Every stretch without a kernel between the first and the last of ``kern`` (``(start_us, end_us, name)``,
    sorted by start), measured from the latest end so far: ``(start_us, length_us, kernel before, kernel after)``."""
    gaps, end, last = [], kern[0][1] if kern else 0, kern[0][2] if kern else ""
    for a, b, n in kern[1:]:
        if a > end:
            gaps.append((end, a - end, last, n))
        if b > end:
            end, last = b, n
    return gaps


#: upper bounds (us) of the gap lengths :func:`idle_by_length` counts together
GAP_BOUNDS_US = (2, 5, 10, 50, 200, float("inf"))


def idle_by_length(kern: list, steps: int = 1) -> list:
    """The idle time between kernels by the length of its gaps, per step: ``[up to us, gaps, ms]`` for each bound of
    :data:`GAP_BOUNDS_US` (many short gaps: launch spacing; a few long ones: waits)."""
    rows = [[bound, 0, 0.0] for bound in GAP_BOUNDS_US]
    for _, length, _, _ in _gaps_between(kern):
        row = next(r for r in rows if length <= r[0])
        row[1] += 1
        row[2] += length / 1e3
    return [[str(b), n // steps, round(ms / steps, 3)] for b, n, ms in rows]


def idle_by_neighbours(kern: list, steps: int = 1, count: int = 15) -> list:
    """The idle time between kernels summed by the pair of kernels around each gap (names cut to 40 characters), per
    step: ``[before, after, gaps, ms]``, the ``count`` pairs with the most."""
    pairs: dict = {}
    for _, length, before, after in _gaps_between(kern):
        row = pairs.setdefault((before[:40], after[:40]), [0, 0.0])
        row[0] += 1
        row[1] += length / 1e3
    top = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:count]
    return [[b, a, n // steps, round(ms / steps, 3)] for (b, a), (n, ms) in top]


def longest_gaps(kern: list, count: int = 12) -> list:
    """The ``count`` longest stretches without a kernel between the first and the last of ``kern`` (``(start_us,
    end_us, name)``, sorted by start): ``[ms from the first kernel's start, length ms, kernel before, kernel after]``."""
    gaps = [[round((start - kern[0][0]) / 1e3, 3), round(length / 1e3, 3), before[:60], after[:60]]
            for start, length, before, after in _gaps_between(kern)]
    return sorted(gaps, key=lambda g: -g[1])[:count]


def host_time(prof) -> dict:
    """Where the host spends the profiled step: the host events with the most time of their own (ms, calls), and the
    total of the CUDA runtime's launch calls."""
    events = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    launches = [e for e in events if e[0].startswith(("cudaLaunch", "cuLaunch"))]
    top = sorted(events, key=lambda e: -e[1])[:20]
    return dict(self_ms_total=round(sum(e[1] for e in events), 2),
                launch_ms=round(sum(e[1] for e in launches), 2), launches=sum(e[2] for e in launches),
                top_self=[[k[:80], round(ms, 3), n] for k, ms, n in top])


class GcPauses:
    """Python's garbage collections while recording (``gc.callbacks``): ``[step, generation, ms]`` each, ``step``
    counted by :meth:`next_step` (0 before the first call)."""

    def __init__(self) -> None:
        self.pauses: list = []
        self.step = 0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append([self.step, info["generation"], round((time.perf_counter() - self._start) * 1e3, 2)])

    def start(self) -> None:
        self.pauses, self.step = [], 0
        gc.callbacks.append(self._callback)

    def next_step(self) -> None:
        self.step += 1

    def stop(self) -> list:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return self.pauses


class HostLead:
    """How far the host runs ahead of the GPU at points of a step, over the timed steps: at each point a CUDA event is
    recorded with the host's clock; once the steps are over, the GPU's time at each event (from a reference event
    recorded right after a synchronisation) minus the host's time is how long the GPU took to reach work the host had
    queued. Near 0 at a point: the GPU waited for the host there. Median per point (ms), and every step's
    (``each_ms``, ``gpu_steps_ms``); no synchronisation while the steps run (the events are read at the end)."""

    POINTS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_train_batch_end")

    def __init__(self) -> None:
        self.marks: list = []
        self.ref = None
        self.gc = GcPauses()

    def start(self) -> None:
        import torch

        self.gc.start()
        torch.cuda.synchronize()
        self.ref, self.t0 = torch.cuda.Event(enable_timing=True), time.perf_counter()
        self.ref.record()

    def mark(self, point: str) -> None:
        import torch

        if self.ref is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((point, time.perf_counter(), event))
        if point == self.POINTS[0] and len(self.marks) > 1:
            self.gc.next_step()

    def report(self) -> dict:
        import statistics

        import torch

        torch.cuda.synchronize()
        lead: dict = {}
        starts = [(host, event) for point, host, event in self.marks if point == self.POINTS[0]]
        for point, host, event in self.marks:
            lead.setdefault(point, []).append(self.ref.elapsed_time(event) - (host - self.t0) * 1e3)
        self.marks, self.ref = [], None
        out = {p: round(statistics.median(v), 2) for p, v in lead.items()}
        # a step's length on each side, between consecutive batch starts
        out["host_step_ms"] = round(statistics.median((b[0] - a[0]) * 1e3 for a, b in zip(starts, starts[1:])), 2)
        steps = [a[1].elapsed_time(b[1]) for a, b in zip(starts, starts[1:])]
        out["gpu_step_ms"] = round(statistics.median(steps), 2)
        out["gpu_steps_ms"] = [round(t, 2) for t in steps]   # each step, in order: a slow first step shows
        out["host_steps_ms"] = [round((b[0] - a[0]) * 1e3, 2) for a, b in zip(starts, starts[1:])]
        out["each_ms"] = {p: [round(t, 1) for t in v] for p, v in lead.items()}
        out["gc_pauses"] = self.gc.stop()
        return out


def report_timed(tokens: int, seconds: float, peak: int, reserved: int, timed_from: Optional[float] = None) -> dict:
    """The timed steps' figures, printed at once as a ``TIMED`` line (an arm cut short while profiling keeps them);
    ``timed_from`` / ``timed_to``: when the timed steps began (given) and ended (now), in seconds since the epoch, for
    matching the GPU's clock samples (``gpu_clock.py``)."""
    row = dict(tokens_per_s=round(tokens / seconds), step_ms=round(seconds / TIMED * 1e3, 2),
               peak_mem_gib=round(peak / 2**30, 2), peak_reserved_gib=round(reserved / 2**30, 2),
               timed_from=timed_from, timed_to=time.time())
    print("TIMED " + json.dumps(row), flush=True)
    return row


def save_trace(prof, trace: str) -> None:
    """The profile as a Chrome trace at ``trace`` (nothing when empty; its folder made if missing; torch gzips it for a
    ``.gz`` name): every kernel with the host operation that launched it."""
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)


def run_peer(fp8: bool, turns: Optional[Turns] = None, compile_: bool = True, profiled: bool = True,
             profiled_steps: int = 1, trace: str = "") -> dict:
    import torch
    import peer_baseline as peer

    torch.manual_seed(0)
    m = peer.GPT(peer.CFG).cuda()
    if fp8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(m, module_filter_fn=lambda mod, fqn: fqn != "head")
    if compile_:
        m = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step():
        x, y = peer.batch(peer.CFG)
        with torch.autocast("cuda", torch.bfloat16):
            loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    if turns is not None:
        turns.wait_for_my_turn()
    torch.cuda.reset_peak_memory_stats()
    lead = HostLead()   # each step's start marked, and once more after the last: every timed step's GPU time
    lead.start()
    t, timed_from = time.perf_counter(), time.time()
    for _ in range(TIMED):
        lead.mark(HostLead.POINTS[0])
        step()
    lead.mark(HostLead.POINTS[0])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    c = peer.CFG
    timed = report_timed(c["mbs"] * c["seq"] * TIMED, dt, torch.cuda.max_memory_allocated(),
                         torch.cuda.max_memory_reserved(), timed_from)
    timed["host_lead_ms"] = lead.report()
    if not profiled:
        if turns is not None:
            turns.done()
        return timed
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled_steps):
            step()
        torch.cuda.synchronize()
    if turns is not None:
        turns.done()
    save_trace(prof, trace)
    return dict(timed, profile=breakdown(prof, profiled_steps))


def run_ours(name: str, turns: Optional[Turns] = None, profiled: bool = True, profiled_steps: int = 1,
             trace: str = "") -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from bench_tp import RandomTokens, StepTimer
    from lightning_megatron import GPTConfig, MegatronPrecision, MegatronStrategy, ParallelGPTModule
    from lightning_megatron.cli.callbacks import MemoryHousekeeping

    arm = ours_arm(name)
    if arm is None:
        raise ValueError(f"{name!r} is not one of our arms")
    if arm.split is not None:
        from lightning_megatron.parallel.compile import LAYER_COMPILE_OPTIONS as options

        options.pop("triton.mix_order_reduction_split_size", None)
        if arm.split != "auto":
            options["triton.mix_order_reduction_split_size"] = int(arm.split)
    if arm.cudagraph:   # Inductor says on stderr why it skips a layer's CUDA graph
        torch._logging.set_logs(perf_hints=True)
    kwargs = dict(OURS[arm.key])
    module_kwargs = {k: kwargs.pop(k) for k in MODULE_KEYS if k in kwargs}
    strategy_kwargs = {k: kwargs.pop(k) for k in STRATEGY_KEYS if k in kwargs}
    if "params_dtype" in kwargs:
        kwargs["params_dtype"] = getattr(torch, kwargs["params_dtype"])
    cfg = GPTConfig.llama_1b_bench()
    timer = StepTimer(start=WARMUP, stop=WARMUP + TIMED)
    result: dict = {}

    class WaitForTurn(pl.Callback):   # before the timer's start: the timed steps run with the GPU to themselves
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == WARMUP and turns is not None:
                torch.cuda.synchronize()
                turns.wait_for_my_turn()

    lead = HostLead()

    class LeadMarks(pl.Callback):   # after the timer's start sync (callbacks run in order): the timed steps
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == WARMUP:
                lead.start()
                result["timed_from"] = time.time()
            lead.mark("on_train_batch_start")

        def on_before_backward(self, trainer, module, loss):
            lead.mark("on_before_backward")

        def on_after_backward(self, trainer, module):
            lead.mark("on_after_backward")

        def on_before_optimizer_step(self, trainer, module, optimizer):
            lead.mark("on_before_optimizer_step")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            lead.mark("on_train_batch_end")
            if batch_idx == WARMUP + TIMED - 1:
                result["host_lead_ms"] = lead.report()

    def timed_over() -> None:
        result.update(report_timed(4 * cfg.seq_length * TIMED, timer.times[1] - timer.times[0],
                                   timer.peak_mem, timer.peak_reserved, result.get("timed_from")))

    class TimedOnly(pl.Callback):   # --no-profile: the turn ends with the timed steps (after the timer's stop)
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == WARMUP + TIMED - 1:
                timed_over()
                if turns is not None:
                    turns.done()

    class ProfileOne(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == WARMUP + TIMED:
                timed_over()
                from torch.profiler import ProfilerActivity, profile

                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == WARMUP + TIMED + profiled_steps - 1:
                torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                if turns is not None:
                    turns.done()
                result["profile"] = breakdown(self.prof, profiled_steps)
                save_trace(self.prof, trace)

    module = ParallelGPTModule(cfg, lr=1e-4, min_lr=1e-5, lr_warmup_iters=1, lr_decay_iters=1000, weight_decay=0.1,
                               **module_kwargs)
    strategy = MegatronStrategy(compile=not arm.key.endswith(EAGER), enable_cuda_graph=arm.cudagraph,
                                check_for_nan_in_loss_and_grad="-nocheck" not in arm.key, **strategy_kwargs)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy,
                         plugins=[MegatronPrecision(**kwargs)], max_steps=WARMUP + TIMED + (profiled_steps if profiled else 0),
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[WaitForTurn(), timer, LeadMarks(), ProfileOne() if profiled else TimedOnly(),
                                    *([MemoryHousekeeping(manual_gc=True)] if arm.manual_gc else [])])
    trainer.fit(module, DataLoader(RandomTokens(cfg), batch_size=4, num_workers=2, pin_memory=True))
    from torch._dynamo.utils import counters

    graphs = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    return dict(loss=timer.losses[-1] if timer.losses else None, cudagraph_counters=graphs, **result)


def child(name: str, turns: Optional[Turns], profiled: bool = True, profiled_steps: int = 1,
          trace_dir: str = "") -> None:
    base = base_arm(name)
    trace = os.path.join(trace_dir, name.replace("#", "_") + ".json.gz") if trace_dir else ""
    if base.startswith("peer"):
        row = run_peer(base == "peer-fp8", turns, compile_=base != "peer-eager", profiled=profiled,
                       profiled_steps=profiled_steps, trace=trace)
    else:
        row = run_ours(base, turns, profiled=profiled, profiled_steps=profiled_steps, trace=trace)
    print("RESULT " + json.dumps(dict(arm=name, **row)), flush=True)


def arm_row(arm: str, stdout: str, stderr: str, timed_out: bool, timeout_s: float) -> dict:
    """An arm's row from its process's output: its ``RESULT`` line; cut short, its ``TIMED`` line if it got there."""
    found = [line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")]
    if found:
        return json.loads(found[-1])
    if not timed_out:
        return dict(arm=arm, error=stderr[-800:])
    timed = [line[6:] for line in stdout.splitlines() if line.startswith("TIMED ")]
    return dict(arm=arm, error=f"timeout after {timeout_s} s" +
                (" (while profiling: the timed steps are kept)" if timed else ""),
                stderr_tail=stderr[-3000:], **(json.loads(timed[-1]) if timed else {}))


def run_arms(arms: Sequence[str], timeout_s: float, profiled: bool = True,
             ready_by_s: Optional[float] = None, profiled_steps: int = 1, trace_dir: str = "") -> List[dict]:
    """Run ``arms`` together (:func:`arm_turns.run_together`: each in a process group of its own, compiling side by
    side, then taking turns for the measured steps) under one limit of ``timeout_s`` seconds (and, given
    ``ready_by_s``, killing the arms not warmed up by then); their rows, each also printed as it is read
    (``wall_s``: seconds since this call began)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'benchmarks'}:{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        runs = run_together([[sys.executable, __file__, "--child", arm, "--profiled-steps", str(profiled_steps),
                              *([] if profiled else ["--no-profile"]),
                              *(["--trace-dir", trace_dir] if trace_dir else [])] for arm in arms], Path(folder), timeout_s, env=env, cwd=ROOT, ready_by_s=ready_by_s)
    rows = []
    for arm, run in zip(arms, runs):
        if CUDAGRAPH in arm:
            print(run.stderr[-3000:], flush=True)
        row = arm_row(arm, run.stdout, run.stderr, run.rc is None, run.killed_after_s or timeout_s)
        if run.killed_after_s is not None and run.killed_after_s < timeout_s and "error" in row:
            row["error"] = f"not warmed up after {ready_by_s:g} s: killed so the others could take their turns"
        row["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="")
    p.add_argument("--arm-timeout-s", type=float, default=240.0,
                   help="seconds per arm: compiling the 1.3B model on a fresh machine takes 120-175 s")
    p.add_argument("--together", action="store_true",
                   help="start every arm at once: they compile and warm up side by side, then take turns for the "
                        "timed and profiled steps (benchmarks/end_to_end/arm_turns.py); --arm-timeout-s is then the limit for "
                        "all of them")
    p.add_argument("--no-profile", action="store_true",
                   help="stop each arm after its timed steps: no profiled step (tokens/s and memory only)")
    p.add_argument("--profiled-steps", type=int, default=1,
                   help="steps in a row in the profile (its figures per step; the gaps between steps show)")
    p.add_argument("--trace-dir", default="",
                   help="write each arm's profiled step(s) there as a gzipped Chrome trace (<arm>.json.gz)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--turns", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, Turns.parse(args.turns), profiled=not args.no_profile, profiled_steps=args.profiled_steps,
              trace_dir=args.trace_dir)
        return
    rows = []
    arms = args.arms.split(",")
    if args.profiled_steps < 1:
        p.error(f"--profiled-steps {args.profiled_steps}: profile at least one step (or use --no-profile)")
    unknown = [a for a in arms if not known_arm(a)]
    if unknown:
        p.error(f"unknown arms: {','.join(unknown)}")
    # one process group per arm, killed at the limit with its compile workers (which would hold its output pipes)
    for batch in [arms] if args.together else [[arm] for arm in arms]:
        rows += run_arms(batch, args.arm_timeout_s, profiled=not args.no_profile,
                         profiled_steps=args.profiled_steps, trace_dir=args.trace_dir)
        if args.out:   # after every arm (or all of them together): a run cut short keeps the arms it finished
            Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| arm | tokens/s | step ms | peak GiB allocated / reserved | kernels | device busy ms | idle ms | " +
          " | ".join(f for f, _ in FAMILIES) + " | other eager |")
    for r in rows:
        memory = f"{r.get('peak_mem_gib')} / {r.get('peak_reserved_gib')}"
        if "profile" not in r:
            print(f"| {r['arm']} | {r.get('tokens_per_s', '')} | {r.get('step_ms', '')} | {memory} | "
                  f"{r.get('error', '')[:200]} |")
            continue
        f = r["profile"]["families_ms"]
        print(f"| {r['arm']} | {r['tokens_per_s']} | {r['step_ms']} | {memory} | "
              f"{r['profile'].get('kernels', '')} | {r['profile']['busy_ms']} | "
              f"{r['profile']['idle_ms']} | " + " | ".join(str(f.get(k, 0)) for k, _ in FAMILIES) +
              f" | {f.get('other eager', 0)} |")


if __name__ == "__main__":
    main()
