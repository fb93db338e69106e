"""Parsed Megatron flags -> the run's validated pieces, built once and before any process starts.

:func:`plan_from_args` builds the :class:`~lightning_megatron.GPTConfig`, the
:class:`~lightning_megatron.MegatronStrategy` and the data module from the flags; their own constructors and
:class:`~lightning_megatron.parallel.config.ParallelConfig`'s ``resolve`` / ``validate_model`` do the
checking, so a layout that cannot run is refused here, with the library's message and the flags it came from,
instead of inside the launched processes. Nothing here duplicates those rules.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Timer, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_megatron.callbacks.checkpoint_weights import (CheckpointWeights, config_differences, describe,
                                                             holds_training_state, read_checkpoint)
from lightning_megatron.callbacks.loss_curve import LossCurve
from lightning_megatron.cli.callbacks import MemoryHousekeeping, StepProfiler
from lightning_megatron.cli.flags import (DESCRIPTION, TINY, TINY_LR, accepted_flags, build_parser, flag_targets,
                                          refused_flags)
from lightning_megatron.data import (
    ByteTokenizer,
    GPTDataModule,
    MockGPTDataModule,
    TinyCorpusDataModule,
    build_tokenizer,
    compute_num_microbatches,
)
from lightning_megatron.utils.optional import TENSORBOARD
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.parallel.config import FSDP_STRATEGIES, ParallelConfig
from lightning_megatron.parallel.layout_rules import layers_per_stage, min_microbatches
from lightning_megatron.precision import MegatronPrecision
from lightning_megatron.strategy import MegatronStrategy

__all__ = ["FlagError", "PretrainPlan", "parse_data_path_args", "parse_pretrain_args", "plan_from_args"]

# Megatron's MoE flags (dest) -> GPTConfig fields; values are passed on unchanged, None = not given.
MOE_FLAGS = {
    "num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size", "moe_layer_freq": "moe_layer_freq",
    "moe_router_score_function": "moe_router_score_function", "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type", "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff", "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate",
    "moe_expert_capacity_factor": "moe_expert_capacity_factor", "moe_token_drop_policy": "moe_token_drop_policy",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_grouped_gemm": "moe_grouped_gemm", "moe_token_dispatcher_type": "moe_token_dispatcher_type",
}
# --tokenizer-type values the shipped corpus can be tokenised with -> TinyCorpusDataModule(tokenizer=...)
TINY_TOKENIZERS = {"SentencePieceTokenizer": "sentencepiece", "GPTSentencePieceTokenizer": "sentencepiece",
                   "ByteTokenizer": "byte"}
DEFAULT_TRAIN_ITERS = 400
# The plan's callbacks by class, in the order they run (PretrainPlan.callback_kwargs keys).
PLAN_CALLBACKS = {"CheckpointWeights": CheckpointWeights, "Timer": Timer, "StepProfiler": StepProfiler,
                  "MemoryHousekeeping": MemoryHousekeeping, "LossCurve": LossCurve, "TQDMProgressBar": TQDMProgressBar}


class FlagError(ValueError):
    """A flag (or a combination) that cannot run; :func:`parse_pretrain_args` turns it into the parser's error
    (exit status 2, before any process group exists)."""


@dataclasses.dataclass
class PretrainPlan:
    """What a command line turns into: validated objects and the keyword arguments of the rest.

    Attributes:
        config: the model shape. On the shipped corpus with its SentencePiece tokenizer, ``vocab_size`` is the
            vocabulary asked for; the trained tokenizer's (``data_module.vocab_size``) replaces it.
        strategy: the ``MegatronStrategy`` for the Trainer (built once; its layout is resolved against the world
            size: see :attr:`layout`).
        data_module: ``TinyCorpusDataModule`` (no ``--data-path``), ``GPTDataModule`` or ``MockGPTDataModule``
            (``--mock-data``).
        module_kwargs: ``ParallelGPTModule(config, **module_kwargs)``.
        trainer_kwargs: ``pl.Trainer(strategy=strategy, callbacks=..., **trainer_kwargs)`` (``logger`` is a built
            ``TensorBoardLogger`` / ``CSVLogger`` with ``--tensorboard-dir``, else False).
        mfu_kwargs: ``MFUMonitor(**mfu_kwargs)``, or None for no throughput logging.
        checkpoint_kwargs: ``ModelCheckpoint(**checkpoint_kwargs)``, or None for no checkpoints.
        resume: ``trainer.fit(ckpt_path=...)`` (None for a ``--load`` file of weights only: its
            ``CheckpointWeights`` callback, in :attr:`callback_kwargs`, loads them at the start).
        seed: for ``pl.seed_everything``.
        global_batch_size, num_microbatches: global batch = micro-batch x dp x ``num_microbatches``
            (= ``trainer_kwargs["accumulate_grad_batches"]``).
        strategy_kwargs, data_kwargs: what ``strategy`` and ``data_module`` were built from.
        notes: things to tell the user (e.g. ``--load`` of a directory without a checkpoint).
        precision: the ``MegatronPrecision`` plugin for ``pl.Trainer(plugins=[precision])`` (``--bf16``, ``--fp16``,
            the FP8 flags), or None (then ``trainer_kwargs["precision"]`` is Lightning's string).
        precision_kwargs: what ``precision`` was built from (None without it).
        callback_kwargs: ``{"CheckpointWeights" | "Timer" | "StepProfiler" | "MemoryHousekeeping" | "LossCurve":
            kwargs}`` of the flags' callbacks (:meth:`build_callbacks`).
        logger_kwargs: what the logger of ``--tensorboard-dir`` was built from (None without it).
    """

    config: GPTConfig
    strategy: MegatronStrategy
    data_module: pl.LightningDataModule
    module_kwargs: Dict[str, Any]
    trainer_kwargs: Dict[str, Any]
    mfu_kwargs: Optional[Dict[str, Any]]
    checkpoint_kwargs: Optional[Dict[str, Any]]
    resume: Optional[str]
    seed: int
    global_batch_size: int
    num_microbatches: int
    strategy_kwargs: Dict[str, Any]
    data_kwargs: Dict[str, Any]
    notes: List[str] = dataclasses.field(default_factory=list)
    precision: Optional[MegatronPrecision] = None
    precision_kwargs: Optional[Dict[str, Any]] = None
    callback_kwargs: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    logger_kwargs: Optional[Dict[str, Any]] = None

    def build_callbacks(self, progress_bar: bool = True) -> List[Callback]:
        """The callbacks of :attr:`callback_kwargs` (``--exit-duration-in-mins``, ``--profile``, ``--manual-gc``,
        ``--empty-unused-memory-level``, the loss curve, the progress bar), built fresh on each call.
        ``progress_bar=False`` leaves the bar out (for ``Trainer(enable_progress_bar=False)``, which refuses one)."""
        return [PLAN_CALLBACKS[name](**kwargs) for name, kwargs in self.callback_kwargs.items()
                if progress_bar or name != "TQDMProgressBar"]

    @property
    def layout(self) -> ParallelConfig:
        """The strategy's parallel layout, resolved against the world size (``dp``, ``edp`` are set)."""
        return self.strategy.parallel_config

    @property
    def data_parallel_size(self) -> int:
        """dp = world / (tp * pp * cp)."""
        return self.layout.dp

    def summary(self, config: Optional[GPTConfig] = None) -> str:
        """One line: layout, batch arithmetic and the parameter count of ``config`` (default :attr:`config`)."""
        lay = self.layout
        micro = self.data_kwargs["micro_batch_size"]
        sizes = ", ".join(f"{name} {getattr(lay, name)}" for name in ("tp", "pp", "cp", "ep", "dp"))
        return (f"layout: world {lay.world_size} ({sizes}); global batch {self.global_batch_size} = micro {micro} "
                f"x dp {lay.dp} x {self.num_microbatches} micro-batches; model "
                f"{(config or self.config).num_parameters / 1e6:.2f}M parameters")


def parse_pretrain_args(argv: Optional[Sequence[str]] = None, description: str = DESCRIPTION) -> PretrainPlan:
    """Parse ``argv`` (default ``sys.argv[1:]``) and build the :class:`PretrainPlan`; a bad flag or combination
    exits with the parser's usage message and status 2, before anything starts."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    try:
        return plan_from_args(args)
    except FlagError as e:
        parser.error(str(e))  # exits with status 2


def plan_from_args(args: argparse.Namespace) -> PretrainPlan:
    """Map parsed flags (:func:`~lightning_megatron.cli.build_parser`) onto the model, strategy, data, Trainer.

    Raises:
        FlagError: a flag of a feature that has not landed, or a layout / batch / shape / data setting that
            cannot run (the library's message, prefixed with the flags and numbers it came from).
    """
    args = argparse.Namespace(**vars(args))   # train_iters is resolved below; the caller's namespace stays
    refused = [f"{flag} ({feature})" for dest, (flag, feature) in refused_flags(build_parser()).items()
               if getattr(args, dest) not in (None, False)]
    if refused:
        raise FlagError("not supported yet in lightning-megatron: " + ", ".join(refused)
                        + "; drop these flags; each feature lands with its own issue")
    accepted = [f"{flag} {'' if getattr(args, dest) is True else str(getattr(args, dest)) + ' '}changes nothing "
                f"here: {reason}" for dest, (flag, reason) in accepted_flags(build_parser()).items()
                if getattr(args, dest) not in (None, False)]
    if args.rotary_percent is not None and args.rotary_percent != 1.0:
        raise FlagError(f"--rotary-percent {args.rotary_percent}: rotary embeddings over part of the head "
                        "dimension are not implemented; only 1.0 (the whole head) is accepted")
    if args.calculate_per_token_loss and args.eod_mask_loss:
        raise FlagError("--calculate-per-token-loss with --eod-mask-loss: the loss here is each micro-batch's "
                        "token mean averaged over the micro-batches, which differs from the step's per-token mean "
                        "when the mask leaves micro-batches different token counts; drop one of the flags")
    if args.train_iters is not None and args.train_samples is not None:
        raise FlagError("give --train-iters or --train-samples, not both")
    sample_flags = [f for f, v in (("--lr-warmup-samples", args.lr_warmup_samples),
                                   ("--lr-decay-samples", args.lr_decay_samples)) if v is not None]
    iter_flags = [f for f, v in (("--lr-warmup-iters", args.lr_warmup_iters),
                                 ("--lr-decay-iters", args.lr_decay_iters)) if v is not None]
    if sample_flags and args.train_samples is None:
        raise FlagError(f"{', '.join(sample_flags)} need --train-samples (with --train-iters give "
                        f"{', '.join(f.replace('samples', 'iters') for f in sample_flags)})")
    if iter_flags and args.train_samples is not None:
        raise FlagError(f"{', '.join(iter_flags)} with --train-samples: give "
                        f"{', '.join(f.replace('iters', 'samples') for f in iter_flags)} (as Megatron)")
    for flag, value in (("--devices", args.devices), ("--num-nodes", args.num_nodes),
                        ("--train-iters", args.train_iters), ("--train-samples", args.train_samples),
                        ("--eval-interval", args.eval_interval), ("--log-interval", args.log_interval),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins)):
        if value is not None and value <= 0:
            raise FlagError(f"{flag} must be >= 1, got {value}" if flag != "--exit-duration-in-mins"
                            else f"{flag} must be > 0, got {value}")
    if args.eval_iters < 0:
        raise FlagError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.save_interval is not None and not args.save:
        raise FlagError("--save-interval needs --save")
    precision = _precision(args)
    precision_kwargs = _precision_kwargs(args, precision)
    plugin = None
    if precision_kwargs is not None:
        try:
            plugin = MegatronPrecision(**precision_kwargs)
            if args.accelerator == "cpu":
                plugin.check_device(torch.device("cpu"))
        except ValueError as e:
            raise FlagError(f"precision flags: {e}") from e
    gpt_data = args.data_path is not None
    if args.mock_data and gpt_data:
        raise FlagError("--mock-data and --data-path: give one (random tokens, or the dataset)")
    eod_flags = (("--eod-mask-loss", args.eod_mask_loss), ("--reset-position-ids", args.reset_position_ids),
                 ("--reset-attention-mask", args.reset_attention_mask))
    for flag, value in eod_flags:
        if args.mock_data and value:
            raise FlagError(f"{flag} with --mock-data: random tokens have no documents")
    if not gpt_data and not args.mock_data:
        for flag, value in (("--split", args.split), ("--tokenizer-model", args.tokenizer_model)) + eod_flags:
            if value:
                raise FlagError(f"{flag} needs --data-path (the shipped corpus has its own tokenizer and split)")

    # ---- model (vocabulary from the tokenizer)
    model_kwargs = _model_kwargs(args)
    eod = None
    if gpt_data or (args.mock_data and args.tokenizer_type is not None):
        model_kwargs["vocab_size"], eod = _tokenizer_vocab(args)
    elif args.mock_data:
        model_kwargs["vocab_size"] = args.vocab_size if args.vocab_size is not None else TINY["vocab_size"]
    else:
        tokenizer = TINY_TOKENIZERS.get(args.tokenizer_type or "SentencePieceTokenizer")
        if tokenizer is None:
            raise FlagError(f"--tokenizer-type {args.tokenizer_type} needs --data-path; the shipped corpus is "
                            "tokenised with SentencePieceTokenizer (trained on it) or ByteTokenizer")
        if tokenizer == "byte":
            if args.vocab_size is not None:
                raise FlagError(f"--vocab-size {args.vocab_size}: the shipped corpus's ByteTokenizer has a fixed "
                                f"vocabulary of {ByteTokenizer().vocab_size}; --vocab-size sets the SentencePiece "
                                "vocabulary trained on it")
            model_kwargs["vocab_size"] = ByteTokenizer().vocab_size
        else:
            model_kwargs["vocab_size"] = args.vocab_size if args.vocab_size is not None else TINY["vocab_size"]
    try:
        config = GPTConfig(**model_kwargs)
    except (ValueError, TypeError) as e:
        raise FlagError(f"model shape: {e}") from e

    # ---- layout: MegatronStrategy's constructor checks the sizes and options, its ParallelConfig checks them
    # against the world size and the model
    tp = args.tensor_model_parallel_size
    strategy_kwargs: Dict[str, Any] = dict(
        tp=tp, pp=args.pipeline_model_parallel_size, vp=args.virtual_pipeline_model_parallel_size,
        cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
        sequence_parallel=args.sequence_parallel if args.sequence_parallel is not None else tp > 1)
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity not in (None, "selective"):
            raise FlagError(f"--recompute-activations means --recompute-granularity selective, not {granularity}")
        granularity = "selective"
    cp_comm = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else list(args.cp_comm_type)
    sharding = args.data_parallel_sharding_strategy
    if sharding in FSDP_STRATEGIES and not args.use_custom_fsdp:
        raise FlagError(f"--data-parallel-sharding-strategy {sharding} shards gradients (and parameters) with FSDP: add "
                        "--use-custom-fsdp (Megatron's spelling), or use optim / no_shard")
    optional = (("etp", args.expert_tensor_parallel_size), ("pipeline_schedule", args.pipeline_schedule),
                ("num_layers_in_first_pipeline_stage", args.decoder_first_pipeline_num_layers),
                ("num_layers_in_last_pipeline_stage", args.decoder_last_pipeline_num_layers),
                ("hierarchical_context_parallel_sizes", args.hierarchical_context_parallel_sizes),
                ("cp_comm_type", None if cp_comm == "p2p" else cp_comm),
                ("grad_reduce_in_bf16", args.grad_reduce_in_bf16 or None),
                ("use_distributed_optimizer", args.use_distributed_optimizer or None),
                ("data_parallel_sharding_strategy", sharding),
                ("delay_wgrad_compute", args.delay_wgrad_compute),
                ("overlap_grad_reduce", args.overlap_grad_reduce), ("bucket_size", args.ddp_bucket_size),
                ("overlap_param_gather", args.overlap_param_gather or None),
                ("tp_comm_overlap", args.tp_comm_overlap or None), ("compile", args.compile or None),
                ("exit_signal_handler", args.exit_signal_handler or None),
                ("enable_cuda_graph", args.enable_cuda_graph or None),
                ("check_for_nan_in_loss_and_grad", args.check_for_nan_in_loss_and_grad),
                ("ckpt_format", args.ckpt_format), ("async_save", args.async_save or None),
                ("distributed_timeout_minutes", args.distributed_timeout_minutes),
                ("recompute_granularity", granularity),
                ("recompute_method", args.recompute_method), ("recompute_num_layers", args.recompute_num_layers),
                ("recompute_modules", args.recompute_modules))
    strategy_kwargs.update({k: v for k, v in optional if v is not None})
    world = args.devices * args.num_nodes
    try:
        strategy = MegatronStrategy(**strategy_kwargs)
        layout = strategy.parallel_config.resolve(world)
        layout.validate_model(config)
        if layout.pp > 1:
            layers_per_stage(config.num_layers, layout.pp * (layout.vp or 1), args.decoder_first_pipeline_num_layers,
                             args.decoder_last_pipeline_num_layers)
    except ValueError as e:
        raise FlagError(f"parallel layout (world size {world} = --devices {args.devices} x --num-nodes "
                        f"{args.num_nodes}): {e}") from e
    dp = layout.dp

    # ---- batch arithmetic: global = micro x dp x micro-batches
    micro = args.micro_batch_size
    gbs = args.global_batch_size if args.global_batch_size is not None else micro * dp
    try:
        micro_batches = compute_num_microbatches(gbs, micro, dp)
    except ValueError as e:
        raise FlagError(f"--global-batch-size {gbs}, --micro-batch-size {micro}, data-parallel size {dp} (= world "
                        f"{world} / (tp {layout.tp} x pp {layout.pp} x cp {layout.cp})): {e}") from e
    # ---- sample counts -> iterations (Megatron's: samples // global batch)
    if args.train_samples is not None:
        args.train_iters = _iterations("--train-samples", args.train_samples, gbs)
    elif args.train_iters is None:
        args.train_iters = DEFAULT_TRAIN_ITERS
    if args.lr_warmup_samples is not None:
        args.lr_warmup_iters = args.lr_warmup_samples // gbs
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _iterations("--lr-decay-samples", args.lr_decay_samples, gbs)
    need = min_microbatches(strategy.pipeline_schedule, layout.pp) if layout.pp > 1 else 1
    if micro_batches < need:
        raise FlagError(
            f"--pipeline-model-parallel-size {layout.pp} with the {strategy.pipeline_schedule!r} schedule needs at "
            f"least {need} micro-batches per optimizer step, but --global-batch-size {gbs} / (--micro-batch-size "
            f"{micro} x dp {dp}) = {micro_batches}: use --global-batch-size >= {need * micro * dp}")

    # ---- optimizer and schedule (ParallelGPTModule checks min_lr <= lr; checked here to exit before launch)
    lr = args.lr if args.lr is not None else TINY_LR["lr"]
    min_lr = args.min_lr if args.min_lr is not None else (TINY_LR["min_lr"] if args.lr is None else 0.0)
    if min_lr > lr:
        raise FlagError(f"--min-lr {min_lr} is larger than --lr {lr}")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters is not None:
            raise FlagError("give --lr-warmup-iters or --lr-warmup-fraction, not both")
        warmup = int(args.lr_warmup_fraction * (args.lr_decay_iters or args.train_iters))
    else:
        warmup = args.lr_warmup_iters if args.lr_warmup_iters is not None else TINY_LR["lr_warmup_iters"]
    module_kwargs = dict(lr=lr, min_lr=min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                         adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, lr_warmup_iters=warmup,
                         lr_decay_iters=args.lr_decay_iters, lr_decay_style=args.lr_decay_style)
    moment_flags = [flag for flag, value in (("--exp-avg-dtype", args.exp_avg_dtype),
                                             ("--exp-avg-sq-dtype", args.exp_avg_sq_dtype)) if value is not None]
    if moment_flags and not args.use_precision_aware_optimizer:
        verb = "need" if len(moment_flags) > 1 else "needs"
        raise FlagError(f"{' and '.join(moment_flags)} {verb} --use-precision-aware-optimizer (Megatron's rule: the "
                        "moment dtypes belong to the precision-aware optimizer)")
    if args.use_precision_aware_optimizer:
        module_kwargs["exp_avg_dtype"] = args.exp_avg_dtype or "fp32"
        module_kwargs["exp_avg_sq_dtype"] = args.exp_avg_sq_dtype or "fp32"
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise FlagError("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None:
        module_kwargs["decoupled_lr"] = args.decoupled_lr
        low = args.decoupled_min_lr if args.decoupled_min_lr is not None else min_lr
        if low > args.decoupled_lr:
            raise FlagError(f"--decoupled-min-lr {low} is larger than --decoupled-lr {args.decoupled_lr}")
        if args.decoupled_min_lr is not None:
            module_kwargs["decoupled_min_lr"] = args.decoupled_min_lr

    # ---- data
    data_kwargs: Dict[str, Any]
    if gpt_data:
        data_kwargs = dict(data_path=parse_data_path_args(args.data_path), seq_length=config.seq_length,
                           micro_batch_size=micro, global_batch_size=gbs, split=args.split or "969,30,1",
                           seed=args.seed, train_iters=args.train_iters, eval_iters=args.eval_iters,
                           num_workers=args.num_workers if args.num_workers is not None else 2,
                           cache_dir=args.data_cache_path, eod_mask_loss=args.eod_mask_loss,
                           reset_position_ids=args.reset_position_ids,
                           reset_attention_mask=args.reset_attention_mask,
                           eod_id=eod if any(value for _, value in eod_flags) else None, data_parallel_size=dp)
        limit_val = 1.0 if args.eval_iters > 0 else 0  # the valid split is eval_iters global batches
        data_cls: Any = GPTDataModule
    elif args.mock_data:
        data_kwargs = dict(vocab_size=config.vocab_size, seq_length=config.seq_length, micro_batch_size=micro,
                           num_train_samples=args.train_iters * gbs, num_val_samples=max(args.eval_iters, 1) * gbs,
                           seed=args.seed, num_workers=args.num_workers if args.num_workers is not None else 0)
        limit_val = args.eval_iters * micro_batches  # micro-batches per rank
        data_cls = MockGPTDataModule
    else:
        data_kwargs = dict(seq_length=config.seq_length, micro_batch_size=micro, tokenizer=tokenizer,
                           vocab_size=args.vocab_size if args.vocab_size is not None else TINY["vocab_size"],
                           num_workers=args.num_workers if args.num_workers is not None else 0)
        if args.data_cache_path is not None:
            data_kwargs["cache_dir"] = args.data_cache_path
        limit_val = args.eval_iters * micro_batches  # micro-batches per rank
        data_cls = TinyCorpusDataModule
    try:
        data_module = data_cls(**data_kwargs)
    except ValueError as e:
        raise FlagError(f"data: {e}") from e

    # ---- trainer (Lightning counts validation interval / limits in micro-batches, steps in optimizer steps;
    # check_val_every_n_epoch=None: --eval-interval counts iterations over the whole run, as Megatron's does, also
    # when the data is shorter than the interval and the run takes several epochs)
    trainer_kwargs = dict(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                          precision=precision, max_steps=args.train_iters, accumulate_grad_batches=micro_batches,
                          val_check_interval=min(args.eval_interval, args.train_iters) * micro_batches,
                          check_val_every_n_epoch=None,
                          limit_val_batches=limit_val, gradient_clip_val=args.clip_grad if args.clip_grad > 0 else None,
                          log_every_n_steps=args.log_interval, logger=False, enable_checkpointing=bool(args.save),
                          num_sanity_val_steps=0)
    if args.num_nodes == 1:
        del trainer_kwargs["num_nodes"]
    if plugin is not None:  # the plugin carries the precision
        del trainer_kwargs["precision"]

    logger_kwargs = None
    notes = accepted
    if args.tensorboard_dir:
        logger_kwargs = dict(save_dir=args.tensorboard_dir, name="", version="")
        if TENSORBOARD:
            trainer_kwargs["logger"] = TensorBoardLogger(**logger_kwargs)
        else:
            trainer_kwargs["logger"] = CSVLogger(**logger_kwargs)
            notes.append(f"--tensorboard-dir {args.tensorboard_dir}: tensorboard is not installed ({TENSORBOARD}); "
                         "the metrics go to metrics.csv there instead")
    callback_kwargs = _callback_kwargs(args, micro_batches)

    mfu_kwargs = None
    if gpt_data or args.log_throughput or args.peak_tflops is not None:
        mfu_kwargs = dict(log_every_n_steps=args.log_interval,
                          peak_flops=args.peak_tflops * 1e12 if args.peak_tflops is not None else None)
    checkpoint_kwargs = None
    if args.save:
        checkpoint_kwargs = dict(dirpath=args.save, save_last=True, enable_version_counter=False)
        if args.save_interval is not None:
            checkpoint_kwargs["every_n_train_steps"] = args.save_interval
    resume, weights, load_notes = _load_path(args.load, config)
    notes += load_notes
    if weights is not None:   # loaded at the start, before the other callbacks see the model
        callback_kwargs = {"CheckpointWeights": dict(path=weights), **callback_kwargs}
    return PretrainPlan(config=config, strategy=strategy, data_module=data_module, module_kwargs=module_kwargs,
                        trainer_kwargs=trainer_kwargs, mfu_kwargs=mfu_kwargs, checkpoint_kwargs=checkpoint_kwargs,
                        resume=resume, seed=args.seed, global_batch_size=gbs, num_microbatches=micro_batches,
                        strategy_kwargs=strategy_kwargs, data_kwargs=data_kwargs, notes=notes, precision=plugin,
                        precision_kwargs=precision_kwargs, callback_kwargs=callback_kwargs,
                        logger_kwargs=logger_kwargs)


def parse_data_path_args(words: Sequence[str]) -> List[Any]:
    """Megatron's ``--data-path`` words (``a``, ``a b``, ``0.3 a 0.7 b``, or one quoted string of them) as
    ``GPTDataModule(data_path=...)`` takes it: weights as floats, prefixes as strings.

    Raises:
        FlagError: empty, or weights and prefixes that do not alternate, or weights < 0 / summing to 0.
    """
    items = [w for word in words for w in shlex.split(word)]
    if not items:
        raise FlagError("--data-path is empty")

    def number(x: str) -> Optional[float]:
        try:
            return float(x)
        except ValueError:
            return None

    weights = [number(x) for x in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        if any(number(x) is not None for x in items[1::2]):
            raise FlagError(f"--data-path {' '.join(items)}: expected 'weight prefix weight prefix ...'")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise FlagError(f"--data-path {' '.join(items)}: weights must be >= 0 with a positive sum")
        out: List[Any] = []
        for w, prefix in zip(weights, items[1::2]):
            out += [w, prefix]
        return out
    if any(number(x) is not None for x in items):
        raise FlagError(f"--data-path {' '.join(items)}: weights and prefixes must alternate "
                        "('0.3 a 0.7 b'), or give prefixes only")
    return items


# ---------------------------------------------------------------------------------------------- helpers
def _iterations(flag: str, samples: int, gbs: int) -> int:
    """``samples // gbs`` (Megatron's conversion), refused when it is 0."""
    if samples // gbs < 1:
        raise FlagError(f"{flag} {samples} is less than one global batch ({gbs} samples)")
    return samples // gbs


def _callback_kwargs(args: argparse.Namespace, micro_batches: int) -> Dict[str, Dict[str, Any]]:
    """``PretrainPlan.callback_kwargs`` of the run-control flags (only the callbacks they ask for, the loss curve,
    which every run writes, and the progress bar, refreshed once per ``--log-interval`` of ``micro_batches``
    micro-batches per iteration)."""
    out: Dict[str, Dict[str, Any]] = {}
    if args.exit_duration_in_mins is not None:
        out["Timer"] = dict(duration=dict(minutes=args.exit_duration_in_mins), interval="step", verbose=True)
    given = [f for f, v in (("--profile-step-start", args.profile_step_start),
                            ("--profile-step-end", args.profile_step_end),
                            ("--profile-ranks", args.profile_ranks)) if v is not None]
    if given and not args.profile:
        raise FlagError(f"{', '.join(given)} need --profile")
    if args.profile:
        start = args.profile_step_start if args.profile_step_start is not None else 10
        end = args.profile_step_end if args.profile_step_end is not None else 12
        if start < 0 or end <= start:
            raise FlagError(f"--profile-step-start {start} / --profile-step-end {end}: need 0 <= start < end")
        out["StepProfiler"] = dict(start_step=start, end_step=end, ranks=list(args.profile_ranks or [0]),
                                   output_dir=str(Path(args.tensorboard_dir or ".") / "profile"))
    if args.manual_gc_interval is not None and not args.manual_gc:
        raise FlagError("--manual-gc-interval needs --manual-gc")
    if args.manual_gc_interval is not None and args.manual_gc_interval < 0:
        raise FlagError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.manual_gc or args.empty_unused_memory_level:
        out["MemoryHousekeeping"] = dict(manual_gc=args.manual_gc, gc_interval=args.manual_gc_interval or 0,
                                         empty_unused_memory_level=args.empty_unused_memory_level or 0)
    out["LossCurve"] = dict(path=args.loss_curve or str(Path(args.tensorboard_dir or "lightning_logs")
                                                        / "loss_curve"))
    # the bar reads the logged loss on the host, which waits for the GPU: once per --log-interval, as Megatron prints
    out["TQDMProgressBar"] = dict(refresh_rate=args.log_interval * micro_batches)
    return out


#: Lightning's half-precision-weight strings, refused (as ``MegatronStrategy`` refuses them), and the flags to use
HALF_WEIGHTS = {
    "bf16-true": "--precision bf16-mixed (fp32 parameters, bf16 compute) or --bf16 (bf16 parameters with fp32 main "
                 "parameters: Megatron's bf16)",
    "16-true": "--fp16 (fp32 parameters, fp16 compute, a loss scaler shared by all ranks)",
}


def _precision(args: argparse.Namespace) -> str:
    if args.bf16 and args.fp16:
        raise FlagError("--bf16 and --fp16 are mutually exclusive")
    precision = "bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else None
    if precision and args.precision and args.precision != precision:
        raise FlagError(f"--{'bf16' if args.bf16 else 'fp16'} means --precision {precision}, "
                        f"but --precision {args.precision} was given")
    if args.precision in HALF_WEIGHTS:
        raise FlagError(f"--precision {args.precision}: half-precision weights without fp32 main parameters (no "
                        f"Megatron recipe keeps them; MegatronStrategy refuses them); use {HALF_WEIGHTS[args.precision]}")
    return precision or args.precision or "32-true"


# Megatron's precision flags (dest) -> MegatronPrecision arguments; values passed on unchanged, None = not given.
PRECISION_FLAGS = {
    "fp8_format": "fp8", "fp8_recipe": "fp8_recipe", "fp8_margin": "fp8_margin",
    "fp8_amax_history_len": "fp8_amax_history_len", "fp8_amax_compute_algo": "fp8_amax_compute_algo",
    "fp8_backend": "fp8_backend", "num_layers_at_start_in_bf16": "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16": "num_layers_at_end_in_bf16", "initial_loss_scale": "initial_loss_scale",
    "loss_scale_window": "loss_scale_window",
}


def _precision_kwargs(args: argparse.Namespace, precision: str) -> Optional[Dict[str, Any]]:
    """``MegatronPrecision`` arguments of ``--bf16`` / ``--fp16`` and the FP8 / loss-scale flags; None when none
    of them is given (Lightning's ``--precision`` string alone needs no plugin)."""
    given = {arg: getattr(args, dest) for dest, arg in PRECISION_FLAGS.items() if getattr(args, dest) is not None}
    if args.fp8_hybrid:
        if given.get("fp8", "hybrid") != "hybrid":
            raise FlagError(f"--fp8-hybrid contradicts --fp8-format {given['fp8']}; give one of them")
        given["fp8"] = "hybrid"
    if args.first_last_layers_bf16:
        given["first_last_layers_bf16"] = True
    if args.bf16 or getattr(args, "accumulate_allreduce_grads_in_fp32", False):   # Megatron's bf16
        given["params_dtype"] = torch.bfloat16
    if getattr(args, "store_param_remainders", None) is not None:
        given["store_param_remainders"] = args.store_param_remainders
    if not (given or args.bf16 or args.fp16):
        return None
    return dict(precision=precision, **given)


def _tokenizer_vocab(args: argparse.Namespace) -> Tuple[int, int]:
    """(vocab size, eod id) of ``--tokenizer-type`` / ``--tokenizer-model`` for a ``--data-path`` run."""
    if args.tokenizer_type is None:
        raise FlagError("--data-path needs --tokenizer-type (the tokenizer the data was preprocessed with; it "
                        "gives the vocabulary size)")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise FlagError("--tokenizer-type NullTokenizer needs --vocab-size")
        return args.vocab_size + 1, args.vocab_size  # Megatron's: ids < vocab_size, eod = vocab_size
    try:
        tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except (ValueError, FileNotFoundError, ImportError, OSError) as e:
        raise FlagError(f"--tokenizer-type {args.tokenizer_type}: {e}") from e
    vocab = int(tok.vocab_size)
    if args.vocab_size is not None:
        if args.vocab_size < vocab:
            raise FlagError(f"--vocab-size {args.vocab_size} is smaller than the {args.tokenizer_type}'s "
                            f"vocabulary ({vocab})")
        vocab = args.vocab_size
    return vocab, int(tok.eod)


def _model_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """``GPTConfig`` kwargs of the shape flags (the tiny model's values for those left out; no vocabulary)."""
    heads, hidden = args.num_attention_heads, args.hidden_size
    swiglu = True if args.swiglu is None else args.swiglu
    if args.num_query_groups is not None:
        groups = args.num_query_groups
    elif heads is None and not args.group_query_attention:
        groups = TINY["num_query_groups"]
    elif args.group_query_attention:
        groups = 1  # Megatron's --num-query-groups default
    else:
        groups = None  # multi-head attention
    if args.ffn_hidden_size is not None:
        ffn = args.ffn_hidden_size
    elif hidden is None and swiglu:
        ffn = TINY["ffn_hidden_size"]
    else:  # Megatron's default
        h = hidden if hidden is not None else TINY["hidden_size"]
        ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
    if args.use_rotary_position_embeddings and args.position_embedding_type not in (None, "rope"):
        raise FlagError(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                        f"{args.position_embedding_type}; give one of them")
    kw: Dict[str, Any] = dict(
        num_layers=args.num_layers if args.num_layers is not None else TINY["num_layers"],
        hidden_size=hidden if hidden is not None else TINY["hidden_size"],
        num_attention_heads=heads if heads is not None else TINY["num_attention_heads"],
        num_query_groups=groups, ffn_hidden_size=ffn,
        seq_length=args.seq_length if args.seq_length is not None else TINY["seq_length"],
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, swiglu=swiglu,
        add_bias_linear=False, untie_embeddings_and_output_weights=True,  # LLaMA-style (the flags say so too)
    )
    pos = args.position_embedding_type or ("rope" if args.use_rotary_position_embeddings else None)
    for key, value in (("kv_channels", args.kv_channels), ("max_position_embeddings", args.max_position_embeddings),
                       ("normalization", args.normalization), ("norm_epsilon", args.norm_epsilon),
                       ("position_embedding_type", pos), ("rotary_base", args.rotary_base),
                       ("init_method_std", args.init_method_std), ("hidden_dropout", args.hidden_dropout),
                       ("attention_dropout", args.attention_dropout), ("attention_backend", args.attention_backend),
                       ("rope_scaling", args.use_rope_scaling or None),
                       ("rope_scaling_factor", args.rope_scaling_factor)):
        if value is not None:
            kw[key] = value
    given = {dest: getattr(args, dest) for dest in MOE_FLAGS if getattr(args, dest) is not None}
    if given and "num_experts" not in given:
        flags = ", ".join(f"--{dest.replace('_', '-')}" for dest in given)
        raise FlagError(f"{flags} need --num-experts (the model is dense without it)")
    kw.update({MOE_FLAGS[dest]: value for dest, value in given.items()})
    return kw


def _load_path(load: Optional[str], config: GPTConfig) -> Tuple[Optional[str], Optional[str], List[str]]:
    """``--load``: ``(checkpoint to resume from, checkpoint to start from, notes)``. A file without training state
    (no optimizer states or loop progress: ``python -m lightning_megatron.hf import``'s output, a
    ``save_weights_only`` checkpoint) cannot be resumed; its weights are loaded at the start instead
    (:class:`~lightning_megatron.callbacks.CheckpointWeights`) and training starts at iteration 0 with a fresh
    optimizer, as Megatron does with a converted checkpoint. Its saved ``GPTConfig`` must match the flags' in every
    field that shapes the weights (else FlagError naming the fields and their flags); other model fields that differ
    are noted."""
    resume, notes = _resume_path(load)
    if resume is None or Path(resume).is_dir():   # nothing, or a sharded (torch_dist) training checkpoint
        return resume, None, notes
    try:
        checkpoint = read_checkpoint(resume)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same flag error
        raise FlagError(f"--load {load}: {resume} is not a readable checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise FlagError(f"--load {load}: {resume} holds no state_dict (not a Lightning or lightning-megatron "
                        "checkpoint)")
    if holds_training_state(checkpoint):
        return resume, None, notes
    saved = (checkpoint.get("hyper_parameters") or {}).get("config")
    if isinstance(saved, dict):
        shape, model = config_differences(saved, config)
        flags: Dict[str, List[str]] = {}
        for flag, targets in flag_targets(build_parser()).items():
            for target in targets:
                if target.startswith("GPTConfig."):
                    flags.setdefault(target[len("GPTConfig."):], []).append(flag)

        def named(differences: Dict[str, Tuple[Any, Any]]) -> str:
            return "; ".join(f"{describe({field: pair})} [{' / '.join(flags.get(field, ['no flag']))}]"
                             for field, pair in differences.items())

        if shape:
            raise FlagError(f"--load {load}: the checkpoint's model has other weights than the flags' model: "
                            f"{named(shape)}; give the flags the checkpoint's values (python -m "
                            "lightning_megatron.hf import prints its GPTConfig)")
        if model:
            notes.append(f"--load {load}: the weights load, into a model that computes differently from the one "
                         f"they were saved with: {named(model)}")
    notes.append(f"--load {load}: the checkpoint holds weights only (no optimizer state or iteration, as a converted "
                 "checkpoint): training starts from these weights at iteration 0 with a fresh optimizer")
    return None, resume, notes


def _resume_path(load: Optional[str]) -> Tuple[Optional[str], List[str]]:
    """``--load``: a checkpoint file or sharded checkpoint directory, or a directory's ``last.ckpt`` (either
    format); a directory without one starts fresh."""
    if not load:
        return None, []
    path = Path(load)
    if path.is_dir():
        if (path / ".metadata").is_file():     # a sharded (torch_dist) checkpoint itself
            return str(path), []
        if (path / "last.ckpt").exists():
            return str(path / "last.ckpt"), []
        return None, [f"--load {load}: no last.ckpt there; starting from scratch"]
    if path.is_file():
        return str(path), []
    raise FlagError(f"--load {load}: no such checkpoint file or directory")
