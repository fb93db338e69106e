"""One GPU, one command: ours against plain PyTorch (eager and ``torch.compile``) and torchao float8, every arm in a
process of its own, the peers and ours in the same run, ratios computed within the run; printed as a markdown table
for benchmarks/RESULTS.md (the issue "One GPU: ahead of compiled PyTorch and torchao").

    PYTHONPATH=/tmp/ao python3 benchmarks/end_to_end/one_gpu_table.py --out table.json
        [--waves "a,b,c;d,e,f,g;h,i,j,k"] [--wave-timeout-s 150,240,570] [--budget-s 570] [--turns-reserve-s 25]

(``PYTHONPATH`` makes torchao importable for the ``peer-fp8`` rows.) The arms are ``profile_step.py``'s, run with
``--no-profile`` (4 warm-up and 10 timed steps each, no profiled step); 1.3B benchmark model, seq 2048, micro-batch 4.
Rows, in this order (``#2``: a second run of the same arm; a peer's ratio base is the mean of its runs):

  peer-eager           plain PyTorch eager (``peer_baseline.py``'s model and loop), autocast bf16, fused AdamW
  peer-compile, peer-compile#2   the same under ``torch.compile``
  ours-bf16-eager      Trainer + ``MegatronStrategy()`` + ``MegatronPrecision("bf16-mixed")``     ratio: peer-eager
  ours-bf16-compile    ``MegatronStrategy(compile=True)``, bf16-mixed                              ratio: peer-compile
  ours-bf16-params-compile   + ``params_dtype=torch.bfloat16``                                     ratio: peer-compile
  peer-fp8, peer-fp8#2       torchao float8 (tensorwise) + ``torch.compile``
  ours-fp8-compile     FP8 hybrid tensorwise, ``compile=True``                                     ratio: peer-fp8
  ours-bf16p-bf16m-rem-compile-cudagraph    the docs' fastest bf16 setup (bf16 parameters with their fp32 main
                                            parameters as remainders, bf16 moments, CUDA graphs)  ratio: peer-compile
  ours-fp8-delayed-bf16p-bf16m-rem-compile-cudagraph   the docs' fastest FP8 setup (delayed, bf16 parameters with
                                            remainders, bf16 moments, CUDA graphs)                 ratio: peer-fp8

Target (the issue's): an ours row meets it at >= 1.10x its ratio base's tokens/s (the mean of the peer's runs) and
at most the peer's peak memory (the larger of its runs): peak allocated, or peak reserved for the ``-cudagraph``
rows, whose graph pools ``max_memory_allocated`` does not count.

Waves. Not all arms fit side by side into one GPU's memory (each peaks at 26-40 GiB), and run one at a time they
do not fit into 10 minutes (each compile of ours takes 60-200 s on a fresh machine). So the arms run in waves: the
arms of a wave start together, compile and warm up side by side, then take turns for their timed steps
(``profile_step.py --together``, ``arm_turns.py``); the waves run one after another. The default waves:

  1. peer-eager, ours-bf16-eager, peer-compile                     (~110 GiB: the two eager arms are the largest)
  2. ours-bf16-compile, ours-bf16-params-compile, ours-bf16p-bf16m-rem-compile-cudagraph, peer-compile#2  (~125 GiB)
  3. peer-fp8, ours-fp8-compile, ours-fp8-delayed-bf16p-bf16m-rem-compile-cudagraph, peer-fp8#2  (~105 GiB)

Each row of ours runs in the same wave as a run of its ratio base; the two runs of a compiled peer bracket the
arms of ours in turn order (before and after them). Wave 1 compiles only the peer, so it is short; the slowest
compile (the FP8 delayed CUDA-graph arm, ~200 s cold) comes last, with Inductor's cache partly warm from the waves
before, and takes what is left of the budget.

Time. A wave's limit is the smaller of its ``--wave-timeout-s`` (one number per wave; the last repeats) and what is
left of ``--budget-s`` (counted from this script's start, 10 s kept back for the table). ``--turns-reserve-s``
before a wave's limit, the arms not yet warmed up are killed (an error row each) so that the others still take
their turns. A wave with under 30 s left does not start (its arms: error rows). After every wave ``--out`` gets
the rows so far (a run cut short keeps what finished): ``meta`` (command, torch, GPU, commit), ``waves``,
``results`` (the arms' rows as ``profile_step.py`` reads them), ``table`` and ``markdown``. At the end the markdown
table is printed with the command line, the versions, the GPU, ``git rev-parse --short HEAD`` and the content
fingerprint of the measured code (:func:`source_fingerprint`: the library's and the benchmarks' Python files). A copy
of a tree can carry older git metadata than its files; ``python3 benchmarks/end_to_end/one_gpu_table.py --fingerprint`` in a
checkout prints the fingerprint of that checkout's files, to match a table to its commit.

The GPU's clock. ``nvidia-smi`` samples the GPU's SM clock, power draw and clock-event reasons every 100 ms for the
whole run (``gpu_clock.py``; nothing where it is missing), and each row's last column sums up the samples taken during
that arm's timed steps: on an H200 these steps run at the 700 W power cap, the clock well under its top and moving,
which moves every arm's tokens/s, the peers' as ours (benchmarks/RESULTS.md, "The slow step is the GPU's power
limit").
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "end_to_end"))
from gpu_clock import GpuSampler, Sample, during  # noqa: E402
from profile_step import CUDAGRAPH, base_arm, known_arm, run_arms  # noqa: E402

TARGET = 1.10


@dataclass(frozen=True)
class Row:
    """One row of the table: the arm it runs (``profile_step.py``'s name, ``#2`` for a second run), what it is, and
    the peer its ratio is taken against (None for the peers)."""

    arm: str
    what: str
    against: Optional[str] = None


TABLE = (
    Row("peer-eager", "plain PyTorch eager, autocast bf16, fused AdamW (peer)"),
    Row("peer-compile", "plain PyTorch `torch.compile`, autocast bf16, fused AdamW (peer)"),
    Row("peer-compile#2", "the same, second run"),
    Row("ours-bf16-eager", "ours: Trainer + `MegatronStrategy()` + `MegatronPrecision(\"bf16-mixed\")`, no compile",
        "peer-eager"),
    Row("ours-bf16-compile", "ours, `compile=True`, bf16-mixed", "peer-compile"),
    Row("ours-bf16-params-compile", "ours, `compile=True`, bf16-mixed, `params_dtype=torch.bfloat16`",
        "peer-compile"),
    Row("peer-fp8", "torchao float8 (tensorwise) + `torch.compile` (peer)"),
    Row("peer-fp8#2", "the same, second run"),
    Row("ours-fp8-compile", "ours, FP8 hybrid tensorwise, `compile=True`", "peer-fp8"),
    Row("ours-bf16p-bf16m-rem-compile-cudagraph",
        "ours, bf16 parameters (main parameters as remainders) + bf16 moments, `compile=True`, layers as CUDA graphs "
        "(docs' fastest bf16)",
        "peer-compile"),
    Row("ours-fp8-delayed-bf16p-bf16m-rem-compile-cudagraph",
        "ours, FP8 delayed, bf16 parameters (main parameters as remainders) + bf16 moments, `compile=True`, layers as "
        "CUDA graphs (docs' fastest FP8)",
        "peer-fp8"),
)
TABLE_ARMS = tuple(r.arm for r in TABLE)
DEFAULT_WAVES = (
    ("peer-eager", "ours-bf16-eager", "peer-compile"),
    ("ours-bf16-compile", "ours-bf16-params-compile", "ours-bf16p-bf16m-rem-compile-cudagraph", "peer-compile#2"),
    ("peer-fp8", "ours-fp8-compile", "ours-fp8-delayed-bf16p-bf16m-rem-compile-cudagraph", "peer-fp8#2"),
)
DEFAULT_WAVE_TIMEOUTS = (150.0, 240.0, 570.0)
END_RESERVE_S = 10.0   # kept back from the budget for writing the table
MIN_WAVE_S = 30.0      # a wave with less time left than this does not start


def waves_spec(waves: Sequence[Sequence[str]]) -> str:
    return ";".join(",".join(w) for w in waves)


def parse_waves(spec: str) -> List[List[str]]:
    """``"a,b;c,d"`` -> ``[["a", "b"], ["c", "d"]]``; the waves must hold every row of the table exactly once."""
    waves = [[a.strip() for a in w.split(",") if a.strip()] for w in spec.split(";")]
    waves = [w for w in waves if w]
    arms = [a for w in waves for a in w]
    extra = [a for a in arms if a not in TABLE_ARMS]
    missing = [a for a in TABLE_ARMS if a not in arms]
    twice = sorted({a for a in arms if arms.count(a) > 1})
    problems = ([f"not in the table: {','.join(extra)}"] if extra else []) + \
               ([f"missing: {','.join(missing)}"] if missing else []) + \
               ([f"more than once: {','.join(twice)}"] if twice else [])
    if problems:
        raise ValueError("--waves must hold every row of the table once; " + "; ".join(problems))
    return waves


def parse_timeouts(spec: str, n: int) -> List[float]:
    """``"150,240"`` for 3 waves -> ``[150, 240, 240]`` (the last number repeats)."""
    values = [float(v) for v in spec.split(",") if v.strip()]
    if not values:
        raise ValueError("--wave-timeout-s needs at least one number")
    return [values[min(i, len(values) - 1)] for i in range(n)]


def _usable(r: Optional[dict]) -> bool:
    """Whether a result has its timed figures (an arm killed after its timed steps still has them)."""
    return r is not None and isinstance(r.get("tokens_per_s"), (int, float))


def _short(error: str) -> str:
    """An error's last non-empty line (an exception's message), on one line, at most 160 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else "failed")[:160]


def table_rows(results: Sequence[dict], samples: Sequence[Sample] = ()) -> List[dict]:
    """The table's rows, in the table's order, from the arms' result rows (``profile_step.arm_row``'s: ``arm``,
    ``tokens_per_s``, ``step_ms``, ``peak_mem_gib``, ``peak_reserved_gib``, ``timed_from`` / ``timed_to``, or
    ``error``). A row of ours gets its ratio to the mean tokens/s of its peer's runs that finished, and whether it
    meets the target (>= 1.10x at <= the peer's peak memory: allocated, or reserved for the ``-cudagraph`` arms). Each
    row with timed figures gets ``gpu``: the GPU clock ``samples`` taken during its timed steps, summed up
    (:func:`gpu_clock.during`; None without samples). A missing or failed arm is a row with ``error`` set (and no
    ratio), never an exception."""
    by_arm: Dict[str, dict] = {}
    for r in results:
        if isinstance(r, dict) and "arm" in r:
            by_arm[r["arm"]] = r
    out = []
    for row in TABLE:
        r = by_arm.get(row.arm)
        t = dict(arm=row.arm, what=row.what, against=row.against, tokens_per_s=None, step_ms=None,
                 peak_mem_gib=None, peak_reserved_gib=None, ratio=None, base_runs=0, meets=None, target="-",
                 error=None)
        if not _usable(r):
            t["error"] = "not run" if r is None else _short(r.get("error", "no timed figures"))
            out.append(t)
            continue
        for key in ("tokens_per_s", "step_ms", "peak_mem_gib", "peak_reserved_gib"):
            t[key] = r.get(key)
        t["gpu"] = during(samples, r.get("timed_from"), r.get("timed_to"))
        if r.get("error"):   # killed after its timed steps: the figures stand
            t["note"] = _short(r["error"])
        if row.against is not None:
            peers = [by_arm.get(p.arm) for p in TABLE if p.against is None and base_arm(p.arm) == row.against]
            done = [p for p in peers if _usable(p)]
            t["base_runs"], t["peer_runs"] = len(done), len(peers)
            if not done:
                t["target"] = f"n/a: no {row.against} run finished"
            else:
                base = sum(p["tokens_per_s"] for p in done) / len(done)
                key = "peak_reserved_gib" if row.arm.endswith(CUDAGRAPH) else "peak_mem_gib"
                peer_mem = max((p.get(key) for p in done if p.get(key) is not None), default=None)
                mem = t[key]
                t["ratio"] = t["tokens_per_s"] / base
                t["base_tokens_per_s"] = round(base)
                t["memory_compared"] = key
                t["peer_memory_gib"] = peer_mem
                fast = t["ratio"] >= TARGET
                small = mem is not None and peer_mem is not None and mem <= peer_mem
                t["meets"] = fast and small
                kind = "reserved" if key == "peak_reserved_gib" else "allocated"
                t["target"] = (f"{'yes' if t['meets'] else 'no'}: {t['ratio']:.3f}x {'>=' if fast else '<'} "
                               f"{TARGET:.2f}x, {mem} {'<=' if small else '>'} {peer_mem} GiB {kind}")
        out.append(t)
    return out


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def gpu_cell(gpu: Optional[dict]) -> str:
    """A row's GPU clock summary as a cell: ``1,660 (1,425) MHz, 688 W, 100% slowed``; ``-`` without samples."""
    if not gpu:
        return "-"
    return (f"{gpu['sm_mhz']:,} ({gpu['sm_mhz_min']:,}) MHz, {gpu['watts']} W, {gpu['slowed']:.0%} slowed")


def markdown(rows: Sequence[dict]) -> str:
    """The table as markdown: a header, then exactly one line per row."""
    lines = ["| row | what | tokens/s | step ms | peak GiB allocated / reserved | ratio (same run) | "
             f"target: >= {TARGET:.2f}x at <= the peer's peak memory | GPU in its timed steps: SM clock mean (lowest), "
             "power, share of samples slowed by the GPU (power cap, heat) |",
             "|---|---|---|---|---|---|---|---|"]
    for t in rows:
        if t["error"] is not None:
            lines.append(f"| {_cell(t['arm'])} | {_cell(t['what'])} | failed: {_cell(t['error'])} | | | | - | - |")
            continue
        ratio = "-"
        if t["ratio"] is not None:
            ratio = f"**{t['ratio']:.3f}x** {t['against']}"
            if t["peer_runs"] > 1:
                ratio += f" (mean of {t['base_runs']} of {t['peer_runs']} runs)" if t["base_runs"] < t["peer_runs"] \
                    else f" (mean of {t['base_runs']} runs)"
        elif t["against"] is not None:
            ratio = f"n/a (no {t['against']} run)"
        what = t["what"] + (f" ({_cell(t['note'])})" if t.get("note") else "")
        lines.append(f"| {_cell(t['arm'])} | {_cell(what)} | {t['tokens_per_s']:,} | {t['step_ms']} | "
                     f"{t['peak_mem_gib']} / {t['peak_reserved_gib']} | {ratio} | {_cell(t['target'])} | "
                     f"{gpu_cell(t.get('gpu'))} |")
    return "\n".join(lines)


def peer_spread(rows: Sequence[dict]) -> List[str]:
    """One line per peer run twice: both runs' tokens/s and how far apart they are."""
    out = []
    for peer in sorted({base_arm(t["arm"]) for t in rows if t["against"] is None}):
        runs = [t for t in rows if t["against"] is None and base_arm(t["arm"]) == peer]
        got = [t["tokens_per_s"] for t in runs if t["tokens_per_s"] is not None]
        if len(runs) > 1 and len(got) > 1:
            spread = (max(got) - min(got)) / (sum(got) / len(got))
            out.append(f"- {peer}: {len(got)} runs, " + " and ".join(f"{g:,}" for g in got) +
                       f" tokens/s (spread {spread:.1%} of their mean)")
    return out


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "importable, version unknown" if importlib.util.find_spec(dist) else None


def _output(cmd: Sequence[str]) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


#: the folders (under the repository root) whose Python files make up the measured code
FINGERPRINTED = ("lightning_megatron", "benchmarks")


def source_fingerprint(root: Path = ROOT, folders: Sequence[str] = FINGERPRINTED) -> str:
    """12 hex digits of a SHA-1 over every ``*.py`` file under ``folders`` of ``root``: each file's path relative to
    ``root`` and its bytes, in path order (caches and other files left out). The same files give the same
    fingerprint wherever they are; any change to one of them, a file added or removed, gives another."""
    digest = hashlib.sha1()
    files = sorted(f for folder in folders for f in (root / folder).rglob("*.py") if "__pycache__" not in f.parts)
    for f in files:
        data = f.read_bytes()
        digest.update(f"{f.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:12]


def meta(argv: Sequence[str]) -> dict:
    """The command line (with ``PYTHONPATH`` when set), versions, GPU and commit; nothing here touches the GPU."""
    command = shlex.join(["python3", Path(__file__).resolve().relative_to(ROOT).as_posix(), *argv[1:]])
    if os.environ.get("PYTHONPATH"):
        command = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {command}"
    gpu = _output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    status = _output(["git", "status", "--porcelain", "--untracked-files=no"])
    return dict(command=command, torch=_version("torch"), lightning=_version("lightning"),
                torchao=_version("torchao"), python=sys.version.split()[0], gpu=gpu,
                commit=_output(["git", "rev-parse", "--short", "HEAD"]), uncommitted_changes=bool(status),
                fingerprint=source_fingerprint(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def run_waves(waves: Sequence[Sequence[str]], timeouts: Sequence[float], budget_s: float, turns_reserve_s: float,
              write: Callable[[List[dict], List[dict]], None],
              runner: Optional[Callable[..., List[dict]]] = None,
              clock: Callable[[], float] = time.perf_counter, start: Optional[float] = None) -> tuple:
    """Run the waves one after another (``runner``: :func:`profile_step.run_arms`, timed steps only); returns all
    arms' result rows and the waves' log (arms, limit, wall time), and hands both to ``write`` after each wave. A
    wave's limit is the smaller of its timeout and what is left of ``budget_s`` (less :data:`END_RESERVE_S`); its arms
    not warmed up ``turns_reserve_s`` before that are killed; a wave with under :data:`MIN_WAVE_S` left does not start
    (its arms get error rows)."""
    start = clock() if start is None else start
    runner = run_arms if runner is None else runner
    results: List[dict] = []
    log: List[dict] = []
    for i, (wave, timeout) in enumerate(zip(waves, timeouts)):
        left = budget_s - (clock() - start) - END_RESERVE_S
        limit = min(timeout, left)
        began = clock()
        if limit < MIN_WAVE_S:
            rows = [dict(arm=a, error=f"not run: {max(left, 0):.0f} s of the {budget_s:g} s budget left")
                    for a in wave]
            limit = 0.0
        else:
            print(f"wave {i + 1}/{len(waves)}: {','.join(wave)} (limit {limit:.0f} s)", flush=True)
            rows = runner(list(wave), limit, profiled=False, ready_by_s=max(limit - turns_reserve_s, limit / 2))
        results += rows
        log.append(dict(wave=i + 1, arms=list(wave), limit_s=round(limit, 1),
                        wall_s=round(clock() - began, 1)))
        write(results, log)
    return results, log


def report(info: dict, results: Sequence[dict], log: Sequence[dict], samples: Sequence[Sample] = ()) -> str:
    """The text to paste into RESULTS.md: how it was run, the table (with the GPU clock ``samples``), the peers'
    spread."""
    rows = table_rows(results, samples)
    commit = (info.get("commit") or "unknown") + (" (with uncommitted changes)" if info.get("uncommitted_changes")
                                                  else "")
    head = [f"`{info['command']}`", "",
            f"{info.get('date')}, GPU {info.get('gpu')}, torch {info.get('torch')}, lightning "
            f"{info.get('lightning')}, torchao {info.get('torchao')}, commit {commit}, code fingerprint "
            f"{info.get('fingerprint')}.",
            "Waves (arms compiled side by side, then timed in turns): " +
            "; ".join(f"{w['wave']}. {','.join(w['arms'])} ({w['wall_s']:g} s of {w['limit_s']:g} s)" for w in log) +
            ".", ""]
    return "\n".join(head + [markdown(rows), ""] + peer_spread(rows))


def main(argv: Optional[Sequence[str]] = None) -> None:
    start = time.perf_counter()
    argv = list(sys.argv if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="JSON written after every wave")
    p.add_argument("--waves", default=waves_spec(DEFAULT_WAVES),
                   help="waves separated by ';', arms by ',' (every row of the table once); default: %(default)s")
    p.add_argument("--wave-timeout-s", default=",".join(f"{t:g}" for t in DEFAULT_WAVE_TIMEOUTS),
                   help="seconds per wave, one number per wave (the last repeats); default: %(default)s")
    p.add_argument("--budget-s", type=float, default=570.0,
                   help="seconds for the whole run, this script's start to the table (default: %(default)s)")
    p.add_argument("--turns-reserve-s", type=float, default=25.0,
                   help="seconds before a wave's limit kept for the timed turns: arms not warmed up by then are "
                        "killed (default: %(default)s)")
    p.add_argument("--fingerprint", action="store_true",
                   help="print the content fingerprint of this checkout's measured code and exit (no GPU needed)")
    args = p.parse_args(argv[1:])
    if args.fingerprint:
        print(source_fingerprint())
        return
    try:
        waves = parse_waves(args.waves)
        timeouts = parse_timeouts(args.wave_timeout_s, len(waves))
    except ValueError as e:
        p.error(str(e))
    for arm in TABLE_ARMS:
        assert known_arm(arm), arm
    info = meta(argv)
    sampler = GpuSampler()
    info["gpu_clock_sampled"] = sampler.start()
    print(json.dumps(info), flush=True)

    def write(results: List[dict], log: List[dict]) -> None:
        if args.out:
            rows = table_rows(results, sampler.samples())
            Path(args.out).write_text(json.dumps(dict(meta=info, waves=log, results=results, table=rows,
                                                      markdown=markdown(rows)), indent=1))

    try:
        results, log = run_waves(waves, timeouts, args.budget_s, args.turns_reserve_s, write, start=start)
        info["wall_s"] = round(time.perf_counter() - start, 1)
        write(results, log)
    finally:
        samples = sampler.stop()
    print("\n" + report(info, results, log, samples) + f"\n\nwall {info['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
