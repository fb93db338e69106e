"""Nothing lost, nothing silent: non-finite losses, gradients and weights stop the run (naming the step, the
ranks and the parameter) and are never checkpointed; bad inputs and settings raise errors that name them.

Distributed cases run real gloo processes (tests/_dist.py); every failure is checked on every rank, since a rank
that does not raise with the others leaves them waiting in a collective.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule
from lightning_megatron.checkpoint.atomic_io import AtomicCheckpointIO
from lightning_megatron.data import GPTDataset, IndexedDatasetWriter
from lightning_megatron.data.preprocess import PreprocessError, preprocess_jsonl
from lightning_megatron.models.module import check_token_ids
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.grad_norm import clip_grad_norm_
from lightning_megatron.parallel.nonfinite import NonFiniteError, NonFiniteGuard
from tests._dist import run_distributed
from tests.parity import (
    SEED,
    ListDataset,
    PoisonGradientOnce,
    WeightsAfterStep,
    collate,
    lightning_train_order,
    make_samples,
    new_module,
    tiny_config,
    trainer_for,
)

NAN = float("nan")


# ---------------------------------------------------------------------------------------------- 1. non-finite guard
def _net_with_grads(bad: str = "1.weight", value: float = NAN) -> nn.Module:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    for name, p in net.named_parameters():
        p.grad = torch.ones_like(p)
        if name == bad:
            p.grad[0, 0] = value
    return net


@pytest.mark.parametrize("value, kind", [(NAN, "nan"), (float("inf"), "inf")])
def test_guard_names_step_and_first_bad_gradient(value, kind):
    net = _net_with_grads(value=value)
    guard = NonFiniteGuard(net)
    guard.step = 7
    with pytest.raises(NonFiniteError, match=rf"at step 7 .*a gradient is {kind}.*rank 0: gradient of 1\.weight \({kind}\)"):
        guard.check_grads()
    guard.check_loss(torch.tensor(2.5))   # finite: silent
    with pytest.raises(NonFiniteError, match=r"step 7.*the loss is inf.*gradient of 1\.weight"):
        guard.check_loss(torch.tensor(float("inf")))


@pytest.mark.parametrize("check, kind", [("grads", "a gradient is nan"), ("loss", "the loss is inf"),
                                         ("norm", "the global gradient norm is nan")])
def test_guard_decided_on_the_device_skips_the_update_and_reports_a_step_later(check, kind):
    """A fused optimizer (skips its update on the device): the checks raise nothing while the step runs; the
    optimizer leaves weights, moments and step counts unchanged; ``settle`` then raises the synchronous check's
    error naming the step. A finite step changes the weights and settles silently; a plain optimizer keeps the
    synchronous checks."""
    from lightning_megatron.parallel.nonfinite import skips_on_device

    net = _net_with_grads(value=1.0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    assert skips_on_device(optimizer) and not skips_on_device(torch.optim.AdamW(net.parameters()))
    guard = NonFiniteGuard(net)

    def step(number, poison):
        guard.step = number
        guard.start_step(optimizer)
        assert guard.on_device and optimizer.found_inf is not None
        net[1].weight.grad[0, 0] = NAN if poison else 1.0
        guard.check_loss(torch.tensor(float("inf") if poison and check == "loss" else 2.0))
        if check == "norm":
            guard.check_grad_norm(torch.tensor(NAN if poison else 3.0))
        else:
            guard.check_grads()
        optimizer.step()
        guard.end_step()

    step(3, poison=False)
    guard.settle()                                 # finite: silent
    before = [p.detach().clone() for p in net.parameters()]
    states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in net.parameters()]
    step(4, poison=True)                           # nothing raised yet
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    assert all(torch.equal(v, optimizer.state[p][k]) for s, p in zip(states, net.parameters()) for k, v in s.items())
    with pytest.raises(NonFiniteError, match=rf"at step 4 .*{kind}.*rank 0: gradient of 1\.weight \(nan\)"):
        guard.settle()
    guard.settle()                                 # read once
    guard.start_step(torch.optim.SGD(net.parameters(), lr=0.1))   # cannot skip on the device: synchronous
    assert not guard.on_device
    with pytest.raises(NonFiniteError, match="at step 4 .*a gradient is nan"):
        guard.check_grads()


def test_non_finite_last_step_decided_on_the_device_raises_before_fit_returns():
    """A fused AdamW (checks decided on the device) and a NaN gradient at the last step, with no checkpoint after
    it: ``fit`` still raises, at the end of training, naming that step; the weights are the last finite ones."""
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    module = new_module(cfg, 3, adamw="fused")
    poison, weights = _PoisonGradient(rank=0, at=2), []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            weights.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))

    trainer = trainer_for(1, MegatronStrategy(), 3, callbacks=[poison, Keep()])
    with pytest.raises(NonFiniteError, match=r"at step 2 \(trainer.global_step\): a gradient is nan.*rank 0: gradient "
                                             r"of model\.decoder\.layers\.1\.mlp\.linear_fc2\.weight \(nan\)"):
        trainer.fit(module, DataLoader(ListDataset(make_samples(cfg, 12)), batch_size=4))
    assert len(weights) == 3 and torch.equal(weights[1], weights[2]) and not torch.equal(weights[0], weights[1])
    assert torch.isfinite(weights[2]).all()


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_device_decided_verdict_is_read_after_the_next_backward_and_still_names_the_gradient(clip):
    """A fused AdamW (checks decided on the device), a NaN gradient at step 1 only: the verdict is read once step 2's
    forward and backward have run (the host never waits for the step it has just queued), before step 2 touches the
    weights, and the error still names step 1 and the parameter, whose gradient is finite again by then (the norms
    sent with the verdict name it, with and without clipping). The weights after step 1 equal those after step 0."""
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    module = new_module(cfg, 4, adamw="fused")
    weights, backwards = WeightsAfterStep(), []

    class CountBackward(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            backwards.append(trainer.global_step)

    trainer = trainer_for(1, MegatronStrategy(), 4, callbacks=[PoisonGradientOnce(0, 1), weights, CountBackward()],
                          gradient_clip_val=clip)
    with pytest.raises(NonFiniteError, match=r"at step 1 \(trainer.global_step\): (a gradient|the global gradient norm) "
                                             r"is nan.*rank 0: gradient of model\.decoder\.layers\.1\.mlp\.linear_fc2"
                                             r"\.weight \(nan\)"):
        trainer.fit(module, DataLoader(ListDataset(make_samples(cfg, 16)), batch_size=4))
    assert backwards == [0, 1, 2]                    # step 2's backward ran before the verdict was read
    assert len(weights.after_step) == 2 and torch.equal(weights.after_step[0], weights.after_step[1])
    assert module.model.decoder.layers["1"].mlp.linear_fc2.weight.grad.isfinite().all()   # step 2's gradient
    assert torch.equal(torch.cat([p.detach().flatten() for p in module.parameters()]), weights.after_step[1])


def test_guard_off_and_grads_off_are_silent():
    net = _net_with_grads()
    NonFiniteGuard(net, enabled=False).check_grads()
    NonFiniteGuard(net, enabled=False).check_loss(torch.tensor(NAN))
    NonFiniteGuard(net, grads=False).check_grads()          # fp16 with a loss scaler: the scaler's business
    NonFiniteGuard(net, grads=False).check_grad_norm(torch.tensor(NAN))
    with pytest.raises(NonFiniteError):                     # the loss is still checked
        NonFiniteGuard(net, grads=False).check_loss(torch.tensor(NAN))


def test_guard_refuses_non_finite_weights():
    net = _net_with_grads(value=1.0)
    NonFiniteGuard(net).check_weights()
    with torch.no_grad():
        net[0].bias[2] = float("-inf")
    with pytest.raises(NonFiniteError, match=r"no checkpoint was written.*rank 0: weight 0\.bias \(inf\)"):
        NonFiniteGuard(net).check_weights()


def test_overflowing_norm_is_explained():
    """Finite gradients whose squared norm overflows float32: the norm is inf, and the error says why."""
    net = _net_with_grads(value=1e30)
    params = list(net.parameters())
    guard = NonFiniteGuard(net)
    with pytest.raises(NonFiniteError, match="sum of squares overflowed"):
        clip_grad_norm_(params, 1.0, set(), None, check=guard.check_grad_norm)


def test_nan_norm_never_reaches_the_gradients():
    """Clipping checks the norm before it scales: a NaN norm raises and leaves every other gradient as it was
    (without the check, every gradient would become NaN)."""
    net = _net_with_grads()
    before = {n: p.grad.clone() for n, p in net.named_parameters()}
    with pytest.raises(NonFiniteError, match="global gradient norm is nan"):
        clip_grad_norm_(list(net.parameters()), 0.1, set(), None, check=NonFiniteGuard(net).check_grad_norm)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, before[n], equal_nan=True, rtol=0, atol=0)


def test_check_for_nan_option_is_typed():
    assert ParallelConfig().check_for_nan_in_loss_and_grad is True
    assert MegatronStrategy(check_for_nan_in_loss_and_grad=False).parallel_config.check_for_nan_in_loss_and_grad is False
    with pytest.raises(ValueError, match="check_for_nan_in_loss_and_grad='no' must be True"):
        ParallelConfig(check_for_nan_in_loss_and_grad="no")


class _PoisonGradient(pl.Callback):
    """Makes one parameter's gradient NaN on one rank from optimizer step ``at`` on (a hook on the parameter)."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        p = pl_module.model.decoder.layers["1"].mlp.linear_fc2.weight
        p.register_hook(lambda g: torch.full_like(g, NAN) if trainer.global_step >= self.at else g)


def _fit_until_error(rank, world, mode, layout, path):
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    samples = make_samples(cfg, 16)
    module = new_module(cfg, 4, adamw="fused" if mode.endswith("fused") else None)
    callbacks, clip = [], None
    if mode == "lr":        # Megatron's --lr 1e30: the first step blows the weights up, the second loss is NaN
        module.hparams.lr = module.hparams.min_lr = 1e30
    else:                   # a NaN gradient on rank 1 only, at the second step; clipping on or off
        callbacks.append(_PoisonGradient(rank=1, at=1))
        clip = 1.0 if mode.startswith("grad_clip") else None
    callbacks.append(ModelCheckpoint(dirpath=path, every_n_train_steps=1, save_top_k=-1, save_last=True))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=MegatronStrategy(**layout), max_steps=4,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         gradient_clip_val=clip, accumulate_grad_batches=layout.get("pp", 1))
    try:
        trainer.fit(module, DataLoader(ListDataset(samples), batch_size=4))
    except NonFiniteError as e:
        return {"error": str(e), "step": trainer.global_step}
    return {"error": None, "step": trainer.global_step}


@pytest.mark.parametrize("mode, layout", [("lr", dict(tp=2)), ("grad", dict(tp=2)), ("grad_clip", dict(tp=2)),
                                          ("grad_clip", dict(pp=2)), ("grad_clip_fused", dict(tp=2))],
                         ids=["tp2-lr1e30", "tp2-nan-grad", "tp2-nan-grad-clip", "pp2-nan-grad-clip",
                              "tp2-nan-grad-clip-fused-adam"])
def test_non_finite_stops_every_rank_and_keeps_finite_checkpoints(tmp_path, mode, layout):
    """tp=2 and pp=2: the step that goes non-finite raises NonFiniteError on both ranks (naming the step and the
    parameter on the rank that holds it), the optimizer step is not taken, and every checkpoint on disk is finite,
    the last one from the step before. With a fused AdamW the checks are decided on the device: the optimizer skips
    the update itself and the error comes when the step's checkpoint is about to be written (Lightning has counted
    the step by then: ``global_step`` 2), with the same text and the same files."""
    out = run_distributed(_fit_until_error, 2, mode, layout, str(tmp_path))
    for rank, result in enumerate(out):
        assert result["error"] is not None, f"rank {rank} did not raise"
        assert result["step"] == (2 if mode.endswith("fused") else 1), result
        assert "at step 1 (trainer.global_step)" in result["error"]
    if mode == "lr":
        assert re.search(r"(the loss|a gradient) is nan; .*rank 0: gradient of model\.", out[0]["error"])
    else:
        what = "the global gradient norm is nan" if mode.startswith("grad_clip") else "a gradient is nan"
        assert what in out[0]["error"]
        assert "rank 1: gradient of model.decoder.layers.1.mlp.linear_fc2.weight (nan)" in out[0]["error"]
        assert "rank 0:" not in out[0]["error"]
    assert out[0]["error"] == out[1]["error"]
    files = sorted(os.listdir(tmp_path))
    assert "last.ckpt" in files and len(files) == 2, files     # step 1's file and last.ckpt, nothing from step 2
    for name in files:
        ckpt = torch.load(tmp_path / name, weights_only=True)
        assert ckpt["global_step"] == 1
        assert all(torch.isfinite(t).all() for t in ckpt["state_dict"].values()), name


def test_pretrain_gpt_lr_1e30_exits_non_zero_and_keeps_finite_checkpoints(tmp_path):
    """Megatron's flags, ``--lr 1e30`` on CPU (2 processes, tp=2): it used to end with ``train_loss: nan``, exit 0
    and NaN checkpoints; now it exits non-zero naming NaN, the step and the parameter, and leaves the checkpoint
    of the last finite step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "examples/pretrain_gpt.py", "--lr", "1e30", "--train-iters", "6", "--save", str(save),
           "--save-interval", "1", "--eval-iters", "0"]
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert re.search(r"NonFiniteError: non-finite value at step 1 \(trainer.global_step\): .* is nan; "
                     r"first non-finite values: rank 0: gradient of model\.", text), text[-3000:]
    assert "done:" not in text
    files = sorted(p.name for p in save.iterdir())
    assert files == ["epoch=0-step=1.ckpt", "last.ckpt"], files
    for name in files:
        state = torch.load(save / name, weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values()), name


def _save_after_poison(rank, world, check, path, **strategy_options):
    """tp=2: one step, then a NaN in rank 1's shard; the error of ``save_checkpoint`` (or None if it saved)."""
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    module = new_module(cfg, 1)
    strategy = MegatronStrategy(tp=2, check_for_nan_in_loss_and_grad=check, **strategy_options)
    trainer = trainer_for(world, strategy, 1)
    trainer.fit(module, DataLoader(ListDataset(make_samples(cfg, 8)), batch_size=4))
    if rank == 1:   # one TP rank's shard goes bad (a cosmic ray, a bug in a callback)
        with torch.no_grad():
            module.model.decoder.layers["0"].self_attention.linear_qkv.weight[0, 0] = NAN
    try:
        trainer.save_checkpoint(path)
    except NonFiniteError as e:
        return str(e)
    return None


def test_checkpoint_of_non_finite_weights_is_refused(tmp_path):
    """A NaN in one TP rank's shard: save_checkpoint raises on both ranks and writes nothing; with the check off
    the file is written (and holds the NaN)."""
    path = tmp_path / "bad.ckpt"
    errors = run_distributed(_save_after_poison, 2, True, str(path))
    assert all(e is not None for e in errors), errors
    assert "rank 1: weight model.decoder.layers.0.self_attention.linear_qkv.weight (nan)" in errors[0]
    assert "no checkpoint was written" in errors[0] and not path.exists()
    assert run_distributed(_save_after_poison, 2, False, str(path)) == [None, None]
    state = torch.load(path, weights_only=True)["state_dict"]
    assert math.isnan(float(state["model.decoder.layers.0.self_attention.linear_qkv.weight"].sum()))


# ---------------------------------------------------------------------------------------------- 2. token ids
def _batch(cfg, **bad):
    batch = collate(make_samples(cfg, 2))
    for key, (row, col, value) in bad.items():
        batch[key][row, col] = value
    return batch


@pytest.mark.parametrize("key, value", [("tokens", 200), ("tokens", -1), ("labels", 255), ("labels", -100)])
def test_token_ids_outside_the_vocabulary_raise(key, value):
    """An id at or above vocab_size (here in the padded rows 200..255 of tp=2) or negative: a ValueError naming
    the key, the range found and the vocabulary, before the batch leaves the host."""
    cfg = tiny_config()
    module = ParallelGPTModule(cfg)
    module.on_before_batch_transfer(_batch(cfg), 0)   # in range: unchanged
    low, high = (value, r"\d+") if value < 0 else (r"\d+", value)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] holds ids from {low} to {high}, outside the vocabulary "
                                         r"\[0, 200\) of GPTConfig.vocab_size=200"):
        module.on_before_batch_transfer(_batch(cfg, **{key: (1, 3, value)}), 0)
    with pytest.raises(ValueError, match="must be an integer tensor"):
        check_token_ids({"tokens": torch.zeros(2, 3)}, 200)


def _fit_bad_batch(rank, world, layout):
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    samples = make_samples(cfg, 8)
    bad = lightning_train_order(8)[5]   # in the second batch of Lightning's (shuffled) order
    samples[bad] = dict(samples[bad], labels=samples[bad]["labels"].clone().index_fill_(0, torch.tensor([4]), 230))
    trainer = trainer_for(world, MegatronStrategy(**layout), 2)
    try:
        trainer.fit(new_module(cfg, 2), DataLoader(ListDataset(samples), batch_size=4))
    except ValueError as e:
        return {"error": str(e), "step": trainer.global_step}
    return {"error": None, "step": trainer.global_step}


def test_label_in_the_padded_vocabulary_raises_at_tp2():
    """tp=2 (vocabulary padded to 256): a label of 230 used to give an infinite loss; now the second batch raises
    on both ranks before any step on it."""
    out = run_distributed(_fit_bad_batch, 2, dict(tp=2))
    assert [o["step"] for o in out] == [1, 1], out
    for o in out:
        assert o["error"] is not None and re.search(r"batch\['labels'\] holds ids from \d+ to 230, outside", o["error"]), o


# ---------------------------------------------------------------------------------------------- 3. replace
@pytest.mark.parametrize("replace", [GPTConfig.replace, dataclasses.replace], ids=["GPTConfig.replace",
                                                                                  "dataclasses.replace"])
def test_replace_recomputes_derived_sizes(replace):
    """Sizes the config filled in (kv_channels, ffn_hidden_size, num_query_groups, max_position_embeddings,
    moe_ffn_hidden_size) follow the new fields; sizes that were given, at construction or in the replace, stay."""
    base = GPTConfig(hidden_size=64, num_attention_heads=4, seq_length=64)
    new = replace(base, hidden_size=256, num_attention_heads=8, seq_length=128)
    assert (new.kv_channels, new.ffn_hidden_size, new.num_query_groups, new.max_position_embeddings) == (32, 1024, 8, 128)
    assert new == GPTConfig(hidden_size=256, num_attention_heads=8, seq_length=128)
    moe = replace(GPTConfig(num_moe_experts=4), ffn_hidden_size=96)
    assert moe.moe_ffn_hidden_size == 96 and moe.is_derived("moe_ffn_hidden_size")
    # given at construction: kept
    given = GPTConfig(hidden_size=64, num_attention_heads=4, kv_channels=8, ffn_hidden_size=100, num_query_groups=2)
    kept = replace(given, hidden_size=128)
    assert (kept.kv_channels, kept.ffn_hidden_size, kept.num_query_groups) == (8, 100, 2)
    assert not kept.is_derived("kv_channels") and kept.is_derived("max_position_embeddings")
    # given in the replace, even equal to the old derived value: kept; None: derived again
    again = replace(base, hidden_size=128, kv_channels=16)
    assert again.kv_channels == 16 and not again.is_derived("kv_channels")
    assert replace(again, kv_channels=None).kv_channels == 32
    # the preset's own sizes are given values: tiny() sets GQA 4/2 and ffn 128, which a replace keeps
    tiny = GPTConfig.tiny().replace(hidden_size=2048, num_attention_heads=16)
    assert (tiny.kv_channels, tiny.num_query_groups, tiny.ffn_hidden_size) == (128, 2, 128)


def test_derived_sizes_are_plain_ints_outside():
    cfg = dataclasses.replace(GPTConfig(), hidden_size=128)
    out = cfg.to_dict()
    assert type(out["kv_channels"]) is int and out["kv_channels"] == 32 and repr(cfg.kv_channels) == "32"
    assert GPTConfig(**out) == cfg                                  # hparams round trip
    assert pickle.loads(pickle.dumps(cfg)).is_derived("kv_channels")   # spawn keeps what was derived
    assert list(inspect.signature(GPTConfig).parameters)[:2] == ["num_layers", "hidden_size"]


# ---------------------------------------------------------------------------------------------- 4. strict loading
def _plain_checkpoint(cfg, path, drop=()):
    """A Lightning checkpoint of a freshly initialised ``cfg`` model in the full (tp=1) layout."""
    pl.seed_everything(SEED, verbose=False)
    module = ParallelGPTModule(cfg)
    module.configure_model()
    state = {k: v for k, v in module.state_dict().items() if k not in drop}
    torch.save({"state_dict": state, "pytorch-lightning_version": pl.__version__}, path)
    return state


def _validate_from(rank, world, cfg, layout, path, strict):
    module = ParallelGPTModule(cfg)
    module.strict_loading = strict
    trainer = trainer_for(world, MegatronStrategy(**layout), 1, limit_val_batches=1,
                          precision="32-true")   # the float32 checkpoint's tensors, compared exactly
    try:
        trainer.validate(module, DataLoader(ListDataset(make_samples(cfg, 4)), batch_size=2), ckpt_path=path,
                         verbose=False)
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None, "state": trainer.strategy.lightning_module_state_dict()}


def test_extra_layer_in_checkpoint_is_refused_at_tp2(tmp_path):
    """A 3-layer checkpoint into a 2-layer model at tp=2 (plain Lightning refuses it too): both ranks raise naming
    the unexpected keys; with strict_loading=False the common keys load exactly."""
    path = str(tmp_path / "3layers.ckpt")
    saved = _plain_checkpoint(tiny_config(num_layers=3), path)
    cfg = tiny_config()
    out = run_distributed(_validate_from, 2, cfg, dict(tp=2), path, True)
    for o in out:
        assert o["error"] is not None and 'Unexpected key(s) in state_dict: "model.decoder.layers.2.' in o["error"]
        assert "Missing key" not in o["error"] and "strict_loading=False" in o["error"]
    loaded = run_distributed(_validate_from, 2, cfg, dict(tp=2), path, False)[0]["state"]
    assert loaded.keys() == {k for k in saved if ".layers.2." not in k}
    for key, value in loaded.items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)


def test_missing_key_is_named_on_every_pipeline_stage(tmp_path):
    """pp=2: a key of the second stage is missing; the first stage, which does not hold it, raises too (a stage
    that went on alone would wait for the other in the first collective)."""
    path = str(tmp_path / "missing.ckpt")
    _plain_checkpoint(tiny_config(), path, drop=("model.decoder.layers.1.mlp.linear_fc2.weight",))
    out = run_distributed(_validate_from, 2, tiny_config(), dict(pp=2), path, True)
    for o in out:
        assert o["error"] is not None
        assert 'Missing key(s) in state_dict: "model.decoder.layers.1.mlp.linear_fc2.weight".' in o["error"]


def test_other_vocabulary_is_refused_even_when_not_strict(tmp_path):
    """A checkpoint of vocabulary 300 (padded to 384 rows) into vocabulary 200 at tp=2 used to load silently, its
    rows cut to 200; now both ranks name the tensors and shapes, also with strict_loading=False."""
    path = str(tmp_path / "vocab300.ckpt")
    _plain_checkpoint(tiny_config(vocab_size=300), path)
    out = run_distributed(_validate_from, 2, tiny_config(), dict(tp=2), path, False)
    for o in out:
        assert o["error"] is not None
        assert ('size mismatch for "model.embedding.word_embeddings.weight": the checkpoint holds shape (384, 32), '
                "the model's full tensor has shape (256, 32)") in o["error"]


# ---------------------------------------------------------------------------------------------- 9. bad settings
BAD_SETTINGS = [
    # GPTConfig: these ended in ZeroDivisionError / TypeError tracebacks, or trained a wrong model silently
    (GPTConfig, dict(num_attention_heads=0), r"num_attention_heads=0 must be >= 1"),
    (GPTConfig, dict(num_query_groups=0), r"num_query_groups=0 must be >= 1 or None"),
    (GPTConfig, dict(make_vocab_size_divisible_by=0), r"make_vocab_size_divisible_by=0 must be >= 1"),
    (GPTConfig, dict(hidden_size="64"), r"hidden_size='64' must be an integer, got str"),
    (GPTConfig, dict(num_layers=2.0), r"num_layers=2.0 must be an integer, got float"),
    (GPTConfig, dict(kv_channels=0), r"kv_channels=0 must be >= 1 or None"),
    (GPTConfig, dict(ffn_hidden_size=0), r"ffn_hidden_size=0 must be >= 1 or None .*0 would train without MLP"),
    (GPTConfig, dict(position_embedding_type="learned_absolute", seq_length=128, max_position_embeddings=64),
     r"seq_length=128 is larger than max_position_embeddings=64"),
    (GPTConfig, dict(swiglu="no"), r"swiglu='no' must be True or False"),
    (GPTConfig, dict(vocab_size=True), r"vocab_size=True must be an integer, got bool"),
    (GPTConfig, dict(norm_epsilon=0.0), r"norm_epsilon=0.0 must be > 0"),
    (GPTConfig, dict(hidden_dropout=1.0), r"hidden_dropout=1.0 must be in \[0, 1\)"),
    # MegatronStrategy / ParallelConfig
    (MegatronStrategy, dict(tp=2, sequence_parallel="no"), r"sequence_parallel='no' must be True or False"),
    (MegatronStrategy, dict(tp=True), r"tp must be a positive integer, got True"),
    (MegatronStrategy, dict(pp=2.0), r"pp must be a positive integer, got 2.0"),
    (MegatronStrategy, dict(use_distributed_optimizer="yes"), r"use_distributed_optimizer='yes' must be True or False"),
    (MegatronStrategy, dict(delay_wgrad_compute=1), r"delay_wgrad_compute=1 must be None .*True or False"),
    (MegatronStrategy, dict(pipeline_schedule="1f1f"), r"pipeline_schedule='1f1f' is not one of"),
    # ParallelGPTModule
    (lambda **kw: ParallelGPTModule(GPTConfig(), **kw), dict(lr=-1e-3), r"lr=-0.001 must be a finite number >= 0"),
    (lambda **kw: ParallelGPTModule(GPTConfig(), **kw), dict(lr=float("nan")), r"lr=nan must be a finite number"),
    (lambda **kw: ParallelGPTModule(GPTConfig(), **kw), dict(adam_beta2=1.0), r"adam_beta2=1.0 must be in \[0, 1\)"),
    (lambda **kw: ParallelGPTModule(GPTConfig(), **kw), dict(lr_decay_style="cosin"),
     r"lr_decay_style='cosin' is not one of \('cosine', 'linear', 'constant'\)"),
    (lambda **kw: ParallelGPTModule(GPTConfig(), **kw), dict(lr_warmup_iters=-5), r"lr_warmup_iters=-5 must be an integer"),
]


@pytest.mark.parametrize("build, kwargs, message", BAD_SETTINGS, ids=[
    f"{getattr(b, '__name__', 'ParallelGPTModule')}-{next(iter(k))}" for b, k, _ in BAD_SETTINGS])
def test_bad_setting_is_refused_naming_it(build, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


def test_pipeline_options_at_pp1_warn():
    """A schedule (or an uneven split) given at pp=1 was ignored silently; now a warning names it."""
    with pytest.warns(UserWarning, match=r"pipeline_schedule='gpipe' has no effect with pp=1"):
        MegatronStrategy(pipeline_schedule="gpipe")
    with pytest.warns(UserWarning, match=r"num_layers_in_first_pipeline_stage=1 has no effect with pp=1"):
        ParallelConfig(num_layers_in_first_pipeline_stage=1)


# ---------------------------------------------------------------------------------------------- 6. temporary files
class _SlowToPickle:
    """Pickling it signals ``flag`` and sleeps: a save caught in the middle (its temporary file is open)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        open(self.flag, "w").close()
        time.sleep(60)
        return (str, ("never",))


def _save_slowly(path: str, flag: str) -> None:
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(4), "slow": _SlowToPickle(flag)}, path)


def _stale(path, seconds=3600):
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_killed_checkpoint_save_keeps_the_old_file_and_its_leftover_is_removed(tmp_path):
    """SIGKILL during a save: the checkpoint under the final name is still the previous, complete one; the
    half-written file is beside it (not in the system temp directory), and the next save removes it."""
    path, flag = tmp_path / "last.ckpt", str(tmp_path / "saving")
    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.zeros(4)}, path)
    proc = mp.get_context("spawn").Process(target=_save_slowly, args=(str(path), flag))
    proc.start()
    deadline = time.time() + 60
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(4))
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp-")]
    assert len(leftovers) == 1 and str(proc.pid) in leftovers[0].name
    live = tmp_path / f".other.ckpt.tmp-{os.getpid()}-{'a' * 32}"   # a live writer's file: kept
    live.write_bytes(b"")
    for p in (leftovers[0], live):
        _stale(p)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "next.ckpt")
    assert not leftovers[0].exists() and live.exists()
    assert torch.equal(torch.load(tmp_path / "next.ckpt", weights_only=True)["w"], torch.ones(4))


def test_strategy_saves_atomically_by_default():
    assert isinstance(MegatronStrategy().checkpoint_io, AtomicCheckpointIO)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_killed_preprocessing_leftovers_are_removed_by_the_next_run(tmp_path):
    """A killed preprocessing run leaves ``.<name>.bin.tmp-PID-...`` beside its output; the next run into that
    directory removes it (the writer is gone and it is not being written), and keeps everything else."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n', encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    pid = _dead_pid()
    stale = [out / f".x_text_document.bin.tmp-{pid}-{'b' * 12}", out / f".x_text_document.idx.tmp-{pid}-{'b' * 12}"]
    recent = out / f".y_text_document.bin.tmp-{pid}-{'c' * 12}"   # modified just now: could still be written
    other = out / ".notes.tmp-keep"
    for p in stale + [recent, other]:
        p.write_bytes(b"partial")
    for p in stale + [other]:
        _stale(p)
    preprocess_jsonl(src, out / "x", tokenizer_type="ByteTokenizer", progress=False)
    assert not any(p.exists() for p in stale)
    assert recent.exists() and other.exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "x_text_document.bin", "x_text_document.idx"]


# ---------------------------------------------------------------------------------------------- 7. encoding faults
@pytest.mark.parametrize("line, reason", [
    (b'{"text": "caf\xe9"}\n', r"not valid UTF-8 \(invalid continuation byte: byte b'\\xe9' at byte 14 of the line\)"),
    (b'{"text": "lone \\ud800 surrogate"}\n', r"key 'text' holds '\\ud800' at character 5, which is not encodable"),
], ids=["latin-1 byte", "lone surrogate"])
def test_encoding_faults_name_file_and_line_and_can_be_skipped(tmp_path, line, reason):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "one"}\n' + line + b'{"text": "three"}\n')
    with pytest.raises(PreprocessError, match=rf"{re.escape(str(src))}:2: {reason}"):
        preprocess_jsonl(src, tmp_path / "a" / "x", tokenizer_type="ByteTokenizer", progress=False)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    result = preprocess_jsonl(src, tmp_path / "b" / "x", tokenizer_type="ByteTokenizer", progress=False,
                              skip_bad_lines=True)
    assert result.skipped_lines == [2] and result.documents == 2


# ---------------------------------------------------------------------------------------------- 8. index cache key
def _write_documents(prefix, documents):
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for doc in documents:
            writer.add_document(doc)


def test_index_cache_follows_the_data_not_its_size(tmp_path):
    """The same documents re-preprocessed in another order (same file sizes): the cached indices of the first
    order used to be reused (samples cut at the old document boundaries, or an IndexError); now the second
    dataset builds its own and reads exactly what a cache-less build reads."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=n).tolist() for n in (5, 40, 9, 23, 3, 31, 12, 7)]
    prefix, cache = str(tmp_path / "d_text_document"), tmp_path / "cache"
    _write_documents(prefix, docs)
    first = GPTDataset(prefix, seq_length=8, num_samples=12, seed=3, cache_dir=cache)
    assert first.built_anew
    _write_documents(prefix, docs[::-1])
    second = GPTDataset(prefix, seq_length=8, num_samples=12, seed=3, cache_dir=cache)
    fresh = GPTDataset(prefix, seq_length=8, num_samples=12, seed=3, cache_dir=False)
    assert second.built_anew and second.description_hash != first.description_hash
    for i in range(len(fresh)):
        assert torch.equal(second[i]["tokens"], fresh[i]["tokens"])
    again = GPTDataset(prefix, seq_length=8, num_samples=12, seed=3, cache_dir=cache)
    assert not again.built_anew   # unchanged data: the cache is used
