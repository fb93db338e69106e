"""The checkpoint hooks of :class:`~lightning_megatron.strategy.MegatronStrategy` (a mixin it inherits first).

``ckpt_format="torch"``: full, layout-independent tensors (TP shards gathered, pipeline stages merged,
:mod:`lightning_megatron.checkpoint.state_dict`), written by rank 0 through the strategy's ``checkpoint_io``.
``"torch_dist"``: each rank's shards through ``torch.distributed.checkpoint`` (:mod:`lightning_megatron.checkpoint.distributed`).
Both are read back under any layout. Non-finite weights are refused before anything is written; bf16 parameters
are saved and loaded through their fp32 main view; with ``overlap_param_gather`` the parameters in flight are
waited for first.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_megatron.parallel.distributed_optimizer import gathered_state_dict, is_sharded_optimizer
from lightning_megatron.parallel.fsdp import distribute_like
from lightning_megatron.checkpoint.state_dict import (
    full_model_state_dict,
    full_optimizer_state_dict,
    shard_model_state_dict,
    shard_optimizer_state_dict,
)

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """Lightning's checkpoint hooks for :class:`~lightning_megatron.strategy.MegatronStrategy` (which provides
    ``run``: its :class:`~lightning_megatron.run.ParallelRun`, the sharded writer, the main view, the pipeline group;
    ``parallel_config``, ``lightning_module``, ``optimizers`` and the Lightning strategy base these methods'
    ``super()`` calls reach)."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load ``ckpt_path`` after :meth:`setup`: before it the weights are on the meta device (loading into
        them is a silent no-op) and not yet sharded."""
        return True

    def _sharded_writer(self) -> Any:
        """The run's sharded checkpoint writer (``ckpt_format="torch_dist"``, :meth:`ParallelRun.start_sharded_io`),
        else None."""
        return self.run.sharded_io if self.run is not None else None

    def _main_view(self) -> Any:
        """bf16 parameters: a context in which they hold their fp32 main values (checkpoints), else nothing."""
        return self.run.main_view() if self.run is not None else contextlib.nullcontext()

    def _pp_group(self) -> Any:
        return self.run.pp_group() if self.run is not None else None

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are saved as sharded directories (``ckpt_format="torch_dist"``)."""
        return self.parallel_config.ckpt_format == "torch_dist"

    def _check_weights(self) -> None:
        guard = self.run.guard if self.run is not None else None
        if guard is not None:
            self.settle_non_finite(log_skip=False)   # a device-decided non-finite step raises before anything is written
            trainer = self.lightning_module._trainer
            guard.step = trainer.global_step if trainer is not None else None
            with self._main_view():
                guard.check_weights()

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """The model state for a checkpoint; non-finite weights raise
        :class:`~lightning_megatron.parallel.nonfinite.NonFiniteError` on every rank, so nothing is written.

        ``ckpt_format="torch"``: full, layout-independent tensors (TP shards gathered; collective on every rank).
        ``"torch_dist"``: this rank's shards, each described by its place in the full tensor (no communication).
        With bf16 parameters the values are the fp32 main parameters.
        """
        self.wait_for_parameters()
        self._check_weights()
        if self.sharded_checkpoints:
            from lightning_megatron.checkpoint.sharded_state import ShardLayout, model_entries

            module = self.lightning_module
            with self._main_view():
                return model_entries(module, module.state_dict(), ShardLayout(module),
                                     copy=self.parallel_config.async_save)
        return self.full_state_dict()

    def full_state_dict(self) -> Dict[str, Any]:
        """Full, layout-independent model state (TP shards gathered, stages merged; collective on every rank)."""
        with self._main_view():
            return full_model_state_dict(self.lightning_module, self._pp_group())

    def optimizer_state(self, optimizer: Optimizer) -> Any:
        """Full optimizer state (per-parameter state of TP shards gathered; collective on every rank), or under
        ``"torch_dist"`` this rank's shards of the states it keeps (see :meth:`lightning_module_state_dict`)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)   # unwrap a LightningOptimizer
        if self.sharded_checkpoints:
            from lightning_megatron.checkpoint.sharded_state import ShardLayout, optimizer_entries

            index = [getattr(o, "_optimizer", o) for o in self.optimizers].index(optimizer)
            return optimizer_entries(index, optimizer, ShardLayout(self.lightning_module),
                                     copy=self.parallel_config.async_save)
        raw = gathered_state_dict(optimizer) if is_sharded_optimizer(optimizer) else None
        return full_optimizer_state_dict(optimizer, self.lightning_module, self._pp_group(), raw=raw)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """``"torch"``: rank 0 writes one file (``checkpoint_io``). ``"torch_dist"``: every rank writes its shards
        into directory ``filepath``, complete or absent (:func:`~lightning_megatron.checkpoint.distributed.save_sharded`)."""
        if not self.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("ckpt_format='torch_dist' does not take storage_options")
        from lightning_megatron.checkpoint.distributed import save_sharded

        save_sharded(self._sharded_writer(), checkpoint, str(filepath), self.global_rank,
                     self.run.layout_signature(self.world_size), self.root_device, self.tp_rng)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """A file: Lightning's load (full tensors, sharded by :meth:`load_model_state_dict`). A sharded directory:
        every rank reads the blocks of its own shards, whatever layout wrote them
        (:func:`~lightning_megatron.checkpoint.distributed.load_sharded`; collective)."""
        from lightning_megatron.checkpoint.distributed import ShardedCheckpointIO, is_sharded_checkpoint, load_sharded

        writer = self._sharded_writer()
        if not is_sharded_checkpoint(checkpoint_path):
            if writer is not None:
                writer.wait()
            if os.path.isdir(str(checkpoint_path)):
                from lightning_megatron.checkpoint.distributed import verify_checkpoint

                verify_checkpoint(str(checkpoint_path))   # raises: a directory without complete metadata
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        io = writer if writer is not None else ShardedCheckpointIO()
        with self._main_view():   # bf16 parameters: the shards are read into the fp32 main parameters
            return load_sharded(io, str(checkpoint_path), self.lightning_module, self.optimizers if fitting else [],
                                self.global_rank, self.run.layout_signature(self.world_size), self.root_device,
                                self.tp_rng)

    def load_model_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True) -> None:
        """Load a full checkpoint, keeping this rank's shards, or this rank's shards read from a sharded one;
        ``strict``: missing and unexpected keys (over every pipeline stage) raise, naming them, as plain Lightning
        does."""
        from lightning_megatron.checkpoint.distributed import ShardedModelState

        if isinstance(checkpoint["state_dict"], ShardedModelState):
            with self._main_view():
                self.lightning_module.load_state_dict(dict(checkpoint["state_dict"]), strict=strict)
            return
        state = shard_model_state_dict(self.lightning_module, checkpoint["state_dict"], strict, self._pp_group())
        current = self.lightning_module.state_dict()
        if any(isinstance(v, DTensor) for v in current.values()):   # FSDP: the TP shard laid out as the parameter
            state = {k: distribute_like(current[k], v) if k in current and isinstance(v, torch.Tensor) else v
                     for k, v in state.items()}
        with self._main_view():   # bf16 parameters: the checkpoint's values are the fp32 main parameters
            self.lightning_module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        """Load full optimizer states, keeping this rank's shards (or the states read from a sharded checkpoint)."""
        from lightning_megatron.checkpoint.sharded_state import LoadedOptimizerState, apply_optimizer_state

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            with self._main_view():   # torch casts loaded states to the parameters' dtype: the fp32 main ones
                if isinstance(state, tuple) and isinstance(state[0], LoadedOptimizerState):
                    apply_optimizer_state(optimizer, state[0], state[1])
                    continue
                optimizer.load_state_dict(shard_optimizer_state_dict(state, optimizer, self.lightning_module))
            if is_sharded_optimizer(optimizer):
                # ZeroRedundancyOptimizer also keeps the loaded states in its own (unused) ``state``: on the
                # device, a second copy of this rank's share. Its steps and state_dict use the shard's optimizer.
                optimizer.state.clear()

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint file or sharded directory (rank 0); while a background save runs, once it is
        complete (an older checkpoint outlives its successor's write)."""
        writer = self._sharded_writer()
        if writer is not None:
            if self.is_global_zero:
                writer.remove_checkpoint(str(filepath))
            return
        super().remove_checkpoint(filepath)

    def finish_checkpoints(self) -> None:
        """Wait for a background checkpoint save to complete (every rank; raises its error)."""
        writer = self._sharded_writer()
        if writer is not None:
            writer.wait()
            self.barrier("finish_checkpoints")
