"""A 2-process tp=2 training job (popen launch, as a user's script) in which one rank stalls at step 1; run by
tests/test_reliability.py. Each rank writes its pid to ``OUT/pid<rank>`` and the stalled one ``OUT/stalled``.

    python tests/_stall_job.py STALL_RANK OUT TIMEOUT_SECONDS [--exit-signal-handler]
"""
import os
import sys
import time
from datetime import timedelta

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_megatron import MegatronStrategy  # noqa: E402
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config  # noqa: E402


class Stall(pl.Callback):
    def __init__(self, rank: int, out: str) -> None:
        self.rank, self.out = rank, out

    def on_train_start(self, trainer, pl_module) -> None:
        with open(os.path.join(self.out, f"pid{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1 and trainer.global_rank == self.rank:
            with open(os.path.join(self.out, "stalled"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)


def main() -> None:
    stall_rank, out, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    handler = "--exit-signal-handler" in sys.argv
    strategy = MegatronStrategy(tp=2, timeout=timedelta(seconds=seconds), exit_signal_handler=handler)
    callbacks = [Stall(stall_rank, out)] + ([ModelCheckpoint(dirpath=os.path.join(out, "ckpt"))] if handler else [])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=handler, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(new_module(cfg, 3), DataLoader(ListDataset(make_samples(cfg, 12)), batch_size=4))


if __name__ == "__main__":
    main()
