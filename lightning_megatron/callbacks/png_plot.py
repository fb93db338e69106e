"""A line chart drawn into a PNG with the standard library only (``zlib`` and ``struct``): the loss curve's picture
when matplotlib is not installed.

The chart is an RGB image on a white background: a black frame around the plot box, light grey grid lines and
outward tick marks at "round" values (1, 2, 2.5 or 5 times a power of ten) labelled with a built-in 5x7 bitmap font,
each series as a polyline of its own colour (optionally with round markers at its points), a title and a legend in
the top margin and the axis labels outside the box. No anti-aliasing: every pixel of a series has exactly the
series' colour.

Data to pixels: with limits ``(x0, x1)`` and ``(y0, y1)`` and the plot box's frame at columns ``box.left`` /
``box.right`` and rows ``box.top`` / ``box.bottom``, ``x0`` maps to column ``box.left``, ``x1`` to ``box.right``,
``y0`` to row ``box.bottom`` and ``y1`` to row ``box.top``, linearly, rounded to the nearest pixel. Points with a
non-finite coordinate (NaN, inf) are not drawn and break the polyline there; a point without a drawn neighbour is
drawn as a dot.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = ["Box", "Canvas", "Chart", "Series", "encode_png", "nice_ticks", "render_line_chart", "text_width",
           "write_line_chart_png", "BLACK", "WHITE", "GRID", "TRAIN_COLOR", "VAL_COLOR"]

RGB = Tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
GRID: RGB = (225, 225, 225)
TEXT: RGB = (30, 30, 30)
TRAIN_COLOR: RGB = (31, 119, 180)   # matplotlib's first two default colours (tab:blue, tab:orange)
VAL_COLOR: RGB = (255, 127, 14)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_LIMIT = 1e300   # axis limits are clamped to +-_LIMIT so that spans and paddings stay finite


def encode_png(width: int, height: int, rgb: Union[bytes, bytearray]) -> bytes:
    """Encode an image as PNG bytes (8-bit RGB, no interlace, filter type 0 on every row).

    Args:
        width, height: the image size in pixels (both >= 1).
        rgb: ``width * height * 3`` bytes, row by row from the top, each pixel ``R, G, B``.

    Returns:
        the PNG file's bytes: signature, ``IHDR``, one ``IDAT`` (zlib level 9) and ``IEND``.
    """
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(f"encode_png: {len(rgb)} bytes do not make a {width}x{height} RGB image")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


# A 5-pixel-wide font: each glyph is up to 9 rows ('#' = ink); rows 0-6 hold digits and capital-height strokes,
# lowercase letters sit on rows 2-6 with descenders on rows 7-8. Capitals are drawn as lowercase; a character
# without a glyph is drawn as a space.
_GLYPHS: Dict[str, Tuple[str, ...]] = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    ".": (".....", ".....", ".....", ".....", ".....", ".##..", ".##.."),
    ",": (".....", ".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."),
    ":": (".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."),
    "-": (".....", ".....", ".....", ".###.", ".....", ".....", "....."),
    "+": (".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."),
    "=": (".....", ".....", "#####", ".....", "#####", ".....", "....."),
    "_": (".....", ".....", ".....", ".....", ".....", ".....", ".....", "#####"),
    "/": (".....", "....#", "...#.", "..#..", ".#...", "#....", "....."),
    "(": ("...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."),
    ")": (".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."),
    "%": ("##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"),
    "a": (".....", ".....", ".###.", "....#", ".####", "#...#", ".####"),
    "b": ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "####."),
    "c": (".....", ".....", ".###.", "#....", "#....", "#...#", ".###."),
    "d": ("....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"),
    "e": (".....", ".....", ".###.", "#...#", "#####", "#....", ".###."),
    "f": ("..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."),
    "g": (".....", ".....", ".####", "#...#", "#...#", "#...#", ".####", "....#", ".###."),
    "h": ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "i": ("..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."),
    "j": ("...#.", ".....", "..##.", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."),
    "k": ("#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."),
    "l": (".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "m": (".....", ".....", "##.#.", "#.#.#", "#.#.#", "#...#", "#...#"),
    "n": (".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "o": (".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."),
    "p": (".....", ".....", "####.", "#...#", "#...#", "#...#", "####.", "#....", "#...."),
    "q": (".....", ".....", ".####", "#...#", "#...#", "#...#", ".####", "....#", "....#"),
    "r": (".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."),
    "s": (".....", ".....", ".###.", "#....", ".###.", "....#", "####."),
    "t": (".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."),
    "u": (".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"),
    "v": (".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "w": (".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#."),
    "x": (".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"),
    "y": (".....", ".....", "#...#", "#...#", "#...#", "#...#", ".####", "....#", ".###."),
    "z": (".....", ".....", "#####", "...#.", "..#..", ".#...", "#####"),
}
GLYPH_ADVANCE = 6   # pixels from one character to the next (5 of glyph, 1 of space)
GLYPH_HEIGHT = 9    # rows of a line of text (7 above the baseline, 2 of descender)


class Box(NamedTuple):
    """The plot box: the frame's columns ``left`` / ``right`` and rows ``top`` / ``bottom`` (inclusive pixels)."""

    left: int
    top: int
    right: int
    bottom: int


class Canvas:
    """An RGB image in memory with the few drawing operations a line chart needs; pixels outside the image (or
    outside a ``clip`` box where one is given) are not drawn.

    Args:
        width, height: size in pixels.
        background: the colour every pixel starts with.
    """

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"Canvas: size {width}x{height} must be at least 1x1")
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: RGB, clip: Optional[Box] = None) -> None:
        """Paint pixel ``(x, y)`` (column, row from the top-left) with ``color`` if it lies on the image (and
        inside ``clip``)."""
        if clip is not None and not (clip.left <= x <= clip.right and clip.top <= y <= clip.bottom):
            return
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> RGB:
        """The ``(R, G, B)`` of pixel ``(x, y)``."""
        i = 3 * (y * self.width + x)
        return (self.pixels[i], self.pixels[i + 1], self.pixels[i + 2])

    def line(self, x0: float, y0: float, x1: float, y1: float, color: RGB, width: int = 1,
             clip: Optional[Box] = None) -> None:
        """Draw the segment from ``(x0, y0)`` to ``(x1, y1)`` (pixel coordinates, may be fractional or far off the
        image) with Bresenham's algorithm after clipping it to ``clip`` (or to the image). ``width`` > 1 stamps a
        ``width`` x ``width`` square at every pixel, the pixel itself being its top-left one."""
        box = clip if clip is not None else Box(0, 0, self.width - 1, self.height - 1)
        clipped = _clip_segment(x0, y0, x1, y1, box)
        if clipped is None:
            return
        ax, ay, bx, by = (int(round(v)) for v in clipped)
        dx, dy = abs(bx - ax), -abs(by - ay)
        sx, sy = (1 if ax < bx else -1), (1 if ay < by else -1)
        err = dx + dy
        while True:
            for oy in range(width):
                for ox in range(width):
                    self.set(ax + ox, ay + oy, color, clip)
            if ax == bx and ay == by:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                ax += sx
            if e2 <= dx:
                err += dx
                ay += sy

    def disc(self, cx: int, cy: int, radius: int, color: RGB, clip: Optional[Box] = None) -> None:
        """Fill the disc of ``radius`` pixels around ``(cx, cy)``."""
        for oy in range(-radius, radius + 1):
            for ox in range(-radius, radius + 1):
                if ox * ox + oy * oy <= radius * radius + radius:
                    self.set(cx + ox, cy + oy, color, clip)

    def text(self, x: int, y: int, text: str, color: RGB = TEXT, vertical: bool = False) -> None:
        """Write ``text`` in the built-in 5x7 font with the top-left of its first glyph at ``(x, y)``; with
        ``vertical`` the text is turned a quarter turn anticlockwise (read from bottom to top) and ``(x, y)`` is
        the bottom-left of its first glyph."""
        for i, char in enumerate(text):
            rows = _GLYPHS.get(char, _GLYPHS.get(char.lower(), ()))
            for gy, row in enumerate(rows):
                for gx, ink in enumerate(row):
                    if ink == "#":
                        along = i * GLYPH_ADVANCE + gx
                        if vertical:
                            self.set(x + gy, y - along, color)
                        else:
                            self.set(x + along, y + gy, color)

    def to_png(self) -> bytes:
        """The canvas as PNG bytes (:func:`encode_png`)."""
        return encode_png(self.width, self.height, self.pixels)


def text_width(text: str) -> int:
    """Pixels that ``text`` spans in the built-in font (``Canvas.text``)."""
    return max(len(text) * GLYPH_ADVANCE - 1, 0)


def _clip_segment(x0: float, y0: float, x1: float, y1: float,
                  box: Box) -> Optional[Tuple[float, float, float, float]]:
    """Liang-Barsky: the part of the segment inside ``box`` (half a pixel of slack on each side), or None."""
    dx, dy = x1 - x0, y1 - y0
    t0, t1 = 0.0, 1.0
    for p, q in ((-dx, x0 - (box.left - 0.5)), (dx, (box.right + 0.5) - x0),
                 (-dy, y0 - (box.top - 0.5)), (dy, (box.bottom + 0.5) - y0)):
        if p == 0:
            if q < 0:
                return None
            continue
        t = q / p
        if p < 0:
            t0 = max(t0, t)
        else:
            t1 = min(t1, t)
        if t0 > t1:
            return None
    return (x0 + t0 * dx, y0 + t0 * dy, x0 + t1 * dx, y0 + t1 * dy)


def nice_ticks(lo: float, hi: float, target: int = 6, integer: bool = False) -> List[float]:
    """Tick values inside ``[lo, hi]`` spaced by 1, 2, 2.5 or 5 times a power of ten, about ``target`` of them.

    Args:
        lo, hi: the axis limits (finite, ``lo < hi``).
        target: the number of intervals aimed at.
        integer: spacing of at least 1 and a whole number (for optimizer steps).
    """
    raw = (hi - lo) / max(target, 1)
    if not (raw > 0 and math.isfinite(raw)):
        return []
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * magnitude >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, float(round(step))) if step >= 1 else 1.0
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [k * step for k in range(first, last + 1)][:4 * target]


def _tick_label(value: float, step: float) -> str:
    """``value`` with as many decimals as the tick spacing ``step`` needs; ``%.3g`` for very large or small."""
    if abs(value) < step * 1e-6:
        value = 0.0
    decimals = next((d for d in range(0, 7) if abs(round(step, d) - step) <= step * 1e-6), None)
    if decimals is None or abs(value) >= 1e6:
        return f"{value:.3g}"
    return f"{value:.{decimals}f}"


@dataclass
class Series:
    """One line of the chart.

    Args:
        points: ``(x, y)`` pairs in drawing order; pairs with a non-finite coordinate are skipped and break the line.
        color: the ``(R, G, B)`` of its line, markers and legend entry.
        label: its legend text ("" for no legend entry; a series without points has none either).
        markers: a filled disc of ``marker_radius`` at every drawn point.
        line_width: the line's thickness in pixels.
        marker_radius: the markers' radius in pixels.
    """

    points: Sequence[Tuple[float, float]]
    color: RGB
    label: str = ""
    markers: bool = False
    line_width: int = 2
    marker_radius: int = 3


class Chart(NamedTuple):
    """A rendered chart: the ``canvas``, the plot ``box`` (frame pixels) and the axis limits ``xlim`` / ``ylim``
    that map onto the box's edges."""

    canvas: Canvas
    box: Box
    xlim: Tuple[float, float]
    ylim: Tuple[float, float]


def _finite(points: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    return [(float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y)]


def _limits(values: List[float], pad: float) -> Tuple[float, float]:
    """``(min, max)`` of ``values`` widened by ``pad`` of their span (or around a single value), within +-_LIMIT."""
    if not values:
        return (0.0, 1.0)
    lo, hi = (min(max(v, -_LIMIT), _LIMIT) for v in (min(values), max(values)))
    if hi <= lo:
        half = max(abs(lo), 1.0) * 0.05
        lo, hi = lo - half, hi + half
    span = hi - lo
    return (max(lo - pad * span, -_LIMIT), min(hi + pad * span, _LIMIT))


def render_line_chart(series: Sequence[Series], width: int = 660, height: int = 396, title: str = "",
                      xlabel: str = "", ylabel: str = "", xlim: Optional[Tuple[float, float]] = None,
                      ylim: Optional[Tuple[float, float]] = None, integer_x: bool = False) -> Chart:
    """Draw ``series`` as a line chart on a new white :class:`Canvas` (the module docstring describes the chart and
    how data map to pixels).

    Args:
        series: the lines, drawn in order (later ones on top).
        width, height: image size in pixels (at least 200 x 120).
        title: text at the left of the top margin (the legend takes the top margin's right side).
        xlabel, ylabel: axis labels (the y label reads from bottom to top).
        xlim, ylim: ``(low, high)`` axis limits; by default the finite data's range widened by 3 % on x and 5 %
            on y (a single value: +-5 % of it, at least +-0.05).
        integer_x: x ticks at whole numbers only (optimizer steps).

    Returns:
        a :class:`Chart` with the canvas, the plot box and the limits used.
    """
    if width < 200 or height < 120:
        raise ValueError(f"render_line_chart: {width}x{height} is too small (at least 200x120)")
    finite = [_finite(s.points) for s in series]
    xs = [x for pts in finite for x, _ in pts]
    ys = [y for pts in finite for _, y in pts]
    x0, x1 = tuple(map(float, xlim)) if xlim is not None else _limits(xs, 0.03)
    y0, y1 = tuple(map(float, ylim)) if ylim is not None else _limits(ys, 0.05)
    if not (x0 < x1 and y0 < y1 and all(math.isfinite(v) for v in (x0, x1, y0, y1))):
        raise ValueError(f"render_line_chart: limits x {x0, x1}, y {y0, y1} must be finite and increasing")

    xticks = nice_ticks(x0, x1, target=max(2, (width - 100) // 110), integer=integer_x)
    yticks = nice_ticks(y0, y1, target=max(2, (height - 80) // 60))
    xstep = xticks[1] - xticks[0] if len(xticks) > 1 else 1.0
    ystep = yticks[1] - yticks[0] if len(yticks) > 1 else 1.0
    ylabels = [_tick_label(v, ystep) for v in yticks]
    label_w = max((text_width(t) for t in ylabels), default=0)
    box = Box(left=min(width // 3, label_w + 8 + (GLYPH_HEIGHT + 6 if ylabel else 4)), top=GLYPH_HEIGHT + 16,
              right=width - 16, bottom=height - (GLYPH_HEIGHT * 2 + 20 if xlabel else GLYPH_HEIGHT + 16))

    def px(x: float) -> float:   # far-off points are held at 1e9 pixels (an overflow would be inf)
        return min(max(box.left + (x - x0) / (x1 - x0) * (box.right - box.left), -1e9), 1e9)

    def py(y: float) -> float:
        return min(max(box.bottom - (y - y0) / (y1 - y0) * (box.bottom - box.top), -1e9), 1e9)

    canvas = Canvas(width, height)
    inside = Box(box.left + 1, box.top + 1, box.right - 1, box.bottom - 1)
    for v in xticks:
        canvas.line(round(px(v)), box.top, round(px(v)), box.bottom, GRID, clip=inside)
    for v in yticks:
        canvas.line(box.left, round(py(v)), box.right, round(py(v)), GRID, clip=inside)

    for s in series:
        runs: List[List[Tuple[float, float]]] = [[]]
        for x, y in s.points:
            if math.isfinite(x) and math.isfinite(y):
                runs[-1].append((px(float(x)), py(float(y))))
            elif runs[-1]:
                runs.append([])
        for run in runs:
            if len(run) == 1:
                canvas.disc(round(run[0][0]), round(run[0][1]), max(1, s.line_width - 1), s.color, clip=box)
            for (ax, ay), (bx, by) in zip(run, run[1:]):
                canvas.line(ax, ay, bx, by, s.color, width=s.line_width, clip=box)
            if s.markers:
                for x, y in run:
                    canvas.disc(round(x), round(y), s.marker_radius, s.color, clip=box)

    # the frame, the tick marks and their labels
    for x in (box.left, box.right):
        canvas.line(x, box.top, x, box.bottom, BLACK)
    for y in (box.top, box.bottom):
        canvas.line(box.left, y, box.right, y, BLACK)
    for v in xticks:
        x = round(px(v))
        canvas.line(x, box.bottom + 1, x, box.bottom + 5, BLACK)
        label = _tick_label(v, xstep)
        canvas.text(x - text_width(label) // 2, box.bottom + 8, label)
    for v, label in zip(yticks, ylabels):
        y = round(py(v))
        canvas.line(box.left - 5, y, box.left - 1, y, BLACK)
        canvas.text(box.left - 8 - text_width(label), y - 3, label)

    if xlabel:
        canvas.text((box.left + box.right - text_width(xlabel)) // 2, box.bottom + GLYPH_HEIGHT + 12, xlabel)
    if ylabel:
        canvas.text(3, (box.top + box.bottom + text_width(ylabel)) // 2, ylabel, vertical=True)
    if title:
        canvas.text(box.left, 6, title)
    # the legend, right-aligned in the top margin: a short stroke (and marker) in each series' colour, then its label
    x = box.right
    for s in reversed([s for s in series if s.label and len(s.points)]):
        x -= text_width(s.label)
        canvas.text(x, 6, s.label)
        x -= 24
        canvas.line(x, 9, x + 18, 9, s.color, width=s.line_width)
        if s.markers:
            canvas.disc(x + 9, 9, s.marker_radius, s.color)
        x -= 14
    return Chart(canvas, box, (x0, x1), (y0, y1))


def write_line_chart_png(path: Union[str, Path], series: Sequence[Series], **options) -> Path:
    """Render ``series`` with :func:`render_line_chart` (``options`` are its keyword arguments) and write the PNG
    to ``path``; returns ``path`` as a :class:`~pathlib.Path`."""
    path = Path(path)
    path.write_bytes(render_line_chart(series, **options).canvas.to_png())
    return path
