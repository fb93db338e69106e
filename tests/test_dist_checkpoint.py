"""Sharded checkpoints (``ckpt_format="torch_dist"``, :mod:`lightning_megatron.checkpoint.distributed`) on CPU/gloo:
resharding across layouts against a single-process reference, and a run killed (SIGKILL) during a background
save that resumes bit-exactly from its last complete checkpoint."""
from __future__ import annotations

import json
import os
import signal
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.checkpoint.distributed import METADATA_FILE, is_sharded_checkpoint, verify_checkpoint
from tests._dist import run_distributed
from tests.parity import (
    SEED,
    ListDataset,
    LossRecorder,
    assert_state_close,
    make_samples,
    new_module,
    reference_loop,
    tiny_config,
    trainer_for,
)
from tests.test_strategy import GLOBAL_BATCH, N_TRAIN, RESUME_STEPS, SAVE_AT, resume_order


# ---------------------------------------------------------------------------------------------- 1. resharding
def _save_tp2_pp2(rank, world, cfg, samples, path):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, RESUME_STEPS)
    strategy = MegatronStrategy(tp=2, pp=2, pipeline_schedule="gpipe", ckpt_format="torch_dist")
    trainer = trainer_for(world, strategy, SAVE_AT, callbacks=[LossRecorder()])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=GLOBAL_BATCH))
    trainer.save_checkpoint(path)
    return trainer.callbacks[0].losses


def _resume(rank, world, cfg, samples, kwargs, micro_batch, path):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, RESUME_STEPS)
    recorder = LossRecorder()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), RESUME_STEPS, callbacks=[recorder])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch), ckpt_path=path)
    state = trainer.strategy.full_state_dict()   # collective
    return {"losses": recorder.losses, "global_step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"], "state": state if rank == 0 else None}


@pytest.fixture(scope="module")
def tp2_pp2_checkpoint(tmp_path_factory):
    cfg = tiny_config(num_query_groups=4)
    samples = make_samples(cfg, N_TRAIN)
    path = str(tmp_path_factory.mktemp("dcp") / "tp2pp2.ckpt")
    saved = run_distributed(_save_tp2_pp2, 4, cfg, samples, path)
    ref = reference_loop(cfg, samples, RESUME_STEPS, GLOBAL_BATCH, order=resume_order())
    return dict(cfg=cfg, samples=samples, path=path, saved=saved, ref=ref)


def test_sharded_checkpoint_is_written_by_every_rank(tp2_pp2_checkpoint):
    """tp2 x pp2: a directory with DCP's metadata and one data file per rank, each holding that rank's shards only
    (no rank's file holds the whole model), and no temporary directory beside it."""
    case = tp2_pp2_checkpoint
    path = case["path"]
    assert is_sharded_checkpoint(path)
    files = sorted(f for f in os.listdir(path) if f != METADATA_FILE)
    assert files == [f"__{r}_0.distcp" for r in range(4)], files
    sizes = [os.path.getsize(os.path.join(path, f)) for f in files]
    assert max(sizes) < 0.5 * sum(sizes), sizes
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    verify_checkpoint(path)
    for losses in case["saved"]:
        assert losses == pytest.approx(case["ref"]["losses"][:SAVE_AT], rel=1e-5)


@pytest.mark.parametrize("world,kwargs", [(2, dict(tp=1, use_distributed_optimizer=True)),
                                          (4, dict(pp=2, pipeline_schedule="gpipe")), (1, dict())],
                         ids=["tp2xpp2-to-dp2-distributed-optimizer", "tp2xpp2-to-pp2xdp2", "tp2xpp2-to-single"])
def test_sharded_checkpoint_reshards(tp2_pp2_checkpoint, world, kwargs):
    """Saved under tp2 x pp2, resumed under dp2 (with the distributed optimizer), pp2 x dp2 and one process: the
    losses of steps 3-4 equal the uninterrupted single-process run's to 1e-6, the LR schedule continues, and the
    final weights match (Adam's moments and step count came back: without them step 4 would differ)."""
    case = tp2_pp2_checkpoint
    dp = world // kwargs.get("pp", 1)
    kwargs = dict(kwargs, ckpt_format="torch_dist")
    results = run_distributed(_resume, world, case["cfg"], case["samples"], kwargs, GLOBAL_BATCH // dp, case["path"])
    ref = case["ref"]
    for r in results:
        assert r["global_step"] == RESUME_STEPS
        assert len(r["losses"]) == RESUME_STEPS - SAVE_AT
        for got, want in zip(r["losses"], ref["losses"][SAVE_AT:]):
            assert abs(got - want) <= 1e-6 * abs(want), (r["losses"], ref["losses"][SAVE_AT:])
        assert r["lr"] == pytest.approx(ref["optimizer"]["param_groups"][0]["lr"], rel=1e-12)
    assert_state_close(results[0]["state"], ref["state"])


# ---------------------------------------------------------------------------------------------- 2. fault injection
EPOCHS = 3
N_FAULT = 8          # two global batches of 4 per epoch: checkpoints at epoch ends (steps 2, 4)


class _KillDuringSave(pl.Callback):
    """SIGKILL this rank while the background save that ``ModelCheckpoint`` started at the end of epoch ``epoch``
    is writing (the writer is slowed down for that save; the kill comes at the start of the next epoch, as
    ``ModelCheckpoint`` runs after the other callbacks)."""

    def __init__(self, epoch: int, losses: LossRecorder, out: str) -> None:
        self.epoch, self.losses, self.out = epoch, losses, out

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch + 1:
            with open(f"{self.out}.losses{trainer.global_rank}", "w") as f:   # what the run did before it died
                json.dump(self.losses.losses, f)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.current_epoch == self.epoch:
            trainer.strategy.finish_checkpoints()   # the previous epoch's save completes at normal speed
            from torch.distributed.checkpoint import FileSystemWriter

            write = FileSystemWriter.write_data

            def slow_write(writer, plan, planner):
                time.sleep(2.0)
                return write(writer, plan, planner)

            FileSystemWriter.write_data = slow_write


def _fault_run(rank, world, cfg, samples, path, kill_epoch, ckpt_path):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, EPOCHS * 2)
    recorder = LossRecorder()
    saver = ModelCheckpoint(dirpath=path, filename="{step}", save_top_k=1, every_n_epochs=1,
                            save_on_train_epoch_end=True)
    callbacks = [recorder, saver] + ([_KillDuringSave(kill_epoch, recorder, path)] if kill_epoch is not None else [])
    strategy = MegatronStrategy(use_distributed_optimizer=True, ckpt_format="torch_dist", async_save=True)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=EPOCHS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=GLOBAL_BATCH // world, shuffle=True),
                ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "global_step": trainer.global_step}


def test_killed_async_save_resumes_bit_exact_from_last_complete_checkpoint(tmp_path):
    """dp2 with the distributed optimizer and background saves, one checkpoint per epoch, ModelCheckpoint keeping
    one: both ranks SIGKILLed while epoch 2's checkpoint is being written. The directory then holds epoch 1's
    complete checkpoint (its removal waited for a successor that never completed) and the killed save's temporary
    directory only; a restart from it cleans the leftover and trains steps 3-6, steps 3-4 with losses bit-exact to
    those the killed run had trained uninterrupted. A truncated shard file is named when loading."""
    cfg = tiny_config()
    samples = make_samples(cfg, N_FAULT)
    path = tmp_path / "killed"
    with pytest.raises(AssertionError, match="exit code -9"):
        run_distributed(_fault_run, 2, cfg, samples, str(path), 1, None)
    before = [json.load(open(f"{path}.losses{r}")) for r in (0, 1)]
    assert all(len(b) == 4 for b in before), before
    entries = sorted(os.listdir(path))
    assert len(entries) == 2 and entries[1] == "step=2.ckpt", entries
    assert entries[0].startswith(".step=4.ckpt.dcp-tmp-"), entries
    assert is_sharded_checkpoint(path / "step=2.ckpt")
    resumed = run_distributed(_fault_run, 2, cfg, samples, str(path), None, str(path / "step=2.ckpt"))
    for r, b in zip(resumed, before):
        assert r["global_step"] == EPOCHS * 2 and len(r["losses"]) == 4
        assert r["losses"][:2] == b[2:]                   # bit-exact
    # the leftover is cleaned and step 4's checkpoint rotated out once step 6's completed (the resumed-from one is
    # not ModelCheckpoint's to rotate)
    assert sorted(os.listdir(path)) == ["step=2.ckpt", "step=6.ckpt"]
    shard = path / "step=6.ckpt" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(RuntimeError, match=rf"shard file {shard} is truncated"):
        verify_checkpoint(str(path / "step=6.ckpt"))


# ---------------------------------------------------------------------------------------------- 3. experts
def _moe_config():
    return tiny_config(num_moe_experts=4, moe_ffn_hidden_size=32, num_query_groups=4)


def _moe_save(rank, world, path):
    pl.seed_everything(SEED, verbose=False)
    cfg = _moe_config()
    trainer = trainer_for(world, MegatronStrategy(ep=2, tp=2, etp=1, sequence_parallel=True, ckpt_format="torch_dist"), 2)
    trainer.fit(new_module(cfg, 4), DataLoader(ListDataset(make_samples(cfg, 16)), batch_size=2))
    trainer.save_checkpoint(path)
    state = trainer.strategy.full_state_dict()
    return state if rank == 0 else None


def _moe_load(rank, world, path):
    pl.seed_everything(SEED, verbose=False)
    cfg = _moe_config()
    trainer = trainer_for(world, MegatronStrategy(ep=2, etp=1, use_distributed_optimizer=True), 2)
    trainer.fit(new_module(cfg, 4), DataLoader(ListDataset(make_samples(cfg, 16)), batch_size=4), ckpt_path=path)
    state = trainer.strategy.full_state_dict()
    return state if rank == 0 else None


def test_sharded_moe_checkpoint_reshards_across_expert_layouts(tmp_path):
    """Routed experts saved under ep2 x tp2 (etp1, sequence parallel) load under ep2 x dp2 with the distributed
    optimizer (experts' states over edp): every full tensor equal to the saved one."""
    path = str(tmp_path / "moe.ckpt")
    saved = run_distributed(_moe_save, 4, path)[0]
    loaded = run_distributed(_moe_load, 2, path)[0]
    assert saved.keys() == loaded.keys()
    assert any(".experts." in k for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
