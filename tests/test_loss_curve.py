"""The loss-curve picture: without matplotlib an SVG (``lightning_megatron.callbacks.svg_plot``) that parses as XML,
whose series paths pass through the coordinates the documented mapping gives the data (and break at non-finite
points), with ticks, labels and legend; with matplotlib a PNG. ``plot_loss_curve`` / ``LossCurve`` pick the writer
by whether matplotlib can be imported."""
from __future__ import annotations

import math
import re
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from lightning_megatron.callbacks import loss_curve
from lightning_megatron.callbacks.svg_plot import (TRAIN_COLOR, VAL_COLOR, Series, line_chart_svg, nice_ticks,
                                                   write_line_chart_svg)
from lightning_megatron.utils.optional import MATPLOTLIB

NS = "{http://www.w3.org/2000/svg}"
TRAIN = [(s, 4.0 + 3.6 * math.exp(-s / 60)) for s in range(1, 201)]
VAL = [(s, 4.4 + 3.2 * math.exp(-s / 60)) for s in range(50, 201, 50)]


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


def chart(*args, **kwargs) -> ET.Element:
    """:func:`line_chart_svg` serialised and parsed back (the XML a file holds)."""
    return ET.fromstring(ET.tostring(line_chart_svg(*args, **kwargs)))


def frame(svg: ET.Element):
    """``(left, top, right, bottom)`` of the plot box's frame."""
    (rect,) = [r for r in svg.iter(NS + "rect") if r.get("class") == "frame"]
    left, top = float(rect.get("x")), float(rect.get("y"))
    return left, top, left + float(rect.get("width")), top + float(rect.get("height"))


def subpaths(svg: ET.Element, color: str):
    """The points of the series path drawn in ``color``, as a list of subpaths (each a list of ``(x, y)``)."""
    (path,) = [p for p in svg.iter(NS + "path") if p.get("class") == "series" and p.get("stroke") == color]
    out = []
    for command, x, y in re.findall(r"([ML])(-?[\d.]+),(-?[\d.]+)", path.get("d")):
        if command == "M":
            out.append([])
        out[-1].append((float(x), float(y)))
    assert sum(map(len, out)) == len(path.get("d").split()), path.get("d")
    return out


def texts(svg: ET.Element):
    return [t.text for t in svg.iter(NS + "text")]


def test_the_series_follow_the_data_through_the_documented_mapping():
    data = [(20, 8.0), (50, 5.0), (80, 2.0), (35, 6.5)]
    svg = chart([Series(data, TRAIN_COLOR, "train")], xlim=(0, 100), ylim=(0, 10), title="t")
    left, top, right, bottom = frame(svg)
    assert left < right and top < bottom
    (points,) = subpaths(svg, TRAIN_COLOR)
    # x 0..100 spans left..right, y 0..10 spans bottom..top (SVG's y grows downwards)
    want = [(left + x / 100 * (right - left), bottom - y / 10 * (bottom - top)) for x, y in data]
    assert points == [pytest.approx(p, abs=0.006) for p in want]
    assert points[0][1] < points[1][1] < points[2][1]   # falling loss: the line goes down the picture
    # grid lines at round ticks, labelled, and the legend entry
    assert {"0", "20", "40", "60", "80", "100"} <= set(texts(svg)) and {"0", "2", "4", "10"} <= set(texts(svg))
    assert "train" in texts(svg) and "t" in texts(svg)


def test_default_limits_pad_the_data_range():
    svg = chart([Series([(0, 10.0), (100, 0.0)], TRAIN_COLOR)])
    left, top, right, bottom = frame(svg)
    (points,) = subpaths(svg, TRAIN_COLOR)   # x limits -3..103, y limits -0.5..10.5
    width, height = right - left, bottom - top
    assert points[0] == pytest.approx((left + 3 / 106 * width, bottom - 10.5 / 11 * height), abs=0.006)
    assert points[1] == pytest.approx((left + 103 / 106 * width, bottom - 0.5 / 11 * height), abs=0.006)


def test_non_finite_points_break_the_line_and_odd_inputs_write(tmp_path):
    nan, inf = float("nan"), float("inf")
    svg = chart([Series([(0, 1.0), (1, nan), (2, 1.0), (3, 1.5), (4, inf), (5, 1.0)], TRAIN_COLOR)],
                xlim=(0, 5), ylim=(0, 2))
    assert [len(run) for run in subpaths(svg, TRAIN_COLOR)] == [1, 2, 1]

    cases = {
        "single": ([(1, 7.6)], []),
        "all_nan": ([(1, nan), (2, nan)], [(2, nan)]),
        "huge": ([(1, 1e308), (2, -1e308), (3, 5.0)], [(3, 1e-300)]),
        "flat": ([(s, 3.0) for s in range(5)], [(4, 3.0)]),
    }
    for name, (train, val) in cases.items():
        path = write_line_chart_svg(tmp_path / f"{name}.svg", [Series(train, TRAIN_COLOR, "train_loss"),
                                                               Series(val, VAL_COLOR, "val_loss", markers=True)],
                                    integer_x=True)
        svg = ET.parse(path).getroot()
        assert svg.tag == NS + "svg" and (svg.get("width"), svg.get("height")) == ("660", "396"), name
        coordinates = [float(v) for p in svg.iter(NS + "path") for v in re.findall(r"-?[\d.]+", p.get("d"))]
        assert all(math.isfinite(v) and abs(v) <= 1e9 for v in coordinates), name
        assert ("val_loss" in texts(svg)) == (name in ("huge", "flat")), name   # no legend entry without points
        if name != "all_nan":
            assert subpaths(svg, TRAIN_COLOR), name


def test_nice_ticks():
    assert nice_ticks(0, 10, target=5) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(3.8, 7.8, target=5) == pytest.approx([4, 5, 6, 7])
    assert nice_ticks(0.95, 1.05, target=5, integer=True) == [1]
    assert nice_ticks(1, 1) == []


def test_loss_curve_writes_csv_and_svg_without_matplotlib(tmp_path, no_matplotlib, capsys):
    curve = loss_curve.LossCurve(tmp_path / "logs" / "loss_curve.png")   # a suffix given is replaced
    curve.train, curve.val = list(TRAIN[:50]), [(50, VAL[0][1])]
    curve.on_train_end(SimpleNamespace(is_global_zero=True), None)
    svg_path = tmp_path / "logs" / "loss_curve.svg"
    assert curve.picture == svg_path and f"loss curve: {svg_path} (`pip install matplotlib`" in capsys.readouterr().out
    assert not (tmp_path / "logs" / "loss_curve.png").exists()
    assert (tmp_path / "logs" / "loss_curve.csv").read_text().splitlines()[0] == "step,train_loss,val_loss"
    svg = ET.parse(svg_path).getroot()
    (train,) = subpaths(svg, TRAIN_COLOR)
    (val,) = subpaths(svg, VAL_COLOR)
    assert len(train) == 50 and len(val) == 1
    assert len([c for c in svg.iter(NS + "circle") if c.get("fill") == VAL_COLOR]) == 1   # the validation marker
    assert {"train_loss", "val_loss", "optimizer step", "loss (nats / token)", "loss"} <= set(texts(svg))
    # the train losses fall and their path goes down the picture, step by step to the right
    assert all(b[0] > a[0] and b[1] > a[1] for a, b in zip(train, train[1:]))


@pytest.mark.skipif(not MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_loss_curve_uses_matplotlib_when_installed(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the SVG writer was used although matplotlib is installed")

    monkeypatch.setattr(loss_curve, "write_line_chart_svg", fail)
    path = loss_curve.plot_loss_curve(TRAIN, VAL, tmp_path / "m")
    assert path == tmp_path / "m.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
