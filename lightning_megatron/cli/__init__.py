"""Megatron-LM's command line for Lightning: ``pretrain_gpt``-style flags -> GPTConfig, MegatronStrategy,
ParallelGPTModule, Trainer and data module arguments (``examples/pretrain_gpt.py`` runs them).

* :func:`build_parser`: the flags, each recording the constructor argument it sets (:func:`flag_targets`,
  shown in ``--help``).
* :func:`plan_from_args` / :func:`parse_pretrain_args`: parsed flags -> a :class:`PretrainPlan`, validated by
  the library's own classes before anything starts (:class:`FlagError` otherwise).
* :class:`IterationPrinter`, :class:`LastCheckpoint`: Megatron's log line and end-of-run checkpoint.
"""
from lightning_megatron.cli.callbacks import IterationPrinter, LastCheckpoint
from lightning_megatron.cli.flags import DESCRIPTION, FLAG_MAPPING, build_parser, flag_targets, refused_flags
from lightning_megatron.cli.plan import (
    FlagError,
    PretrainPlan,
    parse_data_path_args,
    parse_pretrain_args,
    plan_from_args,
)

__all__ = [
    "DESCRIPTION",
    "FLAG_MAPPING",
    "FlagError",
    "IterationPrinter",
    "LastCheckpoint",
    "PretrainPlan",
    "build_parser",
    "flag_targets",
    "parse_data_path_args",
    "parse_pretrain_args",
    "plan_from_args",
    "refused_flags",
]
