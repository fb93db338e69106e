"""No hangs, no orphans, and the non-finite guard's skip mode, on CPU/gloo in real processes.

The hang tests run ``tests/_stall_job.py`` as a user runs a script (Lightning's popen launch: rank 0 starts rank 1)
and check, by pid, that no process of the job is left.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import tempfile
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.parallel.config import ParallelConfig
from tests._dist import run_distributed, run_each
from tests.parity import (SEED, ListDataset, LossRecorder, PoisonGradientOnce, WeightsAfterStep, make_samples,
                          new_module, tiny_config, trainer_for)
from tests.test_robustness import _save_after_poison   # its sharded-checkpoint case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------- options
def test_timeout_options_are_one_setting():
    """``distributed_timeout_minutes`` (Megatron's name) sets the strategy's ``timeout``; both given and different
    is refused; bad values are named."""
    assert MegatronStrategy(distributed_timeout_minutes=2)._timeout == timedelta(minutes=2)
    assert MegatronStrategy(timeout=timedelta(minutes=2), distributed_timeout_minutes=2)._timeout == timedelta(minutes=2)
    with pytest.raises(ValueError, match="disagree"):
        MegatronStrategy(timeout=timedelta(seconds=30), distributed_timeout_minutes=2)
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError, match="distributed_timeout_minutes"):
            ParallelConfig(distributed_timeout_minutes=bad)
    with pytest.raises(ValueError, match="ckpt_format='bogus'"):
        ParallelConfig(ckpt_format="bogus")
    with pytest.raises(ValueError, match="async_save=True needs ckpt_format='torch_dist'"):
        ParallelConfig(async_save=True)
    with pytest.raises(ValueError, match="'skip'"):
        ParallelConfig(check_for_nan_in_loss_and_grad="drop")


# ---------------------------------------------------------------------------------------------- hangs and orphans
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)   # a zombie is dead
    except FileNotFoundError:
        return True


def _start_job(stall_rank: int, out, seconds: float, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "_stall_job.py"), str(stall_rank), str(out),
                             str(seconds), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(path, timeout: float = 120) -> None:
    end = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < end, f"{path} did not appear"
        time.sleep(0.2)
    time.sleep(0.5)


def _pids(out):
    return [int(open(out / f"pid{r}").read()) for r in (0, 1)]


@pytest.fixture
def jobs():
    started = []
    yield started
    for proc in started:          # a failing test leaves nothing behind either
        if proc.poll() is None:
            proc.kill()


def test_stalled_rank_times_out_on_a_subgroup_and_takes_the_job_down(tmp_path, jobs):
    """tp=2, rank 1 stalls at step 1 while rank 0 waits in a tensor-parallel collective (a mesh sub-group, whose
    timeout used to be torch's 30-minute default whatever the strategy's): rank 0 times out after the strategy's
    15 s and ends the job; rank 1 does not outlive it. (15 s, not less: on a loaded 2-core machine an ordinary
    step-0 collective can wait several seconds for the slower rank.)"""
    job = _start_job(1, tmp_path, 15)
    jobs.append(job)
    _wait_for(tmp_path / "stalled")
    start = time.time()
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0, out[-3000:]
    assert "Timed out waiting 15000ms" in out, out[-3000:]
    assert time.time() - start < 60
    pids = _pids(tmp_path)
    end = time.time() + 10
    while not all(_gone(p) for p in pids) and time.time() < end:
        time.sleep(0.2)
    assert all(_gone(p) for p in pids), pids


@pytest.mark.parametrize("handler", [False, True], ids=["plain", "exit_signal_handler"])
def test_sigterm_to_a_rank_blocked_in_a_collective_ends_the_job(tmp_path, jobs, handler):
    """Rank 0 stalls at step 1 (10-minute timeout); rank 1 is blocked in a collective waiting for it, where no
    Python signal handler can run. SIGTERM to rank 1 ends it after the grace period, and rank 0, which launched it,
    ends the job: everything is gone within seconds, far before any timeout. The same with exit_signal_handler=True
    (whose handler, which would save at the end of the step, never runs there)."""
    job = _start_job(0, tmp_path, 600, *(["--exit-signal-handler"] if handler else []))
    jobs.append(job)
    _wait_for(tmp_path / "stalled")
    pids = _pids(tmp_path)
    start = time.time()
    os.kill(pids[1], signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0, out[-3000:]
    assert time.time() - start < 30, out[-3000:]
    assert "SIGTERM received" in out, out[-3000:]   # the rank ended itself, blocked as it was
    assert "code 143" in out, out[-3000:]           # and rank 0 noticed its exit (its watcher or Lightning's)
    assert all(_gone(p) for p in pids), pids


# ---------------------------------------------------------------------------------------------- skip mode
def _skip_run(rank, world, clip, adamw=None):
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    weights, losses = WeightsAfterStep(), LossRecorder()
    strategy = MegatronStrategy(tp=2, check_for_nan_in_loss_and_grad="skip")
    callbacks = [PoisonGradientOnce(1, 1), weights, losses]
    if adamw:   # a checkpoint after every step: the skip is counted there (before writing), logged a step later
        callbacks.append(ModelCheckpoint(dirpath=tempfile.mkdtemp(), every_n_train_steps=1, save_top_k=-1))
    trainer = trainer_for(world, strategy, 4, callbacks=callbacks, gradient_clip_val=clip)
    module = new_module(cfg, 4, adamw=adamw)
    trainer.fit(module, DataLoader(ListDataset(make_samples(cfg, 16)), batch_size=4))
    if adamw:   # the checks were decided on the device: the optimizer skipped the step by itself
        assert strategy.run.guard.on_device
    w = weights.after_step
    return {"global_step": trainer.global_step, "skipped": strategy.skipped_steps,
            "logged": float(trainer.callback_metrics["skipped_steps"]), "losses": losses.losses,
            "changed": [not torch.equal(w[i], w[i + 1]) for i in range(len(w) - 1)],
            "finite": bool(torch.isfinite(w[-1]).all())}


def _case(rank, world, kind, arg):
    if kind == "skip":
        return _skip_run(rank, world, arg)
    if kind == "skip_fused":
        return _skip_run(rank, world, arg, adamw="fused")
    if kind == "skip_bf16_moments":
        return _skip_run(rank, world, arg, adamw="bf16_moments")
    return _save_after_poison(rank, world, True, arg, ckpt_format="torch_dist")


def test_skip_mode_drops_the_step_on_every_rank_and_goes_on(tmp_path):
    """check_for_nan_in_loss_and_grad="skip", tp=2, a NaN gradient on rank 1 at step 1 (without clipping: the
    gradient check; with clipping: the global norm): both ranks drop that step (the weights after it equal those
    before), count and log it, and train on with finite weights to the end. Non-finite weights are still refused
    a checkpoint, a sharded one too (nothing is written, not even a temporary directory). The same with a fused
    AdamW, whose checks are decided on the device (the optimizer skips the update, the host learns it a step later),
    and with the precision-aware AdamW (bf16 moments), which skips on the device too."""
    path = tmp_path / "bad.ckpt"
    cases = [("no_clip", ("skip", None)), ("clip", ("skip", 1.0)), ("fused_no_clip", ("skip_fused", None)),
             ("fused_clip", ("skip_fused", 1.0)), ("bf16_moments_no_clip", ("skip_bf16_moments", None)),
             ("refuse", ("refuse", str(path)))]
    out = run_distributed(run_each, 2, _case, cases)
    assert os.listdir(tmp_path) == []
    for rank, results in enumerate(out):
        refused = results.pop("refuse")
        assert refused is not None and "rank 1: weight model.decoder.layers.0.self_attention.linear_qkv.weight (nan)" \
            in refused and "no checkpoint was written" in refused, refused
        for name, r in results.items():
            assert isinstance(r, dict), f"rank {rank} {name}:\n{r}"
            assert r["global_step"] == 4 and r["skipped"] == 1 and r["logged"] == 1.0, (name, r)
            assert r["changed"] == [False, True, True], (name, r["changed"])   # step 1 (the 2nd) was dropped
            assert r["finite"] and all(math.isfinite(x) for x in r["losses"]), (name, r)
