"""Start training from the weights of a checkpoint that holds no training state.

A checkpoint written by ``python -m lightning_megatron.hf import`` (a Hugging Face model in our layout-independent
form: ``state_dict`` with the tp=1 ``model.`` names, ``hyper_parameters.config``), or a training checkpoint saved
with ``ModelCheckpoint(save_weights_only=True)``, has no optimizer state and no loop progress: Lightning cannot
resume from it (``Trainer.fit(ckpt_path=...)`` needs both). :class:`CheckpointWeights` loads its weights into the
model at the start instead, each rank keeping its own shards, and training starts at step 0 with a fresh optimizer,
as Megatron starts from a converted ("release") checkpoint. ``examples/pretrain_gpt.py --load`` does this for such a
file by itself.
"""
from __future__ import annotations

import os
import zipfile
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import lightning.pytorch as pl
import torch

from lightning_megatron.models.config import GPTConfig

__all__ = ["CheckpointWeights", "WeightsAtStart", "RUN_FIELDS", "SHAPE_FIELDS", "config_differences", "holds_training_state",
           "read_checkpoint"]

#: GPTConfig fields whose values decide which parameters the model has and their shapes: a checkpoint saved with
#: other values cannot load (``max_position_embeddings`` too with learned absolute positions)
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "normalization", "swiglu",
                "add_bias_linear", "untie_embeddings_and_output_weights", "position_embedding_type", "num_moe_experts",
                "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                "moe_router_enable_expert_bias")
#: GPTConfig fields of how a run trains or computes, not of the model the weights belong to: free to differ
RUN_FIELDS = ("seq_length", "max_position_embeddings", "init_method_std", "hidden_dropout", "attention_dropout",
              "attention_backend", "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_aux_loss_coeff",
              "moe_z_loss_coeff", "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_token_drop_policy",
              "moe_router_load_balancing_type")

Differences = Dict[str, Tuple[Any, Any]]


def read_checkpoint(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """A checkpoint file on the CPU; memory-mapped (tensors are read when used) when saved in torch's zip format."""
    path = os.fspath(path)
    return torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path), weights_only=False)


def holds_training_state(checkpoint: Mapping[str, Any]) -> bool:
    """Whether Lightning can resume from ``checkpoint``: it has the optimizer states and the loops' progress (a
    weights-only one, as ``hf import`` or ``save_weights_only=True`` write, has not)."""
    return "optimizer_states" in checkpoint and "loops" in checkpoint and "pytorch-lightning_version" in checkpoint


def config_differences(saved: Mapping[str, Any], config: GPTConfig) -> Tuple[Differences, Differences]:
    """How ``config`` differs from the config a checkpoint was saved with (its ``hyper_parameters["config"]``):
    ``(shape, model)``, each ``{field: (saved value, config's value)}``. ``shape``: fields of
    :data:`SHAPE_FIELDS` (the weights cannot load); ``model``: the other fields outside :data:`RUN_FIELDS` (the
    weights load, into a model that computes something else: ``norm_epsilon``, ``rotary_base``, RoPE scaling,
    the router's top-k / score function, ...)."""
    ours = config.to_dict()
    saved = dict(saved)
    if ours.get("position_embedding_type") == "learned_absolute":
        shape_fields = SHAPE_FIELDS + ("max_position_embeddings",)
    else:
        shape_fields = SHAPE_FIELDS
    shape: Differences = {}
    model: Differences = {}
    for field, value in ours.items():
        if field not in saved or saved[field] == value:
            continue
        if field in shape_fields:
            shape[field] = (saved[field], value)
        elif field not in RUN_FIELDS:
            model[field] = (saved[field], value)
    return shape, model


def describe(differences: Differences) -> str:
    """``field=saved (here: ours)`` for each difference."""
    return ", ".join(f"{field}={saved!r} (here {ours!r})" for field, (saved, ours) in differences.items())


class WeightsAtStart(pl.Callback):
    """Base of the callbacks that write weights from ``path`` into the LightningModule once the strategy has set it
    up: :meth:`load_weights` runs once, at the start of ``fit`` / ``validate`` / ``test`` / ``predict`` (whichever
    comes first), on every rank, and not at all when the Trainer resumes from ``ckpt_path``."""

    def __init__(self, path: Union[str, "os.PathLike[str]"]) -> None:
        self.path = os.fspath(path)
        self.loaded = False

    def load_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the weights of :attr:`path` into ``pl_module`` (each rank its shards)."""
        raise NotImplementedError

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.loaded:
            return
        self.loaded = True
        if trainer.ckpt_path is None:
            self.load_weights(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)


class CheckpointWeights(WeightsAtStart):
    """Loads the weights of checkpoint file ``path`` (``state_dict`` of full, layout-independent tensors, and
    optionally ``hyper_parameters["config"]``) into the LightningModule once the strategy has set it up, at the start
    of ``fit`` / ``validate`` / ``test`` / ``predict`` (whichever comes first), on every rank, each keeping its shards
    (``trainer.strategy.load_model_state_dict``, as a resumed checkpoint's weights are loaded; strict: a missing or
    unexpected key raises). Skipped when the Trainer resumes from ``ckpt_path``.

    Raises:
        ValueError: ``path`` has no ``state_dict``, or the module's ``GPTConfig`` differs from the checkpoint's in a
            field that shapes the weights (:data:`SHAPE_FIELDS`; every rank raises the same, before any weight is
            loaded).
    """

    def load_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpoint = read_checkpoint(self.path)
        if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
            raise ValueError(f"CheckpointWeights({self.path!r}): the file holds no state_dict (write one with "
                             "python -m lightning_megatron.hf import, or a Trainer checkpoint)")
        saved = (checkpoint.get("hyper_parameters") or {}).get("config")
        config: Optional[GPTConfig] = getattr(pl_module, "config", None)
        if isinstance(saved, Mapping) and isinstance(config, GPTConfig):
            shape, _ = config_differences(saved, config)
            if shape:
                raise ValueError(f"CheckpointWeights({self.path!r}): the module's GPTConfig differs from the "
                                 f"checkpoint's in fields that shape the weights: {describe(shape)}; build the module "
                                 "with the checkpoint's config (its hyper_parameters['config'])")
        trainer.strategy.load_model_state_dict(checkpoint, strict=True)
