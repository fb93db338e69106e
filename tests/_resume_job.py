"""A tiny 2-rank training job with injected faults, for the restart / resume / preemption tests
(tests/test_long_runs.py). :func:`train` is one rank's run; as a script it runs under torchrun or as a user's
script (Lightning's popen launch, ``--devices 2``):

    python tests/_resume_job.py OUT LAYOUT FORMAT FAULTS [--steps N] [--exit-signal-handler] [--devices 2]

LAYOUT: ``tp2`` (sequence parallel), ``pp2``, ``dp2_distopt`` (distributed optimizer). FORMAT: ``torch``,
``torch_dist`` or ``torch_dist_async``. FAULTS: comma-separated ``KIND@STEP:RANK`` (``-``: none), each fired once
over all restarts (a marker file in OUT remembers it): ``kill`` (SIGKILL at the start of step STEP), ``raise`` (an
error there), ``term`` (SIGTERM to itself there), ``term_in_save`` (SIGTERM while the checkpoint of step STEP is
being written), ``kill_in_save`` (SIGKILL while the background save of step STEP is writing).

Each rank appends ``{"start": step}`` and ``{"step": s, "loss": l}`` lines to ``OUT/log<rank>.jsonl``; rank 0
writes the full final weights to ``OUT/final.pt`` when ``fit`` returns.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_megatron import MegatronStrategy  # noqa: E402
from lightning_megatron.data.gpt_datamodule import GPTDataModule  # noqa: E402
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2), "dp2_distopt": dict(use_distributed_optimizer=True)}
FORMATS = {"torch": dict(), "torch_dist": dict(ckpt_format="torch_dist"),
           "torch_dist_async": dict(ckpt_format="torch_dist", async_save=True)}
GLOBAL_BATCH = 4
SAVE_EVERY = 2


class ListGPTDataModule(GPTDataModule):
    """GPTDataModule (Megatron's sampler, its resume point saved in checkpoints) over fixed in-memory samples."""

    def __init__(self, samples, micro_batch_size: int) -> None:
        super().__init__("in-memory", seq_length=samples[0]["tokens"].numel(), micro_batch_size=micro_batch_size,
                         global_batch_size=GLOBAL_BATCH, eval_iters=0, num_workers=0, check_accumulation=False)
        self.samples = samples

    def build_dataset(self, split: str):
        return ListDataset(self.samples) if split == "train" else None


def parse_faults(text: str) -> List[Tuple[str, int, int]]:
    if text in ("", "-"):
        return []
    out = []
    for item in text.split(","):
        kind, where = item.split("@")
        step, rank = where.split(":")
        out.append((kind, int(step), int(rank)))
    return out


class Faults(pl.Callback):
    """Fire each fault once over all restarts (marker files), and log starts and per-step losses."""

    def __init__(self, out: str, faults: List[Tuple[str, int, int]]) -> None:
        self.out, self.faults = out, faults

    def _due(self, trainer, kinds) -> Optional[Tuple[int, str]]:
        for i, (kind, step, rank) in enumerate(self.faults):
            marker = os.path.join(self.out, f"fault{i}.done")
            if kind in kinds and step == trainer.global_step and rank == trainer.global_rank \
                    and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                return i, kind
        return None

    def _log(self, trainer, record) -> None:
        with open(os.path.join(self.out, f"log{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        self._log(trainer, {"start": trainer.global_step, "pid": os.getpid()})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        due = self._due(trainer, ("kill", "raise", "term"))
        if due is None:
            return
        if due[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if due[1] == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise RuntimeError(f"injected fault at step {trainer.global_step} on rank {trainer.global_rank}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._log(trainer, {"step": trainer.global_step, "loss": float(trainer.callback_metrics["train_loss"])})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        due = self._due(trainer, ("term_in_save", "kill_in_save"))
        if due is None:
            return
        if due[1] == "term_in_save":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)   # the save goes on; the signal is taken at the end of the step
            return
        from torch.distributed.checkpoint import FileSystemWriter   # kill_in_save: die while the shards are written

        write = FileSystemWriter.write_data

        def write_then_die(writer, plan, planner):
            future = write(writer, plan, planner)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
            return future

        FileSystemWriter.write_data = write_then_die


def train(rank: int, world: int, out: str, layout: str, fmt: str, faults: str, steps: int = 8,
          exit_signal_handler: bool = False, devices: Optional[int] = None) -> Any:
    """One rank of the job (see the module doc); returns its ``trainer.global_step``."""
    os.makedirs(out, exist_ok=True)
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    strategy = MegatronStrategy(**LAYOUTS[layout], **FORMATS[fmt], auto_resume=True,
                                exit_signal_handler=exit_signal_handler, distributed_timeout_minutes=1)
    saver = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}", every_n_train_steps=SAVE_EVERY,
                            save_top_k=-1)
    trainer = trainer_for(devices or world, strategy, steps, callbacks=[Faults(out, parse_faults(faults)), saver])
    dp = 2 if layout.startswith("dp2") else 1
    data = ListGPTDataModule(make_samples(cfg, steps * GLOBAL_BATCH), GLOBAL_BATCH // dp)
    trainer.fit(new_module(cfg, steps), datamodule=data)
    state = strategy.full_state_dict()
    if trainer.global_rank == 0:
        torch.save(state, os.path.join(out, "final.pt"))
    return trainer.global_step


def spawn_train(out: str, faults: str, max_restarts: int, steps: int = 8) -> Any:
    """The ``dp2_distopt`` job from this (main) process through the strategy's own launcher (``start_method="spawn"``,
    ``max_restarts``); returns the trainer (its module holds the full final weights) and the launcher's restarts."""
    os.makedirs(out, exist_ok=True)
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    strategy = MegatronStrategy(**LAYOUTS["dp2_distopt"], auto_resume=True, start_method="spawn",
                                max_restarts=max_restarts, distributed_timeout_minutes=1)
    saver = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}", every_n_train_steps=SAVE_EVERY,
                            save_top_k=-1)
    trainer = trainer_for(2, strategy, steps, callbacks=[Faults(out, parse_faults(faults)), saver])
    data = ListGPTDataModule(make_samples(cfg, steps * GLOBAL_BATCH), GLOBAL_BATCH // 2)
    trainer.fit(new_module(cfg, steps), datamodule=data)
    return trainer, strategy.launcher.restarts


def main() -> None:
    out, layout, fmt, faults = sys.argv[1:5]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 8
    devices = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else None
    world = int(os.environ.get("WORLD_SIZE", devices or 1))
    train(int(os.environ.get("RANK", 0)), world, out, layout, fmt, faults, steps,
          exit_signal_handler="--exit-signal-handler" in sys.argv, devices=devices)


if __name__ == "__main__":
    main()
