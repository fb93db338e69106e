"""LightningCLI for :class:`~lightning_megatron.ParallelGPTModule`: ``python -m lightning_megatron fit --config
run.yaml`` with the strategy, model, data and Trainer in YAML, Lightning's conventions (docs/cli.md).

:class:`MegatronCLI` checks the layout against the world size, the model, the data and the batch before any
class is built or process started (:func:`check_config`), so a configuration that cannot run stops with the
library's message and the YAML keys it came from. :func:`check_config` does the same for a file without
launching anything (the reference configurations of ``examples/configs`` are checked that way in the tests).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from lightning_megatron.data import compute_num_microbatches
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.module import ParallelGPTModule
from lightning_megatron.utils.optional import JSONARGPARSE, require
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.layout_rules import layers_per_stage, min_microbatches
from lightning_megatron.strategy import LAYOUT_OPTIONS, MegatronStrategy

__all__ = ["CheckedConfig", "MegatronCLI", "check_config", "main"]

# how a YAML file names MegatronStrategy: the package's export or its module
_STRATEGY_PATHS = {"lightning_megatron.MegatronStrategy", f"{MegatronStrategy.__module__}.MegatronStrategy"}


@dataclasses.dataclass
class CheckedConfig:
    """What :func:`check_config` found: the model shape, the resolved layout (``dp`` set) and the batch."""

    model_config: GPTConfig
    layout: ParallelConfig
    micro_batch_size: int
    num_microbatches: int

    @property
    def global_batch_size(self) -> int:
        """micro-batch x dp x micro-batches per optimizer step."""
        return self.micro_batch_size * self.layout.dp * self.num_microbatches


class MegatronCLI(LightningCLI):
    """``LightningCLI(ParallelGPTModule, any LightningDataModule)``: ``model.config`` is the
    :class:`~lightning_megatron.GPTConfig` (its fields as keys), ``model.lr`` etc. the optimizer arguments,
    ``data`` a ``class_path`` / ``init_args`` data module (``TinyCorpusDataModule``, ``MockGPTDataModule``,
    ``GPTDataModule``), ``trainer.strategy`` a ``MegatronStrategy`` with its layout keywords, and
    ``trainer.plugins`` e.g. ``MegatronPrecision``. Before anything is built the configuration is checked
    (:func:`check_config`); an error exits with the parser's message (status 2).

    Args:
        args: the command line (default ``sys.argv[1:]``), e.g. ``["fit", "--config", "run.yaml"]``.
        run: with a subcommand (``fit``, ``validate``, ...), as ``LightningCLI``.
        check_only: parse and check, build nothing (needs ``run=False``); the result is :attr:`checked`.
        kwargs: more ``LightningCLI`` arguments.
    """

    def __init__(self, args: Optional[Sequence[str]] = None, run: bool = True, check_only: bool = False,
                 **kwargs: Any) -> None:
        require(JSONARGPARSE, "MegatronCLI (LightningCLI's YAML parsing)")
        if check_only and run:
            raise ValueError("MegatronCLI(check_only=True) builds nothing, so it cannot run a subcommand: pass run=False")
        self.check_only = check_only
        self.checked: Optional[CheckedConfig] = None
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("seed_everything_default", 1234)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)   # the module's own AdamW + Megatron schedule
        super().__init__(ParallelGPTModule, pl.LightningDataModule, args=list(args) if args is not None else None,
                         run=run, **kwargs)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        try:
            self.checked = check_namespace(config)
        except ValueError as e:
            self.parser.error(f"the configuration cannot run: {e}")

    def instantiate_classes(self) -> None:
        if not self.check_only:
            super().instantiate_classes()


def check_config(args: Sequence[str]) -> CheckedConfig:
    """Parse ``args`` (e.g. ``["--config", "examples/configs/llama3_8b.yaml"]``, no subcommand) and check it as
    :class:`MegatronCLI` does, building nothing and starting no process.

    Raises:
        SystemExit: the parser's error (status 2) for a key it does not know or a configuration that cannot run.
    """
    cli = MegatronCLI(args=args, run=False, check_only=True)
    assert cli.checked is not None
    return cli.checked


def check_namespace(config: Any) -> CheckedConfig:
    """Check a parsed configuration (a jsonargparse namespace of ``trainer`` / ``model`` / ``data``).

    * ``model.config`` builds a valid :class:`GPTConfig`;
    * a ``MegatronStrategy`` layout fits the world size ``trainer.devices x trainer.num_nodes`` and the model
      (:meth:`ParallelConfig.resolve` / ``validate_model``, pipeline stages);
    * the data module's ``seq_length`` is the model's and its ``vocab_size`` at most the model's;
    * the pipeline has enough micro-batches (``trainer.accumulate_grad_batches``), and a ``GPTDataModule``'s
      ``global_batch_size`` is micro-batch x dp x ``accumulate_grad_batches``.

    Raises:
        ValueError: naming the keys, the values and the rule.
    """
    try:
        model_config = GPTConfig(**_plain(config.model.config))
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.config: {e}") from e
    trainer = config.trainer
    devices, nodes = (int(v) if isinstance(v, str) and v.isdigit() else v for v in (trainer.devices, trainer.num_nodes))
    if not isinstance(devices, int) or not isinstance(nodes, int):
        raise ValueError(f"trainer.devices={devices!r} and trainer.num_nodes={nodes!r} must be numbers: the layout "
                         "is checked against their product")
    world = devices * nodes
    layout_args = _strategy_layout(trainer.strategy)
    try:
        layout = ParallelConfig(**layout_args).resolve(world)
        layout.validate_model(model_config)
        if layout.pp > 1:
            layers_per_stage(model_config.num_layers, layout.pp * (layout.vp or 1),
                             layout.num_layers_in_first_pipeline_stage, layout.num_layers_in_last_pipeline_stage)
    except ValueError as e:
        raise ValueError(f"trainer.strategy (world size {world} = trainer.devices {devices} x trainer.num_nodes "
                         f"{nodes}): {e}") from e
    data = _plain(config.data.init_args) if getattr(config.data, "init_args", None) is not None else {}
    seq = data.get("seq_length")
    if seq is not None and seq != model_config.seq_length:
        raise ValueError(f"data.init_args.seq_length={seq} differs from model.config.seq_length="
                         f"{model_config.seq_length}; give both the same value")
    vocab = data.get("vocab_size") if data.get("tokenizer") != "byte" else 257   # TinyCorpusDataModule's bytes
    if vocab is not None and vocab > model_config.vocab_size:
        raise ValueError(f"data.init_args.vocab_size={vocab} is larger than model.config.vocab_size="
                         f"{model_config.vocab_size}: token ids would fall outside the embedding")
    micro = int(data.get("micro_batch_size", 1))
    accumulate = trainer.accumulate_grad_batches or 1
    strategy_path = _class_path(trainer.strategy)
    if strategy_path in _STRATEGY_PATHS and layout.pp > 1:
        schedule = layout_args.get("pipeline_schedule") or ("interleaved_1f1b" if (layout.vp or 1) > 1 else "1f1b")
        need = min_microbatches(schedule, layout.pp)
        if accumulate < need:
            raise ValueError(f"trainer.accumulate_grad_batches={accumulate} is the pipeline's micro-batches per step; "
                             f"pp={layout.pp} with the {schedule!r} schedule needs at least {need}")
    gbs = data.get("global_batch_size")
    if gbs is not None:
        try:
            expected = compute_num_microbatches(gbs, micro, layout.dp)
        except ValueError as e:
            raise ValueError(f"data.init_args.global_batch_size={gbs}: {e}") from e
        if expected != accumulate:
            raise ValueError(f"data.init_args.global_batch_size={gbs} = micro_batch_size {micro} x dp {layout.dp} x "
                             f"{expected} micro-batches, but trainer.accumulate_grad_batches={accumulate}; set it "
                             f"to {expected}")
    return CheckedConfig(model_config=model_config, layout=layout, micro_batch_size=micro,
                         num_microbatches=accumulate)


def _plain(namespace: Any) -> Dict[str, Any]:
    """A jsonargparse namespace (or dict) as a plain dict."""
    return dict(namespace.as_dict() if hasattr(namespace, "as_dict") else namespace)


def _class_path(value: Any) -> Optional[str]:
    return getattr(value, "class_path", None)


def _strategy_layout(strategy: Any) -> Dict[str, Any]:
    """The ``ParallelConfig`` keywords of ``trainer.strategy`` (a ``MegatronStrategy``; anything else is one
    process group of plain data parallelism: tp = pp = cp = 1)."""
    if _class_path(strategy) not in _STRATEGY_PATHS:
        return {}
    args = _plain(strategy.init_args)
    return {k: v for k, v in args.items() if k in LAYOUT_OPTIONS}


def main(args: Optional[List[str]] = None) -> None:
    """``python -m lightning_megatron <subcommand> --config run.yaml`` (see ``--help``)."""
    MegatronCLI(args=args)
