"""``LossCurve``: the run's train / validation loss per optimizer step as a CSV and a picture: a PNG drawn by
matplotlib when it is installed, else an SVG written by :mod:`lightning_megatron.callbacks.svg_plot`."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import List, Optional, Tuple, Union

import lightning.pytorch as pl
import torch

from lightning_megatron.callbacks.optimizer_step import OptimizerStepCallback
from lightning_megatron.callbacks.svg_plot import TRAIN_COLOR, VAL_COLOR, Series, write_line_chart_svg
from lightning_megatron.utils.optional import MATPLOTLIB

__all__ = ["LossCurve", "plot_loss_curve"]


class LossCurve(OptimizerStepCallback):
    """Record ``train_loss`` after every optimizer step and ``val_loss`` after every validation (global rank 0;
    both are already the global values), and write them at the end of training as ``<path>.csv`` (columns
    ``step, train_loss, val_loss``) and the picture (:func:`plot_loss_curve`): ``<path>.png`` drawn by matplotlib
    when it is installed (the ``[plots]`` extra), else ``<path>.svg``.
    Communicates nothing. The train losses stay on the device and are read on the host every ``read_every`` steps,
    at validation and at the end (reading one waits for the GPU to finish all work queued before it).

    Args:
        path: output path without suffix, e.g. ``lightning_logs/loss_curve``.
        read_every: optimizer steps between host reads of the recorded train losses.
    """

    def __init__(self, path: Union[str, Path], read_every: int = 100) -> None:
        if read_every < 1:
            raise ValueError(f"LossCurve: read_every={read_every} must be >= 1")
        self.path = Path(path).with_suffix("") if Path(path).suffix in (".png", ".svg", ".csv") else Path(path)
        self.read_every = read_every
        self.train: List[Tuple[int, float]] = []
        self.val: List[Tuple[int, float]] = []
        #: the picture written at the end of training (``.png`` or ``.svg``), None before
        self.picture: Optional[Path] = None
        self._unread: List[Tuple[int, torch.Tensor]] = []

    def on_optimizer_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if trainer.is_global_zero and loss is not None:
            self._unread.append((step, torch.as_tensor(loss).detach().clone().float()))
            if len(self._unread) >= self.read_every:
                self.read()

    def read(self) -> None:
        """Move the recorded train losses to :attr:`train` (one host read for all of them)."""
        if self._unread:
            values = torch.stack([v.reshape(()) for _, v in self._unread]).tolist()
            self.train.extend((step, value) for (step, _), value in zip(self._unread, values))
            self._unread = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if trainer.is_global_zero and loss is not None and not trainer.sanity_checking:
            self.read()
            self.val.append((trainer.global_step, float(loss)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.read()
        if not trainer.is_global_zero or not self.train:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "train_loss", "val_loss"])
            val = dict(self.val)
            for step, loss in self.train:
                writer.writerow([step, f"{loss:.6f}", f"{val[step]:.6f}" if step in val else ""])
        self.picture = plot_loss_curve(self.train, self.val, self.path)
        how = "" if MATPLOTLIB else " (`pip install matplotlib` for a PNG)"
        print(f"loss curve: {self.picture}{how}", flush=True)


def plot_loss_curve(train: List[Tuple[int, float]], val: List[Tuple[int, float]], path: Union[str, Path],
                    title: str = "loss") -> Path:
    """Draw the ``(step, loss)`` series ``train`` (a line) and ``val`` (a line with markers) with axis labels, grid
    and legend; returns the file written: ``path`` with the suffix ``.png`` when matplotlib is installed
    (:data:`lightning_megatron.utils.optional.MATPLOTLIB`; a 660 x 396 figure drawn with matplotlib's object API, no
    global backend), else ``.svg`` (:func:`lightning_megatron.callbacks.svg_plot.write_line_chart_svg`, the same
    size and colours). Non-finite losses are left out of the picture; ``val`` may be empty.
    """
    if not MATPLOTLIB:
        return write_line_chart_svg(
            Path(path).with_suffix(".svg"),
            [Series(train, TRAIN_COLOR, "train_loss"), Series(val, VAL_COLOR, "val_loss", markers=True)],
            title=title, xlabel="optimizer step", ylabel="loss (nats / token)", integer_x=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path).with_suffix(".png")
    fig = Figure(figsize=(6, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in train], [v for _, v in train], label="train_loss", linewidth=1.2)
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="val_loss", markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
    return path
