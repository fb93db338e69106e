"""What a Lightning user writes works under every layout of ``MegatronStrategy`` as under Lightning's own DDP strategy
(the control: the same script, ``strategy=DDPStrategy()``), or is refused before the first step on every rank with an
error naming the Lightning feature, the layout and what to use instead.

Two gloo processes per layout (dp2, tp2 + SP, pp2, cp2, ep2), each running its cases in one process group
(:func:`tests._dist.run_each`); the control runs the same cases under Lightning's DDP once per module. The cases:

* ``main``: a ``ParallelGPTModule`` subclass overriding ``training_step`` (``super()``, then ``self.log`` with and
  without ``sync_dist``, on the step and on the epoch, on the progress bar; at pp = 1 an added loss term),
  ``validation_step``, ``test_step``, ``predict_step`` and ``on_before_backward`` / ``on_after_backward``; plain SGD,
  ``accumulate_grad_batches=2`` over epochs of 5 micro-batches (each epoch ends with a step of one micro-batch), a
  CSV logger. Checked against the control: the logged values, the CSV columns, the hooks' counts on every rank, the
  final weights (so the gradients of every step, the short ones included).
* ``manual``: manual optimization (``manual_backward``, ``clip_gradients`` by norm, ``optimizer.step()``): the final
  weights of the control (pp = 1); refused under pp = 2 naming manual optimization.
* ``swa``: ``StochasticWeightAveraging``: the final weights are the average of the weights at the starts of the
  averaged epochs (dp, cp); refused at setup where ranks hold shards (tp, pp, ep), every rank at once.
* ``fast_dev_run`` (pp2): one micro-batch, the control's weights; under pp2 an added loss term is refused at the first
  step (the schedule ran the backward before ``training_step``) and a ``backward`` override at setup.
"""
from __future__ import annotations

import csv
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule
from tests._dist import run_distributed, run_each
from tests.parity import CPU_PRECISION, SEED, ListDataset, make_samples, tiny_config

WORLD = 2
GLOBAL_BATCH = 4          # samples per micro-batch over the data-parallel ranks
ACCUMULATE = 2
EPOCH_MICROBATCHES = 5    # an epoch: steps of 2, 2 and 1 micro-batches
LR = 0.1


def moe_config() -> GPTConfig:
    """A tiny MoE model (4 experts, top-2; no aux losses, whose statistics DDP's ranks do not share)."""
    return tiny_config(num_query_groups=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                       moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)


#: name -> (MegatronStrategy keywords or None for the control, data-parallel ranks, MoE model)
LAYOUTS: Dict[str, Tuple[Optional[Dict[str, Any]], int, bool]] = {
    "ddp": (None, 2, False),
    "ddp-moe": (None, 2, True),
    "dp2": ({}, 2, False),
    "tp2-sp": (dict(tp=2, sequence_parallel=True), 1, False),
    "pp2": (dict(pp=2), 1, False),
    "cp2": (dict(cp=2), 1, False),
    "ep2": (dict(ep=2), 2, True),
}


def samples_for(cfg: GPTConfig, n: int, seed: int = 7) -> List[Dict[str, torch.Tensor]]:
    """Samples without a loss mask: every micro-batch of every rank counts the same tokens, so DDP's mean of the
    ranks' token-means is the global token-mean the library computes (the control and the layouts agree)."""
    return [{k: v for k, v in s.items() if k != "loss_mask"} for s in make_samples(cfg, n, seed)]


class Conformant(ParallelGPTModule):
    """What a Lightning user writes: overrides calling ``super()`` and logging; plain SGD."""

    extra = 0.5   # the training loss gets ``extra * loss`` added (an extra loss term)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = {"training_step": 0, "validation_step": 0, "test_step": 0, "predict_step": 0,
                      "on_before_backward": 0, "on_after_backward": 0}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        loss = super().training_step(batch, batch_idx)
        self.log("custom", loss, sync_dist=True, prog_bar=True)
        self.log("custom_rank", loss)
        self.log("custom_epoch", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss + self.extra * loss if self.extra else loss

    def validation_step(self, batch, batch_idx):
        self.calls["validation_step"] += 1
        loss = super().validation_step(batch, batch_idx)
        self.log("val_custom", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        self.calls["test_step"] += 1
        loss = super().test_step(batch, batch_idx)
        self.log("test_custom", loss, sync_dist=True)
        return loss

    def predict_step(self, batch, batch_idx):
        self.calls["predict_step"] += 1
        return super().predict_step(batch, batch_idx).mean()

    def on_before_backward(self, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self):
        self.calls["on_after_backward"] += 1


class Manual(ParallelGPTModule):
    """Manual optimization: ``manual_backward``, clipping by norm, ``optimizer.step()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        self.log("manual_loss", loss, sync_dist=True)


class OwnBackward(Conformant):
    def backward(self, loss, *args, **kwargs):
        loss.backward()


class BackwardCounter(pl.Callback):
    def __init__(self) -> None:
        self.before = self.after = 0

    def on_before_backward(self, trainer, pl_module, loss):
        self.before += 1

    def on_after_backward(self, trainer, pl_module):
        self.after += 1


class InitialWeights(pl.Callback):
    """Every run starts from the same full weights (Lightning's DDP and MegatronStrategy draw them differently): a
    plain module's, built with the global seed, loaded at the start of training (shards kept under MegatronStrategy)."""

    def __init__(self, cfg: GPTConfig) -> None:
        pl.seed_everything(SEED, verbose=False)
        plain = ParallelGPTModule(cfg)
        plain.configure_model()
        self.state = {k: v.detach().clone() for k, v in plain.state_dict().items()}

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.load_model_state_dict({"state_dict": self.state})


class EpochStartWeights(pl.Callback):
    """All parameters (this rank's), flattened, at the start of every training epoch."""

    def __init__(self) -> None:
        self.weights: List[torch.Tensor] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.weights.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))


def strategy_for(layout: str) -> Any:
    kwargs, _, moe = LAYOUTS[layout]
    if kwargs is None:
        return DDPStrategy(find_unused_parameters=moe, process_group_backend="gloo")
    return MegatronStrategy(**kwargs)


def trainer_for(layout: str, callbacks=(), **kwargs: Any) -> pl.Trainer:
    """A quiet Trainer of the layout (``ddp``: Lightning's DDP strategy) starting from :class:`InitialWeights`."""
    kwargs.setdefault("logger", False)
    cfg = moe_config() if LAYOUTS[layout][2] else tiny_config()
    callbacks = [InitialWeights(cfg), *callbacks]
    pl.seed_everything(SEED, verbose=False)
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy_for(layout), precision=CPU_PRECISION,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=callbacks, **kwargs)


def loaders(layout: str, cfg: GPTConfig, train_microbatches: int = EPOCH_MICROBATCHES):
    dp = LAYOUTS[layout][1]
    micro = GLOBAL_BATCH // dp
    train = DataLoader(ListDataset(samples_for(cfg, train_microbatches * GLOBAL_BATCH)), batch_size=micro)
    val = DataLoader(ListDataset(samples_for(cfg, 2 * GLOBAL_BATCH, seed=8)), batch_size=micro)
    return train, val


def full_state(trainer: pl.Trainer) -> Optional[Dict[str, torch.Tensor]]:
    """The whole model's weights (rank 0; collective on every rank under MegatronStrategy)."""
    state = trainer.strategy.lightning_module_state_dict()
    return {k: v.detach().cpu().double().clone() for k, v in state.items()} if trainer.global_rank == 0 else None


def metrics(trainer: pl.Trainer) -> Dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def main_case(rank: int, world: int, layout: str, extra: float = Conformant.extra) -> Dict[str, Any]:
    cfg = moe_config() if LAYOUTS[layout][2] else tiny_config()
    pl.seed_everything(SEED, verbose=False)
    module = Conformant(cfg, lr=LR)
    module.extra = extra
    counter = BackwardCounter()
    with tempfile.TemporaryDirectory() as logs:
        trainer = trainer_for(layout, callbacks=[counter], max_epochs=2, accumulate_grad_batches=ACCUMULATE,
                              logger=CSVLogger(logs, name="run", version=0), log_every_n_steps=1)
        train, val = loaders(layout, cfg)
        trainer.fit(module, train, val)
        fit_metrics, bar = metrics(trainer), {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
        state = full_state(trainer)
        tested = trainer.test(module, val, verbose=False)
        predicted = trainer.predict(module, val)
        columns: List[str] = []
        path = os.path.join(logs, "run", "version_0", "metrics.csv")
        if rank == 0 and os.path.exists(path):
            with open(path) as f:
                columns = next(csv.reader(f))
    return {"metrics": fit_metrics, "bar": bar, "state": state, "tested": tested, "columns": columns,
            "predicted": [float(p) for p in predicted], "calls": dict(module.calls),
            "callback": (counter.before, counter.after), "steps": trainer.global_step}


def manual_case(rank: int, world: int, layout: str) -> Dict[str, Any]:
    cfg = moe_config() if LAYOUTS[layout][2] else tiny_config()
    pl.seed_everything(SEED, verbose=False)
    module = Manual(cfg, lr=LR)
    trainer = trainer_for(layout, max_steps=3, max_epochs=2)   # an epoch has 5 batches; a run that never steps ends
    trainer.fit(module, loaders(layout, cfg)[0])
    return {"state": full_state(trainer), "metrics": metrics(trainer), "steps": trainer.global_step}


def swa_case(rank: int, world: int, layout: str) -> Dict[str, Any]:
    cfg = moe_config() if LAYOUTS[layout][2] else tiny_config()
    pl.seed_everything(SEED, verbose=False)
    module = Conformant(cfg, lr=LR)
    module.extra = 0.0
    starts = EpochStartWeights()
    swa = StochasticWeightAveraging(swa_lrs=LR / 2, swa_epoch_start=2)   # 1-based: epochs 1 and 2 (0-based)
    trainer = trainer_for(layout, callbacks=[starts, swa], max_epochs=3, accumulate_grad_batches=ACCUMULATE)
    trainer.fit(module, loaders(layout, cfg, train_microbatches=2)[0])
    final = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
    return {"starts": starts.weights, "final": final, "averaged": int(swa.n_averaged),
            "average_type": type(swa._average_model).__name__}


def fast_dev_run_case(rank: int, world: int, layout: str) -> Dict[str, Any]:
    cfg = tiny_config()
    pl.seed_everything(SEED, verbose=False)
    module = Conformant(cfg, lr=LR)
    module.extra = 0.0
    trainer = trainer_for(layout, fast_dev_run=True, accumulate_grad_batches=ACCUMULATE)
    train, val = loaders(layout, cfg)
    trainer.fit(module, train, val)
    return {"state": full_state(trainer), "calls": dict(module.calls)}


def extra_loss_refused_case(rank: int, world: int, layout: str) -> Dict[str, Any]:
    cfg = tiny_config()
    pl.seed_everything(SEED, verbose=False)
    module = Conformant(cfg, lr=LR)   # returns loss + 0.5 * loss
    trainer = trainer_for(layout, max_steps=1, accumulate_grad_batches=ACCUMULATE)
    trainer.fit(module, loaders(layout, cfg)[0])
    return {"steps": trainer.global_step}


def backward_override_case(rank: int, world: int, layout: str) -> Dict[str, Any]:
    cfg = tiny_config()
    pl.seed_everything(SEED, verbose=False)
    trainer = trainer_for(layout, max_steps=1, accumulate_grad_batches=ACCUMULATE)
    trainer.fit(OwnBackward(cfg, lr=LR), loaders(layout, cfg)[0])
    return {"steps": trainer.global_step}


def main_plain_case(rank: int, world: int, layout: str) -> Dict[str, Any]:
    """``main`` without the added loss term (under pp an added term is refused: ``extra_loss``)."""
    return main_case(rank, world, layout, extra=0.0)


CASES = {"main": main_case, "main-plain": main_plain_case, "manual": manual_case, "swa": swa_case, "fast_dev_run": fast_dev_run_case,
         "extra_loss": extra_loss_refused_case, "own_backward": backward_override_case}


def run_case(rank: int, world: int, case: str, layout: str) -> Any:
    return CASES[case](rank, world, layout)


def run_cases(rank: int, world: int, layout: str, cases: List[str]) -> Dict[str, Any]:
    return run_each(rank, world, run_case, [(case, (case, layout)) for case in cases])


_CONTROL: Dict[str, List[Dict[str, Any]]] = {}


def control(moe: bool) -> List[Dict[str, Any]]:
    """Lightning's DDP strategy on the same cases (computed once per module)."""
    layout = "ddp-moe" if moe else "ddp"
    if layout not in _CONTROL:
        cases = ["main", "manual"] + ([] if moe else ["main-plain", "fast_dev_run"])
        _CONTROL[layout] = run_distributed(run_cases, WORLD, layout, cases)
    return _CONTROL[layout]


def assert_states_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float = 1e-6) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k, v in want.items():
        err = float((got[k] - v).norm() / v.norm().clamp(min=1e-30))
        assert err <= rtol, f"{k}: relative error {err:.3g} against Lightning's DDP"


def ok(result: Any) -> Dict[str, Any]:
    assert not isinstance(result, str), result   # a traceback
    return result


def refused(results: List[Dict[str, Any]], case: str, *patterns: str) -> None:
    """Every rank raised, with all of ``patterns`` in its message."""
    for r in results:
        message = r[case]
        assert isinstance(message, str), f"{case}: ran instead of being refused: {message}"
        for pattern in patterns:
            assert pattern in message, message


PER_LAYOUT = {
    "dp2": ["main", "manual", "swa"],
    "tp2-sp": ["main", "manual", "swa"],
    "pp2": ["main-plain", "manual", "swa", "fast_dev_run", "extra_loss", "own_backward"],
    "cp2": ["main", "manual", "swa"],
    "ep2": ["main", "manual", "swa"],
}


@pytest.mark.parametrize("layout", list(PER_LAYOUT))
def test_lightning_features_match_ddp(layout):
    _, dp, moe = LAYOUTS[layout]
    ctrl = control(moe)
    results = run_distributed(run_cases, WORLD, layout, PER_LAYOUT[layout])
    pp = LAYOUTS[layout][0].get("pp", 1)

    # ---- main: the overrides ran, their logging reached callback_metrics, the progress bar and the logger
    main = "main-plain" if pp > 1 else "main"
    want = ok(ctrl[0][main])
    mains = [ok(r[main]) for r in results]
    for rank, got in enumerate(mains):
        assert got["steps"] == want["steps"] == 2 * 3
        for key in ("custom", "custom_epoch", "val_custom", "val_loss"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-6), (key, got["metrics"])
        assert got["bar"]["custom"] == pytest.approx(want["bar"]["custom"], rel=1e-6)
        # without sync_dist each rank logs its data-parallel rank's own value: the control's rank of the same data
        # (dp2), or with one data-parallel rank the whole batch's (the control's synced value)
        same_data = ctrl[rank if dp == 2 else 0][main]["metrics"]["custom_rank" if dp == 2 else "custom"]
        assert got["metrics"]["custom_rank"] == pytest.approx(same_data, rel=1e-6)
        test_custom = got["tested"][0]["test_custom"]
        assert test_custom == pytest.approx(want["tested"][0]["test_custom"], rel=1e-6)
        micro = 2 * EPOCH_MICROBATCHES
        assert got["calls"]["training_step"] == micro, got["calls"]
        assert got["calls"]["on_before_backward"] == got["calls"]["on_after_backward"] == micro, got["calls"]
        assert got["callback"] == want["callback"] == (micro, micro)
        assert got["calls"]["validation_step"] == want["calls"]["validation_step"] > 0
        assert got["calls"]["test_step"] == want["calls"]["test_step"] > 0
        assert got["calls"]["predict_step"] == want["calls"]["predict_step"] > 0
        assert all(torch.isfinite(torch.tensor(got["predicted"])))
    assert {"custom", "custom_rank", "val_custom", "custom_epoch"} <= set(mains[0]["columns"]), mains[0]["columns"]
    assert_states_close(mains[0]["state"], want["state"])

    # ---- manual optimization
    if pp > 1:
        refused(results, "manual", "manual optimization", "pp=2", "automatic optimization")
    else:
        got, want_manual = ok(results[0]["manual"]), ok(ctrl[0]["manual"])
        assert got["steps"] == want_manual["steps"] == 3
        assert got["metrics"]["manual_loss"] == pytest.approx(want_manual["metrics"]["manual_loss"], rel=1e-6)
        assert_states_close(got["state"], want_manual["state"])

    # ---- stochastic weight averaging
    if layout in ("dp2", "cp2"):
        for r in results:
            swa = ok(r["swa"])
            expected = torch.stack(swa["starts"][1:3]).mean(0)   # averaged at the starts of epochs 1 and 2
            assert len(swa["starts"]) == 3 and not torch.equal(swa["starts"][1], swa["starts"][2])
            assert (swa["averaged"], swa["average_type"]) == (2, "AveragedParameters")
            assert float((swa["final"] - expected).abs().max()) <= 1e-6
    else:
        refused(results, "swa", "StochasticWeightAveraging is not supported under MegatronStrategy(", "average")

    # ---- pp2 only: fast_dev_run, an added loss term, a backward override
    if pp > 1:
        got = ok(results[0]["fast_dev_run"])
        assert_states_close(got["state"], ok(ctrl[0]["fast_dev_run"])["state"])
        refused(results, "extra_loss", "Conformant.training_step returned", "pipeline parallelism (pp=2)", "pp=1")
        refused(results, "own_backward", "OwnBackward.backward overrides LightningModule.backward", "pp=2")
