"""The loss-curve PNG without matplotlib (``lightning_megatron.callbacks.png_plot``): the file is a valid PNG whose
pixels are decoded here with zlib (white background, both series in their colours), data land on the pixels the
documented mapping gives, odd inputs (NaN, inf, one point, no validation) draw without error, and
``plot_loss_curve`` / ``LossCurve`` use this renderer when matplotlib cannot be imported (matplotlib when it can)."""
from __future__ import annotations

import math
import struct
import sys
import zlib
from types import SimpleNamespace

import pytest

from lightning_megatron.callbacks import loss_curve
from lightning_megatron.callbacks.png_plot import (BLACK, TRAIN_COLOR, VAL_COLOR, WHITE, Series, encode_png,
                                                   nice_ticks, render_line_chart, write_line_chart_png)
from lightning_megatron.utils.optional import MATPLOTLIB


def decode_png(data: bytes):
    """``(width, height, colour_type, chunk_types, rows)`` of a PNG; ``rows`` (8-bit RGB, filter 0 only) is None for
    other formats. Checks the signature and every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data) and chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    kinds = [k for k, _ in chunks]
    if (depth, colour, interlace) != (8, 2, 0):
        return width, height, colour, kinds, None
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0, f"row {y}: filter type {line[0]}"
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(width)])
    return width, height, colour, kinds, rows


def count(rows, colour):
    return sum(pixel == colour for row in rows for pixel in row)


def near(canvas, x, y, colour, radius=1):
    """Whether a pixel within ``radius`` of ``(x, y)`` has ``colour``."""
    return any(canvas.get(x + dx, y + dy) == colour
               for dx in range(-radius, radius + 1) for dy in range(-radius, radius + 1))


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as if it were not installed: the flag ``loss_curve`` decides by is false and every import of
    matplotlib raises ImportError (a None entry in ``sys.modules``)."""
    monkeypatch.setattr(loss_curve, "MATPLOTLIB", False)
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + [
            "matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):
        from matplotlib.figure import Figure  # noqa: F401


TRAIN = [(s, 4.0 + 3.6 * math.exp(-s / 60)) for s in range(1, 201)]
VAL = [(s, 4.4 + 3.2 * math.exp(-s / 60)) for s in range(50, 201, 50)]


def test_encode_png_round_trips_the_pixels():
    pixels = bytes([10, 20, 30, 255, 255, 255, 0, 0, 0,
                    1, 2, 3, 4, 5, 6, 7, 8, 9])
    width, height, colour, kinds, rows = decode_png(encode_png(3, 2, pixels))
    assert (width, height, colour, kinds) == (3, 2, 2, [b"IHDR", b"IDAT", b"IEND"])
    assert rows == [[(10, 20, 30), (255, 255, 255), (0, 0, 0)], [(1, 2, 3), (4, 5, 6), (7, 8, 9)]]
    with pytest.raises(ValueError):
        encode_png(3, 2, pixels[:-1])


def test_fallback_writes_a_png_with_both_series_on_white(tmp_path, no_matplotlib):
    path = loss_curve.plot_loss_curve(TRAIN, VAL, tmp_path / "curve.png")
    assert path == tmp_path / "curve.png"
    width, height, colour, _, rows = decode_png(path.read_bytes())
    assert (width, height, colour) == (660, 396, 2)
    assert count(rows, TRAIN_COLOR) > 600        # a 2-pixel line across the box, plus its legend stroke
    assert count(rows, VAL_COLOR) > 4 * 20        # 4 markers of 29 pixels each, plus the line between them
    assert count(rows, WHITE) > 0.8 * width * height
    # the frame: two columns black over most of the height, two rows black over most of the width
    assert sum(sum(row[x] == BLACK for row in rows) > 0.8 * height for x in range(width)) == 2
    assert sum(sum(pixel == BLACK for pixel in row) > 0.8 * width for row in rows) == 2
    for x, y in [(0, 0), (width - 1, 0), (0, height - 1), (width - 1, height - 1)]:
        assert rows[y][x] == WHITE, (x, y)
    # inside the box, far from both curves (bottom-left: the curves are high there) the background is white
    assert rows[height - 70][80] == WHITE


def test_the_polyline_passes_through_the_mapped_pixels():
    chart = render_line_chart([Series([(20, 8.0), (80, 2.0)], TRAIN_COLOR, "train")], xlim=(0, 100), ylim=(0, 10))
    canvas, box = chart.canvas, chart.box
    # the box is the frame: black on its edges, not black just inside
    mid_x, mid_y = (box.left + box.right) // 2, (box.top + box.bottom) // 2
    for x, y in [(box.left, mid_y), (box.right, mid_y), (mid_x, box.top), (mid_x, box.bottom)]:
        assert canvas.get(x, y) == BLACK, (x, y)
    assert canvas.get(box.left + 3, mid_y + 7) != BLACK and canvas.get(mid_x + 7, box.bottom - 3) != BLACK

    def pixel(x, y):   # x 0..100 spans left..right, y 0..10 spans bottom..top
        return (round(box.left + x / 100 * (box.right - box.left)),
                round(box.bottom - y / 10 * (box.bottom - box.top)))

    for x, y in [(20, 8.0), (50, 5.0), (80, 2.0), (35, 6.5)]:
        assert near(canvas, *pixel(x, y), TRAIN_COLOR), (x, y, pixel(x, y))
    # where a flipped y axis, a flipped x axis or a missing box offset would have put the ends: nothing there
    for x, y in [(20, 2.0), (80, 8.0), (0, 8.0), (20, 10.0)]:
        assert not near(canvas, *pixel(x, y), TRAIN_COLOR, radius=3), (x, y)


def test_default_limits_pad_the_data_range():
    chart = render_line_chart([Series([(0, 10.0), (100, 0.0)], TRAIN_COLOR)])
    assert chart.xlim == pytest.approx((-3.0, 103.0)) and chart.ylim == pytest.approx((-0.5, 10.5))
    box = chart.box
    first = (round(box.left + 3 / 106 * (box.right - box.left)), round(box.bottom - 10.5 / 11 * (box.bottom - box.top)))
    assert near(chart.canvas, *first, TRAIN_COLOR)
    assert not near(chart.canvas, box.left + 2, box.bottom - 2, TRAIN_COLOR, radius=1)


def test_nan_and_inf_break_the_line_and_odd_inputs_draw(tmp_path):
    nan, inf = float("nan"), float("inf")
    chart = render_line_chart([Series([(0, 1.0), (1, nan), (2, 1.0), (3, inf), (4, -inf), (5, 1.0)], TRAIN_COLOR)],
                              xlim=(0, 5), ylim=(0, 2))
    box, canvas = chart.box, chart.canvas
    row = round(box.bottom - 0.5 * (box.bottom - box.top))
    for x in (0, 2, 5):   # the finite points are drawn (as dots: none has a finite neighbour)
        assert near(canvas, round(box.left + x / 5 * (box.right - box.left)), row, TRAIN_COLOR), x
    for x in (1, 3.5):    # and not joined across the non-finite ones
        assert not near(canvas, round(box.left + x / 5 * (box.right - box.left)), row, TRAIN_COLOR, radius=2), x

    cases = {
        "nan_inf": ([(1, 7.6), (2, nan), (3, inf), (4, 6.0), (5, -inf), (6, 5.5)], []),
        "single": ([(1, 7.6)], []),
        "single_each": ([(1, 7.6)], [(1, 7.7)]),
        "all_nan": ([(1, nan), (2, nan)], [(2, nan)]),
        "huge": ([(1, 1e308), (2, -1e308), (3, 5.0)], [(3, 1e-300)]),
        "all_huge": ([(1, 1e308), (2, 1.5e308)], []),
        "flat": ([(s, 3.0) for s in range(5)], [(4, 3.0)]),
    }
    for name, (train, val) in cases.items():
        path = write_line_chart_png(tmp_path / f"{name}.png", [Series(train, TRAIN_COLOR, "train_loss"),
                                                               Series(val, VAL_COLOR, "val_loss", markers=True)],
                                    integer_x=True)
        width, height, colour, _, rows = decode_png(path.read_bytes())
        assert (width, height, colour) == (660, 396, 2), name
        if name != "all_nan":
            assert count(rows, TRAIN_COLOR) > 0, name
        if not val:   # no validation: no orange at all (no line, no markers, no legend entry)
            assert count(rows, VAL_COLOR) == 0, name
        elif name in ("single_each", "flat"):
            assert count(rows, VAL_COLOR) > 20, name


def test_nice_ticks():
    assert nice_ticks(0, 10, target=5) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(3.8, 7.8, target=5) == pytest.approx([4, 5, 6, 7])
    assert nice_ticks(0.95, 1.05, target=5, integer=True) == [1]
    assert nice_ticks(1, 1) == []


def test_plot_loss_curve_uses_the_fallback_without_matplotlib(tmp_path, no_matplotlib):
    path = loss_curve.plot_loss_curve(TRAIN, [], tmp_path / "c.png", title="run 7")
    width, height, colour, kinds, rows = decode_png(path.read_bytes())
    assert colour == 2 and kinds == [b"IHDR", b"IDAT", b"IEND"]   # this renderer's RGB; matplotlib writes RGBA
    assert count(rows, TRAIN_COLOR) > 300 and count(rows, VAL_COLOR) == 0


def test_loss_curve_callback_writes_csv_and_png_without_matplotlib(tmp_path, no_matplotlib, capsys):
    curve = loss_curve.LossCurve(tmp_path / "logs" / "loss_curve")
    curve.train, curve.val = list(TRAIN[:50]), [(50, VAL[0][1])]
    curve.on_train_end(SimpleNamespace(is_global_zero=True), None)
    out = capsys.readouterr().out
    png = tmp_path / "logs" / "loss_curve.png"
    assert curve.png == png and f"loss curve: {png} (built-in renderer" in out and "only" not in out
    assert (tmp_path / "logs" / "loss_curve.csv").read_text().splitlines()[0] == "step,train_loss,val_loss"
    _, _, colour, _, rows = decode_png(png.read_bytes())
    assert colour == 2 and count(rows, TRAIN_COLOR) > 0 and count(rows, VAL_COLOR) > 0


@pytest.mark.skipif(not MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_loss_curve_keeps_matplotlib_when_installed(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the built-in renderer was used although matplotlib is installed")

    monkeypatch.setattr(loss_curve, "write_line_chart_png", fail)
    path = loss_curve.plot_loss_curve(TRAIN, VAL, tmp_path / "m.png")
    width, height, colour, _, _ = decode_png(path.read_bytes())
    assert (width, height, colour) == (660, 396, 6)   # Agg's RGBA, 6 x 3.6 inches at 110 dpi
