"""The progress bar's loss without a host wait (:class:`~lightning_megatron.utils.host_value.LaggedHostValue`): on the
CPU the value is the step's own, the bar shows ``loss`` (not ``train_loss``, which stays a tensor for loggers and
callbacks), and copies of the holder start empty. The CUDA side (no synchronising call with the progress bar on) is in
``tests/gpu/test_nonfinite_device.py``."""
from __future__ import annotations

import copy
import pickle

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.utils.host_value import LaggedHostValue
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for


def test_cpu_values_arrive_at_once_and_copies_start_empty():
    held = LaggedHostValue()
    assert held.send(torch.tensor(2.5)) == 2.5
    assert held.send(torch.tensor([3.0], dtype=torch.bfloat16)) == 3.0
    for twin in (copy.deepcopy(held), pickle.loads(pickle.dumps(held))):
        assert twin._last is None and twin.send(torch.tensor(1.0)) == 1.0


def test_progress_bar_shows_the_loss_and_loggers_get_the_tensor():
    """Nothing is logged with the progress bar (Lightning would read it at every batch's end) and nothing as a number
    (``self.log`` copies a number to the module's device): both make a CUDA host wait."""
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    module = new_module(cfg, 2)
    logged, log = [], module.log

    def spy(name, value, *args, **kwargs):
        logged.append((name, torch.is_tensor(value), kwargs.get("prog_bar", False)))
        return log(name, value, *args, **kwargs)

    module.log = spy
    trainer = trainer_for(1, MegatronStrategy(), 2, enable_progress_bar=True)
    trainer.fit(module, DataLoader(ListDataset(make_samples(cfg, 8)), batch_size=4))
    assert logged == [("train_loss", True, False)] * 2, logged
    assert set(trainer.progress_bar_metrics) == {"loss"}
    loss = trainer.callback_metrics["train_loss"]
    assert torch.is_tensor(loss) and trainer.progress_bar_metrics["loss"] == float(loss)
