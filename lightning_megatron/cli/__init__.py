"""Megatron-LM's command line for Lightning: ``pretrain_gpt``-style flags -> GPTConfig, MegatronStrategy,
ParallelGPTModule, Trainer and data module arguments (``examples/pretrain_gpt.py`` runs them).

* :func:`build_parser`: the flags, each recording the constructor argument it sets (:func:`flag_targets`,
  shown in ``--help``).
* :func:`plan_from_args` / :func:`parse_pretrain_args`: parsed flags -> a :class:`PretrainPlan`, validated by
  the library's own classes before anything starts (:class:`FlagError` otherwise).
* :class:`IterationPrinter`, :class:`LastCheckpoint`, :class:`StepProfiler`, :class:`MemoryHousekeeping`:
  Megatron's log line, end-of-run checkpoint, ``--profile``, ``--manual-gc`` / ``--empty-unused-memory-level``.
* :class:`MegatronCLI` / :func:`check_config`: LightningCLI with YAML configurations
  (``python -m lightning_megatron fit --config run.yaml``), imported on first use (jsonargparse).
"""
from lightning_megatron.cli.callbacks import IterationPrinter, LastCheckpoint, MemoryHousekeeping, StepProfiler
from lightning_megatron.cli.flags import DESCRIPTION, FLAG_MAPPING, build_parser, flag_targets, refused_flags
from lightning_megatron.cli.plan import (
    FlagError,
    PretrainPlan,
    parse_data_path_args,
    parse_pretrain_args,
    plan_from_args,
)

_LAZY = {"MegatronCLI", "CheckedConfig", "check_config"}   # lightning_megatron.cli.lightning_cli


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from lightning_megatron.cli import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckedConfig",
    "DESCRIPTION",
    "FLAG_MAPPING",
    "FlagError",
    "IterationPrinter",
    "LastCheckpoint",
    "MegatronCLI",
    "MemoryHousekeeping",
    "PretrainPlan",
    "StepProfiler",
    "build_parser",
    "check_config",
    "flag_targets",
    "parse_data_path_args",
    "parse_pretrain_args",
    "plan_from_args",
    "refused_flags",
]
