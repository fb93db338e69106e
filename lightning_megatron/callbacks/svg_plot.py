"""A line chart written as an SVG file with the standard library only: the loss curve's picture when matplotlib is
not installed (any browser shows it).

The chart: a white ``width x height`` canvas; the plot box framed in black with light grey grid lines at "round"
tick values (1, 2, 2.5 or 5 times a power of ten) labelled outside it; each series one ``<path class="series">``
in its colour (optionally a ``<circle>`` at every point); the title and the legend above the box, the axis labels
beside it.

Data to SVG coordinates: with limits ``(x0, x1)`` and ``(y0, y1)`` and the frame ``<rect class="frame">`` from
``(left, top)`` to ``(right, bottom)``, ``x0`` maps to ``left``, ``x1`` to ``right``, ``y0`` to ``bottom`` and
``y1`` to ``top``, linearly (SVG's y grows downwards). A point with a non-finite coordinate (NaN, inf) is not drawn
and starts a new subpath (``M``) after it.
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = ["Box", "Series", "line_chart_svg", "nice_ticks", "write_line_chart_svg", "TRAIN_COLOR", "VAL_COLOR"]

TRAIN_COLOR = "#1f77b4"   # matplotlib's first two default colours (tab:blue, tab:orange)
VAL_COLOR = "#ff7f0e"
_LIMIT = 1e300   # axis limits are clamped to +-_LIMIT so that spans and paddings stay finite
_FAR = 1e9       # coordinates of far-off points are clamped to +-_FAR (the box clips them)


class Box(NamedTuple):
    """The plot box's edges in SVG coordinates."""

    left: float
    top: float
    right: float
    bottom: float


@dataclass(frozen=True)
class Series:
    """One line of the chart: ``points`` are ``(x, y)`` pairs in drawing order, ``color`` an SVG colour,
    ``label`` its legend text ("" for none; a series without finite points has none either), ``markers`` a circle
    at every drawn point."""

    points: Sequence[Tuple[float, float]]
    color: str
    label: str = ""
    markers: bool = False


def nice_ticks(lo: float, hi: float, target: int = 6, integer: bool = False) -> List[float]:
    """Tick values inside ``[lo, hi]`` spaced by 1, 2, 2.5 or 5 times a power of ten, about ``target`` intervals;
    ``integer``: a whole-number spacing of at least 1 (optimizer steps). Empty when ``lo >= hi``."""
    raw = (hi - lo) / max(target, 1)
    if not (raw > 0 and math.isfinite(raw)):
        return []
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * magnitude >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, float(round(step)))
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [k * step for k in range(first, last + 1)][:4 * target]


def _tick_label(value: float, step: float) -> str:
    """``value`` with as many decimals as the spacing ``step`` needs; ``%.3g`` for very large or small values."""
    if abs(value) < step * 1e-6:
        value = 0.0
    decimals = next((d for d in range(7) if abs(round(step, d) - step) <= step * 1e-6), None)
    return f"{value:.3g}" if decimals is None or abs(value) >= 1e6 else f"{value:.{decimals}f}"


def _limits(values: List[float], pad: float) -> Tuple[float, float]:
    """``(min, max)`` of ``values`` widened by ``pad`` of their span (a single value: by 5 % of it, at least
    0.05), within +-_LIMIT; ``(0, 1)`` for no values."""
    if not values:
        return (0.0, 1.0)
    lo, hi = (min(max(v, -_LIMIT), _LIMIT) for v in (min(values), max(values)))
    if hi <= lo:
        half = max(abs(lo), 1.0) * 0.05
        lo, hi = lo - half, hi + half
    span = hi - lo
    return (max(lo - pad * span, -_LIMIT), min(hi + pad * span, _LIMIT))


def line_chart_svg(series: Sequence[Series], width: int = 660, height: int = 396, title: str = "", xlabel: str = "",
                   ylabel: str = "", xlim: Optional[Tuple[float, float]] = None,
                   ylim: Optional[Tuple[float, float]] = None, integer_x: bool = False) -> ET.Element:
    """The ``<svg>`` element of a line chart of ``series`` (drawn in order, later ones on top).

    Args:
        width, height: the canvas in SVG user units (pixels), at least 200 x 120.
        title: text above the box at the left (the legend is above it at the right).
        xlabel, ylabel: axis labels (the y label reads from bottom to top).
        xlim, ylim: ``(low, high)`` axis limits; by default the finite data's range widened by 3 % on x and 5 %
            on y.
        integer_x: x ticks at whole numbers only.
    """
    if width < 200 or height < 120:
        raise ValueError(f"line_chart_svg: {width}x{height} is too small; give at least 200x120")
    finite = [[(float(x), float(y)) for x, y in s.points if math.isfinite(x) and math.isfinite(y)] for s in series]
    x0, x1 = tuple(map(float, xlim)) if xlim is not None else _limits([x for p in finite for x, _ in p], 0.03)
    y0, y1 = tuple(map(float, ylim)) if ylim is not None else _limits([y for p in finite for _, y in p], 0.05)
    if not (x0 < x1 and y0 < y1 and all(math.isfinite(v) for v in (x0, x1, y0, y1))):
        raise ValueError(f"line_chart_svg: limits x {x0, x1}, y {y0, y1} must be finite and increasing")
    box = Box(left=72.0, top=30.0, right=width - 16.0, bottom=height - (46.0 if xlabel else 30.0))

    def sx(x: float) -> float:
        return min(max(box.left + (x - x0) / (x1 - x0) * (box.right - box.left), -_FAR), _FAR)

    def sy(y: float) -> float:
        return min(max(box.bottom - (y - y0) / (y1 - y0) * (box.bottom - box.top), -_FAR), _FAR)

    svg = ET.Element("svg", xmlns="http://www.w3.org/2000/svg", width=str(width), height=str(height),
                     viewBox=f"0 0 {width} {height}", attrib={"font-family": "sans-serif", "font-size": "12"})
    ET.SubElement(svg, "rect", width="100%", height="100%", fill="white")
    clip = ET.SubElement(ET.SubElement(svg, "defs"), "clipPath", id="box")
    ET.SubElement(clip, "rect", x=f"{box.left}", y=f"{box.top}", width=f"{box.right - box.left}",
                  height=f"{box.bottom - box.top}")

    def text(x: float, y: float, content: str, anchor: str = "start", **attrib: str) -> None:
        ET.SubElement(svg, "text", x=f"{x:.2f}", y=f"{y:.2f}", attrib={"text-anchor": anchor, **attrib}).text = content

    xticks = nice_ticks(x0, x1, target=max(2, (width - 100) // 110), integer=integer_x)
    yticks = nice_ticks(y0, y1, target=max(2, (height - 80) // 60))
    xstep = xticks[1] - xticks[0] if len(xticks) > 1 else 1.0
    ystep = yticks[1] - yticks[0] if len(yticks) > 1 else 1.0
    grid = ET.SubElement(svg, "g", stroke="#e1e1e1", attrib={"class": "grid"})
    for v in xticks:
        ET.SubElement(grid, "line", x1=f"{sx(v):.2f}", x2=f"{sx(v):.2f}", y1=f"{box.top}", y2=f"{box.bottom + 5}")
        text(sx(v), box.bottom + 18, _tick_label(v, xstep), "middle")
    for v in yticks:
        ET.SubElement(grid, "line", x1=f"{box.left - 5}", x2=f"{box.right}", y1=f"{sy(v):.2f}", y2=f"{sy(v):.2f}")
        text(box.left - 8, sy(v) + 4, _tick_label(v, ystep), "end")

    for s, points in zip(series, finite):
        d, pen_up = [], True
        for x, y in s.points:
            if not (math.isfinite(x) and math.isfinite(y)):
                pen_up = True
                continue
            d.append(f"{'M' if pen_up else 'L'}{sx(float(x)):.2f},{sy(float(y)):.2f}")
            pen_up = False
        if d:   # a lone point is drawn by its round line cap
            ET.SubElement(svg, "path", d=" ".join(d), fill="none", stroke=s.color, attrib={
                "class": "series", "stroke-width": "2", "stroke-linecap": "round", "stroke-linejoin": "round",
                "clip-path": "url(#box)"})
        if s.markers:
            for x, y in points:
                ET.SubElement(svg, "circle", cx=f"{sx(x):.2f}", cy=f"{sy(y):.2f}", r="3.5", fill=s.color,
                              attrib={"clip-path": "url(#box)"})

    ET.SubElement(svg, "rect", x=f"{box.left}", y=f"{box.top}", width=f"{box.right - box.left}",
                  height=f"{box.bottom - box.top}", fill="none", stroke="black", attrib={"class": "frame"})
    if title:
        text(box.left, 20, title)
    if xlabel:
        text((box.left + box.right) / 2, height - 10, xlabel, "middle")
    if ylabel:
        text(16, (box.top + box.bottom) / 2, ylabel, "middle", transform=f"rotate(-90 16 {(box.top + box.bottom) / 2})")
    right = box.right   # the legend, right-aligned above the box: a stroke in the series' colour, then its label
    for s, points in reversed(list(zip(series, finite))):
        if s.label and points:
            text(right, 20, s.label, "end")
            right -= 6.6 * len(s.label) + 30
            ET.SubElement(svg, "line", x1=f"{right}", x2=f"{right + 22}", y1="16", y2="16", stroke=s.color,
                          attrib={"stroke-width": "2"})
            right -= 14
    return svg


def write_line_chart_svg(path: Union[str, Path], series: Sequence[Series], **options) -> Path:
    """Write :func:`line_chart_svg` of ``series`` (``options``: its keyword arguments) to ``path``; returns it."""
    path = Path(path)
    ET.ElementTree(line_chart_svg(series, **options)).write(path, encoding="utf-8", xml_declaration=True)
    return path
