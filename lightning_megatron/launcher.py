"""Process launch for :class:`~lightning_megatron.MegatronStrategy`: the spawn launcher that hands the main
process full (gathered) weights, and the one environment variable the library reads (Lightning's global seed)."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn

import lightning.pytorch as pl

DEFAULT_SEED = 1234  # Megatron's --seed default, used when seed_everything was not called


def global_seed() -> int:
    """The seed ``lightning.seed_everything`` exported to this process (``PL_GLOBAL_SEED``; it reaches every
    launched rank), else :data:`DEFAULT_SEED`."""
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value is not None else DEFAULT_SEED


class MegatronMultiProcessingLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the main process full (gathered) weights instead of rank 0's TP shards."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # Tear the process groups down before the worker exits: left to interpreter shutdown, the gloo threads
        # of the mesh's subgroups abort the worker now and then ("terminate called without an active
        # exception", SIGABRT), which fails the whole run after training succeeded.
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        strategy = self._strategy
        state_dict = strategy.lightning_module_state_dict() if trainer.state.fn == TrainerFn.FITTING else None
        if strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: "pl.Trainer") -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None:
            if not any(True for _ in module.parameters()):
                with torch.device("meta"):
                    module.configure_model()
            ckpt = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(ckpt, strict=False, assign=True)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
