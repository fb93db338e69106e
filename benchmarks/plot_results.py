"""Draw the measured tables of benchmarks/reports/*.md (the dated measurements behind benchmarks/RESULTS.md) as PNGs
under docs/img/ (the README shows them).

    python benchmarks/plot_results.py [--results FILE ...] [--out docs/img]

Reads the Markdown tables (nothing is re-measured) and draws, one panel per measured table:

* ``throughput.png``: tokens/s per GPU of each layout against the peers where a peer was measured (plain
  PyTorch eager / ``torch.compile``, Lightning's DTensor tensor parallelism);
* ``memory.png``: peak memory per GPU of the same runs, where the table records it.

Each panel names its report's section; the runs of one panel share a model and a machine, different panels may
not (the sections say which). Needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
Table = List[Dict[str, str]]
PEER_WORDS = ("plain", "peer", "DTensor")


def reports(root: Path = ROOT) -> List[Path]:
    """The dated report files the panels are read from, in name (date) order."""
    return sorted((root / "benchmarks" / "reports").glob("*.md"))


def read_tables(text: str) -> Dict[str, List[Table]]:
    """``{heading: [table, ...]}``: every Markdown table under each ``#`` heading, rows as ``{column: cell}``."""
    out: Dict[str, List[Table]] = {}
    heading, lines = "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            out.setdefault(heading, []).append(rows)
            continue
        i += 1
    return out


def number(cell: str) -> Optional[float]:
    """The first number of a cell (``"26,714 (22.7%)"`` -> 26714.0, ``"40.3 GiB"`` -> 40.3), None if none."""
    match = re.search(r"\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))
    return float(match.group(0).replace(",", "")) if match else None


Bar = Tuple[str, float]   # (label, value)


def _rows(tables: Dict[str, List[Table]], heading: str, index: int = 0) -> Table:
    if heading not in tables or len(tables[heading]) <= index:
        raise KeyError(f"the reports have no table {index} under the heading {heading!r}")
    return tables[heading][index]


def _columns(row: Dict[str, str], columns: Sequence[Tuple[str, str]]) -> List[Bar]:
    return [(label, number(row[col])) for col, label in columns if number(row.get(col, "")) is not None]


def _by_row(rows: Table, key: str, value: str, labels: Sequence[Tuple[Callable[[Dict[str, str]], bool], str]]
            ) -> List[Bar]:
    bars = []
    for match, label in labels:
        row = next((r for r in rows if match(r)), None)
        if row is not None and number(row.get(value, "")) is not None:
            bars.append((label, number(row[value])))
    return bars


def panels(tables: Dict[str, List[Table]]) -> Tuple[List[Tuple[str, List[Bar]]], List[Tuple[str, List[Bar]]]]:
    """(throughput panels, memory panels): ``(title, bars)`` read from the reports' tables."""
    has = lambda text: (lambda r: text in " ".join(r.values()))   # noqa: E731
    thr, mem = [], []
    one_gpu = _rows(tables, "1-GPU speed against the peers")[-1]
    thr.append(("1 GPU, 1.3B model\n(1-GPU speed against the peers)",
                _columns(one_gpu, [("ours tp=1", "ours tp=1"), ("plain eager", "plain eager (peer)")])))
    tp = _rows(tables, "Throughput, 2 GPUs")[-1]
    thr.append(("2 GPUs, tensor parallel\n(Tensor parallel: throughput)",
                _columns(tp, [("tp=2 + SP", "tp=2 + SP"), ("tp=2", "tp=2"),
                              ("Lightning DTensor tp=2", "Lightning DTensor\ntp=2 (peer)")])))
    comp = _rows(tables, "`compile=True` on one GPU")
    labels = [(has("plain PyTorch eager"), "plain eager (peer)"), (has("plain PyTorch `torch.compile`"),
              "plain compile (peer)"), (has("ours, eager"), "ours eager"),
              (lambda r: r[next(iter(r))].startswith("ours, `") and "micro" not in r[next(iter(r))], "ours compile")]
    thr.append(("1 GPU, torch.compile\n(compile=True on one GPU)", _by_row(comp, "run", "tokens/s", labels)))
    mem.append(("1 GPU, torch.compile\n(compile=True on one GPU)", _by_row(comp, "run", "peak GiB", labels)))
    pp = _rows(tables, "Throughput and bubble")
    labels = [(has("(1 GPU)"), "1 GPU"), (has("(1F1B)"), "pp=2 1F1B"), (has("(interleaved)"), "pp=2 vp=2")]
    thr.append(("pipeline parallel, 8 micro-batches\n(Pipeline parallel)", _by_row(pp, "command", "tokens/s/GPU",
                                                                                   labels)))
    mem.append(("pipeline parallel\n(Pipeline parallel)", _by_row(pp, "command", "peak mem", labels)))
    cp = _rows(tables, "Memory")[:3]
    labels = [(has("1 GPU"), "1 GPU"), (has("p2p"), "cp=2 p2p"), (has("a2a"), "cp=2 a2a")]
    thr.append(("context parallel, seq 16384\n(Context parallel: memory)", _by_row(cp, "run", "tokens/s/GPU", labels)))
    mem.append(("context parallel, seq 16384\n(Context parallel: memory)", _by_row(cp, "run", "peak mem", labels)))
    moe = _rows(tables, "Mixture of experts", 1)
    labels = [(has("--moe-loop"), "ep=1 loop"), (lambda r: "(ep=1, grouped" in r["command"], "ep=1 grouped"),
              (has("(all-to-all, grouped)"), "ep=2 all-to-all"), (has("allgather"), "ep=2 allgather")]
    thr.append(("mixture of experts\n(Mixture of experts)", _by_row(moe, "command", "tokens/s/GPU", labels)))
    mem.append(("mixture of experts\n(Mixture of experts)", _by_row(moe, "command", "peak mem", labels)))
    dopt = _rows(tables, "Distributed optimizer and data-parallel reduction", 1)
    labels = [(lambda r: r[next(iter(r))].endswith("bench_tp.py ours`"), "dp=2"),
              (has("--use-distributed-optimizer"), "dp=2 +\ndistributed optimizer")]
    thr.append(("data parallel\n(Distributed optimizer)", _by_row(dopt, "command", "tokens/s/GPU", labels)))
    mem.append(("data parallel\n(Distributed optimizer)", _by_row(dopt, "command", "peak memory", labels)))
    rec = _rows(tables, "Activation recompute on one GPU")
    labels = [(has("none"), "none"), (has("selective `core_attn` (Megatron"), "selective\ncore_attn"),
              (has("core_attn layernorm mlp"), "selective\nattn+norm+mlp"), (has("full, uniform"), "full uniform"),
              (has("full, block"), "full block 8/24")]
    thr.append(("activation recompute, 1 GPU\n(Activation recompute)", _by_row(rec, "recompute", "tokens/s", labels)))
    mem.append(("activation recompute, 1 GPU\n(Activation recompute)", _by_row(rec, "recompute", "peak GiB", labels)))
    return thr, mem


def draw(panel_list: List[Tuple[str, List[Bar]]], ylabel: str, title: str, path: Path) -> Path:
    """A grid of bar charts, peers in grey; written to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = 4
    nrows = (len(panel_list) + cols - 1) // cols
    fig = Figure(figsize=(4.2 * cols, 3.4 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    for k, (name, bars) in enumerate(panel_list):
        ax = fig.add_subplot(nrows, cols, k + 1)
        labels = [b[0] for b in bars]
        values = [b[1] for b in bars]
        colors = ["#9e9e9e" if any(w in lab for w in PEER_WORDS) else "#4c72b0" for lab in labels]
        ax.bar(range(len(values)), values, color=colors)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:,.0f}" if v >= 100 else f"{v:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=20, ha="right")
        ax.set_title(name, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylim(0, max(values) * 1.15 if values else 1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path))
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", nargs="+", default=[str(f) for f in reports()],
                   help="the markdown files to read (default: benchmarks/reports/*.md)")
    p.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    try:
        text = "\n".join(Path(f).read_text(encoding="utf-8") for f in args.results)
        thr, mem = panels(read_tables(text))
    except (KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    for path in (draw(thr, "tokens/s per GPU", "Measured throughput (benchmarks/reports; peers in grey)",
                      out / "throughput.png"),
                 draw(mem, "peak memory per GPU (GiB)", "Measured peak memory (benchmarks/reports; peers in grey)",
                      out / "memory.png")):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
