"""Megatron-LM's pretraining flags (``pretrain_gpt.py``'s names), each recorded with what it becomes.

Every flag is added through :func:`add_flag`, which records its *targets*: the constructor argument or field
its value ends up in, written ``Class.name`` (``GPTConfig.num_layers``, ``MegatronStrategy.tp``,
``Trainer.max_steps``, ``GPTDataModule.split``, ...). ``--help`` shows them after each flag, and
:func:`flag_targets` lists them, so a test can check that every parsed flag reaches a real field. Flags of
features that have not landed are added with :func:`add_refused_flag`: parsed, then refused by name.
"""
from __future__ import annotations

import argparse
import ast
from typing import Any, Dict, List, Sequence, Tuple, Union

from lightning_megatron.models.config import ATTENTION_BACKENDS
from lightning_megatron.precision.fp8 import AMAX_COMPUTE_ALGOS, FP8_BACKENDS, FP8_FORMATS, FP8_RECIPES
from lightning_megatron.parallel.config import CP_COMM_TYPES, SHARDING_STRATEGIES
from lightning_megatron.parallel.layout_rules import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RECOMPUTE_MODULES, SCHEDULE_NAMES

__all__ = ["DESCRIPTION", "FLAG_MAPPING", "TINY", "TINY_LR", "accepted_flags", "add_accepted_flag", "add_flag",
           "add_refused_flag", "build_parser", "flag_targets", "refused_flags"]

# The shipped-corpus run's model and learning rate; shape / lr flags left out take these values.
TINY = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=352,
            seq_length=128, vocab_size=2048)
TINY_LR = dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=20)

DESCRIPTION = "Pretrain a GPT / LLaMA-style model with MegatronStrategy from Megatron-LM's command-line flags."
FLAG_MAPPING = """\
How the flags map (each flag's help ends with what it sets: "-> Class.argument"):
  * Without --data-path the run uses the small corpus shipped in lightning_megatron/data/corpus
    (TinyCorpusDataModule), tokenised by a SentencePiece model trained on it.
  * Layout: MegatronStrategy(tp, pp, vp, cp, ep, etp, sequence_parallel, ...); dp = world / (tp*pp*cp) with
    world = --devices x --num-nodes.
  * --global-batch-size = micro-batch x dp x micro-batches: the micro-batches per optimizer step become
    Trainer(accumulate_grad_batches) (under pipeline parallelism the pipeline's micro-batches, at least pp for
    the 1f1b schedules). Without it the global batch is micro-batch x dp (Megatron's default).
  * --train-iters is max_steps (optimizer steps); --eval-interval is in optimizer steps and --eval-iters in
    global batches, as in Megatron. --train-samples / --lr-warmup-samples / --lr-decay-samples are divided by
    the global batch size (floor) into --train-iters / --lr-warmup-iters / --lr-decay-iters.
  * --mock-data trains on random tokens below the vocabulary (MockGPTDataModule), no files needed.
  * --data-path uses GPTDataModule on Megatron indexed datasets (docs/data.md: preprocessing); one prefix,
    several, or a weighted blend '0.3 a 0.7 b'. The vocabulary comes from --tokenizer-type/--tokenizer-model.
  * --bf16 / --fp16 and the FP8 flags (--fp8-format, --fp8-recipe, ...) build MegatronPrecision, passed to the
    Trainer as a plugin; without them --precision is Lightning's (default 32-true).
  * --save DIR keeps DIR/last.ckpt (and one every --save-interval steps, and at the end); --load resumes from
    a file or DIR/last.ckpt (a directory without one starts fresh, as Megatron); a file of weights only
    (python -m lightning_megatron.hf import) starts from those weights at iteration 0.

Defaults are those of the shipped tiny run where it needs them, which differ from Megatron-LM's in places:
sequence parallelism is on when tp > 1 (--no-sequence-parallel), lr decay is cosine, weight decay 0.1, Adam
beta2 0.95, no dropout, and the model is LLaMA-style (RMSNorm, RoPE, SwiGLU, no linear biases, untied
embeddings) unless --normalization / --position-embedding-type / --no-swiglu say otherwise. When
--hidden-size is given, --ffn-hidden-size defaults to Megatron's rule; when --num-attention-heads is given,
query groups default to the heads (--group-query-attention: 1). Flags of features that have not landed are
recognised and refused with a message naming them; flags that change nothing here (e.g. --use-mcore-models) are
accepted and the run prints a note saying why (docs/megatron_flags.md lists them).
"""


def add_flag(group: Any, flag: str, to: Union[str, Sequence[str]], **kwargs: Any) -> argparse.Action:
    """``group.add_argument(flag, **kwargs)`` recording ``to``: the ``Class.argument`` targets the value sets.

    The targets are appended to the flag's help (``-> GPTConfig.num_layers``) and kept on the action
    (``action.targets``) for :func:`flag_targets`.
    """
    targets = (to,) if isinstance(to, str) else tuple(to)
    if not targets:
        raise ValueError(f"{flag}: a flag needs at least one target (use add_refused_flag for refused flags)")
    text = kwargs.pop("help", None)
    arrow = "-> " + ", ".join(targets)
    action = group.add_argument(flag, help=f"{text} {arrow}" if text else arrow, **kwargs)
    action.targets = targets
    action.refused = None
    return action


def add_refused_flag(group: Any, flag: str, feature: str, **kwargs: Any) -> argparse.Action:
    """A flag of a feature that has not landed: parsed (so it is not "unrecognized"), then refused by name."""
    action = group.add_argument(flag, help=f"refused: {feature} has not landed", **kwargs)
    action.targets = ()
    action.refused = feature
    return action


def add_accepted_flag(group: Any, flag: str, reason: str, **kwargs: Any) -> argparse.Action:
    """A Megatron flag that changes nothing here, for ``reason`` (the run prints it as a note when given)."""
    action = group.add_argument(flag, help=f"accepted, changes nothing: {reason}", **kwargs)
    action.targets = ()
    action.refused = None
    action.accepted = reason
    return action


def accepted_flags(parser: argparse.ArgumentParser) -> Dict[str, Tuple[str, str]]:
    """``{dest: (flag, reason)}`` of the flags that are accepted and change nothing."""
    return {action.dest: (action.option_strings[0], action.accepted) for action in parser._actions
            if getattr(action, "accepted", None)}


def flag_targets(parser: argparse.ArgumentParser) -> Dict[str, Tuple[str, ...]]:
    """``{"--flag": ("Class.argument", ...)}`` for every flag of ``parser`` (refused flags map to ``()``)."""
    return {action.option_strings[0]: action.targets for action in parser._actions
            if hasattr(action, "targets")}


def refused_flags(parser: argparse.ArgumentParser) -> Dict[str, Tuple[str, str]]:
    """``{dest: (flag, feature)}`` of the flags that are parsed but refused."""
    return {action.dest: (action.option_strings[0], action.refused) for action in parser._actions
            if getattr(action, "refused", None)}


def _layer_freq(text: str) -> Union[int, List[int]]:
    """``--moe-layer-freq``: an int, or a list literal of 0/1 (Megatron also takes ``"([1]*N)"``-style code;
    write the list out here)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or a list such as [1,0,1,0]") from e
    if isinstance(value, (list, tuple)):
        return [int(x) for x in value]
    if isinstance(value, int):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not an int or a list such as [1,0,1,0]")


def build_parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The command line, with Megatron-LM's flag names (``allow_abbrev=False`` as Megatron's parser); ``--help``
    shows ``description`` and then how the flags map (:data:`FLAG_MAPPING`)."""
    p = argparse.ArgumentParser(description=f"{description.rstrip()}\n\n{FLAG_MAPPING}", formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [Megatron-LM flags] (--help lists them)", allow_abbrev=False)
    g = p.add_argument_group("parallel layout")
    add_flag(g, "--tensor-model-parallel-size", "MegatronStrategy.tp", type=int, default=2, help="tp (default 2)")
    add_flag(g, "--pipeline-model-parallel-size", "MegatronStrategy.pp", type=int, default=1, help="pp")
    add_flag(g, "--virtual-pipeline-model-parallel-size", "MegatronStrategy.vp", type=int, default=None,
             help="vp: model chunks per pipeline rank (interleaved schedule)")
    add_flag(g, "--pipeline-schedule", "MegatronStrategy.pipeline_schedule", choices=SCHEDULE_NAMES, default=None,
             help="(not a Megatron flag) default: interleaved_1f1b with vp > 1, else 1f1b")
    add_flag(g, "--decoder-first-pipeline-num-layers", "MegatronStrategy.num_layers_in_first_pipeline_stage",
             type=int, default=None)
    add_flag(g, "--decoder-last-pipeline-num-layers", "MegatronStrategy.num_layers_in_last_pipeline_stage",
             type=int, default=None)
    add_flag(g, "--context-parallel-size", "MegatronStrategy.cp", type=int, default=1, help="cp")
    add_flag(g, "--cp-comm-type", "MegatronStrategy.cp_comm_type", nargs="+", choices=CP_COMM_TYPES,
             default=["p2p"], help="one type, or one per layer")
    add_flag(g, "--hierarchical-context-parallel-sizes", "MegatronStrategy.hierarchical_context_parallel_sizes",
             nargs="+", type=int, default=None, help="inner (a2a) and outer (p2p) sizes for a2a+p2p")
    add_flag(g, "--expert-model-parallel-size", "MegatronStrategy.ep", type=int, default=1, help="ep")
    add_flag(g, "--expert-tensor-parallel-size", "MegatronStrategy.etp", type=int, default=None,
             help="etp (default tp)")
    add_flag(g, "--sequence-parallel", "MegatronStrategy.sequence_parallel", action=argparse.BooleanOptionalAction,
             default=None, help="default: on when tp > 1")
    add_flag(g, "--use-distributed-optimizer", "MegatronStrategy.use_distributed_optimizer", action="store_true",
             help="shard the optimizer states over dp x cp (ZeRO-1)")
    add_flag(g, "--use-custom-fsdp", "MegatronStrategy.data_parallel_sharding_strategy", action="store_true",
             help="FSDP (torch FSDP2 fully_shard per layer) at the level of --data-parallel-sharding-strategy")
    add_flag(g, "--data-parallel-sharding-strategy", "MegatronStrategy.data_parallel_sharding_strategy",
             choices=SHARDING_STRATEGIES, default=None,
             help="what is sharded over dp x cp: no_shard (DDP), optim (= --use-distributed-optimizer), optim_grads "
                  "and optim_grads_params (FSDP, with --use-custom-fsdp); default: optim with "
                  "--use-distributed-optimizer, else no_shard")
    add_flag(g, "--delay-wgrad-compute", "MegatronStrategy.delay_wgrad_compute",
             action=argparse.BooleanOptionalAction, default=None,
             help="a2a context parallel (tp=1): run the weight-gradient GEMMs during the backward all-to-alls "
                  "(default: on wherever it applies; --no-delay-wgrad-compute keeps them in place)")
    add_flag(g, "--grad-reduce-in-bf16", "MegatronStrategy.grad_reduce_in_bf16", action="store_true",
             help="reduce data-parallel gradients in bf16 (half the traffic)")
    add_flag(g, "--overlap-grad-reduce", "MegatronStrategy.overlap_grad_reduce",
             action=argparse.BooleanOptionalAction, default=None,
             help="data-parallel gradient buckets reduced during backward (default: on for pp=1, torch DDP's "
                  "buckets; off for pp>1)")
    add_flag(g, "--ddp-bucket-size", "MegatronStrategy.bucket_size", type=int, default=None,
             help="elements per data-parallel gradient bucket")
    add_flag(g, "--overlap-param-gather", "MegatronStrategy.overlap_param_gather", action="store_true",
             help="with --use-distributed-optimizer: the parameter broadcast after the step overlaps the next "
                  "forward, layer by layer")
    add_flag(g, "--exit-signal-handler", "MegatronStrategy.exit_signal_handler", action="store_true",
             help="on SIGTERM every rank finishes the step, saves last-preempted.ckpt into --save's directory and "
                  "exits with code 75 (requeue); docs/reliability.md")
    add_flag(g, "--tp-comm-overlap", "MegatronStrategy.tp_comm_overlap", action="store_true",
             help="with sequence parallelism: SP all-gather / reduce-scatter as rings of chunked GEMMs")
    add_flag(g, "--compile", "MegatronStrategy.compile", action="store_true",
             help="torch.compile each transformer layer and the head + loss (not a Megatron-LM flag: Megatron fuses "
                  "with its own kernels)")
    add_flag(g, "--enable-cuda-graph", "MegatronStrategy.enable_cuda_graph", action="store_true",
             help="with --compile: replay each transformer layer's forward and backward as CUDA graphs (Inductor's "
                  "CUDA graph trees); pp=1, no FSDP or recompute, accumulation only with bf16 parameters")
    add_flag(g, "--check-for-nan-in-loss-and-grad", "MegatronStrategy.check_for_nan_in_loss_and_grad",
             action=argparse.BooleanOptionalAction, default=None,
             help="stop at a NaN/inf loss or gradient norm, naming the step and parameter (default on)")
    add_flag(g, "--recompute-activations", "MegatronStrategy.recompute_granularity", action="store_true",
             help="= --recompute-granularity selective")
    add_flag(g, "--recompute-granularity", "MegatronStrategy.recompute_granularity", choices=RECOMPUTE_GRANULARITIES,
             default=None, help="activation recompute: the --recompute-modules parts, or whole layers")
    add_flag(g, "--recompute-method", "MegatronStrategy.recompute_method", choices=RECOMPUTE_METHODS, default=None,
             help="full: uniform (all layers, groups of --recompute-num-layers) or block (the first "
                  "--recompute-num-layers of each pipeline stage)")
    add_flag(g, "--recompute-num-layers", "MegatronStrategy.recompute_num_layers", type=int, default=None)
    add_flag(g, "--recompute-modules", "MegatronStrategy.recompute_modules", nargs="+", choices=RECOMPUTE_MODULES,
             default=None, help="selective: the parts to recompute (default core_attn)")
    add_flag(g, "--accelerator", "Trainer.accelerator", default="cpu")
    add_flag(g, "--devices", "Trainer.devices", type=int, default=2, help="processes per node")
    add_flag(g, "--num-nodes", "Trainer.num_nodes", type=int, default=1)

    g = p.add_argument_group("model")
    add_flag(g, "--num-layers", "GPTConfig.num_layers", type=int, default=None, help=f"default {TINY['num_layers']}")
    add_flag(g, "--hidden-size", "GPTConfig.hidden_size", type=int, default=None,
             help=f"default {TINY['hidden_size']}")
    add_flag(g, "--num-attention-heads", "GPTConfig.num_attention_heads", type=int, default=None,
             help=f"default {TINY['num_attention_heads']}")
    add_flag(g, "--group-query-attention", "GPTConfig.num_query_groups", action="store_true",
             help="query groups default to 1 instead of the heads")
    add_flag(g, "--num-query-groups", "GPTConfig.num_query_groups", type=int, default=None,
             help=f"default {TINY['num_query_groups']} for the default heads, else heads (MHA)")
    add_flag(g, "--ffn-hidden-size", "GPTConfig.ffn_hidden_size", type=int, default=None,
             help=f"default {TINY['ffn_hidden_size']}")
    add_flag(g, "--kv-channels", "GPTConfig.kv_channels", type=int, default=None)
    add_flag(g, "--seq-length", ("GPTConfig.seq_length", "TinyCorpusDataModule.seq_length",
                                 "GPTDataModule.seq_length"), type=int, default=None,
             help=f"default {TINY['seq_length']}")
    add_flag(g, "--max-position-embeddings", "GPTConfig.max_position_embeddings", type=int, default=None)
    add_flag(g, "--vocab-size", ("GPTConfig.vocab_size", "TinyCorpusDataModule.vocab_size"), type=int,
             default=None,
             help=f"shipped corpus: SentencePiece vocabulary to train (default {TINY['vocab_size']}); --data-path: "
                  "at least the tokenizer's (NullTokenizer: ids below it, plus eod)")
    add_flag(g, "--make-vocab-size-divisible-by", "GPTConfig.make_vocab_size_divisible_by", type=int, default=128)
    add_flag(g, "--normalization", "GPTConfig.normalization", choices=("RMSNorm", "LayerNorm"), default=None)
    add_flag(g, "--norm-epsilon", "GPTConfig.norm_epsilon", type=float, default=None)
    add_flag(g, "--position-embedding-type", "GPTConfig.position_embedding_type",
             choices=("rope", "learned_absolute"), default=None)
    add_flag(g, "--use-rotary-position-embeddings", "GPTConfig.position_embedding_type", action="store_true",
             help="= --position-embedding-type rope")
    add_flag(g, "--rotary-base", "GPTConfig.rotary_base", type=int, default=None)
    add_flag(g, "--use-rope-scaling", "GPTConfig.rope_scaling", action="store_true", help="Llama 3.1 RoPE scaling")
    add_flag(g, "--rope-scaling-factor", "GPTConfig.rope_scaling_factor", type=float, default=None)
    add_flag(g, "--swiglu", "GPTConfig.swiglu", action=argparse.BooleanOptionalAction, default=None,
             help="default on")
    add_flag(g, "--disable-bias-linear", "GPTConfig.add_bias_linear", action="store_true", help="(the default here)")
    add_flag(g, "--untie-embeddings-and-output-weights", "GPTConfig.untie_embeddings_and_output_weights",
             action="store_true", help="(the default here)")
    add_flag(g, "--init-method-std", "GPTConfig.init_method_std", type=float, default=None)
    add_flag(g, "--hidden-dropout", "GPTConfig.hidden_dropout", type=float, default=None)
    add_flag(g, "--attention-dropout", "GPTConfig.attention_dropout", type=float, default=None)
    add_flag(g, "--attention-backend", "GPTConfig.attention_backend",
             choices=ATTENTION_BACKENDS, default=None,
             help="default auto: torch's choice (cuDNN for bf16 on an H200 with torch 2.11); fused: cuDNN (an "
                  "error on CUDA where it cannot run); flash: the flash kernel; unfused / local: the explicit softmax")

    g = p.add_argument_group("training")
    add_flag(g, "--micro-batch-size", ("TinyCorpusDataModule.micro_batch_size", "GPTDataModule.micro_batch_size"),
             type=int, default=8)
    add_flag(g, "--global-batch-size", ("Trainer.accumulate_grad_batches", "GPTDataModule.global_batch_size"),
             type=int, default=None, help="default micro-batch x dp")
    add_flag(g, "--train-iters", ("Trainer.max_steps", "GPTDataModule.train_iters"), type=int, default=None,
             help="default 400")
    add_flag(g, "--train-samples", ("Trainer.max_steps", "GPTDataModule.train_iters"), type=int, default=None,
             help="instead of --train-iters: iterations = samples // global batch")
    add_flag(g, "--lr", "ParallelGPTModule.lr", type=float, default=None, help=f"default {TINY_LR['lr']}")
    add_flag(g, "--min-lr", "ParallelGPTModule.min_lr", type=float, default=None,
             help=f"default {TINY_LR['min_lr']} with the default --lr, else 0 (Megatron's)")
    add_flag(g, "--lr-warmup-iters", "ParallelGPTModule.lr_warmup_iters", type=int, default=None,
             help=f"default {TINY_LR['lr_warmup_iters']}")
    add_flag(g, "--lr-warmup-fraction", "ParallelGPTModule.lr_warmup_iters", type=float, default=None,
             help="warmup = fraction x decay iters")
    add_flag(g, "--lr-decay-iters", "ParallelGPTModule.lr_decay_iters", type=int, default=None,
             help="default --train-iters")
    add_flag(g, "--lr-warmup-samples", "ParallelGPTModule.lr_warmup_iters", type=int, default=None,
             help="with --train-samples: warmup iterations = samples // global batch")
    add_flag(g, "--lr-decay-samples", "ParallelGPTModule.lr_decay_iters", type=int, default=None,
             help="with --train-samples: decay iterations = samples // global batch")
    add_flag(g, "--decoupled-lr", "ParallelGPTModule.decoupled_lr", type=float, default=None,
             help="the word embedding's and output layer's own peak learning rate (same warmup and decay)")
    add_flag(g, "--decoupled-min-lr", "ParallelGPTModule.decoupled_min_lr", type=float, default=None,
             help="their minimum learning rate (default --min-lr)")
    add_flag(g, "--lr-decay-style", "ParallelGPTModule.lr_decay_style", choices=("cosine", "linear", "constant"),
             default="cosine")
    add_flag(g, "--weight-decay", "ParallelGPTModule.weight_decay", type=float, default=0.1)
    add_flag(g, "--adam-beta1", "ParallelGPTModule.adam_beta1", type=float, default=0.9)
    add_flag(g, "--adam-beta2", "ParallelGPTModule.adam_beta2", type=float, default=0.95)
    add_flag(g, "--adam-eps", "ParallelGPTModule.adam_eps", type=float, default=1e-8)
    add_flag(g, "--use-precision-aware-optimizer",
             ("ParallelGPTModule.exp_avg_dtype", "ParallelGPTModule.exp_avg_sq_dtype"), action="store_true",
             help="AdamW with its moments stored in --exp-avg-dtype / --exp-avg-sq-dtype, updated in fp32 "
                  "(PrecisionAwareAdamW)")
    add_flag(g, "--exp-avg-dtype", "ParallelGPTModule.exp_avg_dtype", choices=("fp32", "bf16"), default=None,
             help="with --use-precision-aware-optimizer: dtype of Adam's first moment (default fp32)")
    add_flag(g, "--exp-avg-sq-dtype", "ParallelGPTModule.exp_avg_sq_dtype", choices=("fp32", "bf16"), default=None,
             help="with --use-precision-aware-optimizer: dtype of Adam's second moment (default fp32)")
    add_flag(g, "--clip-grad", "Trainer.gradient_clip_val", type=float, default=1.0, help="0 disables clipping")
    add_flag(g, "--seed", ("seed_everything.seed", "GPTDataModule.seed"), type=int, default=1234)
    add_flag(g, "--eval-interval", "Trainer.val_check_interval", type=int, default=100,
             help="optimizer steps between validations")
    add_flag(g, "--eval-iters", ("Trainer.limit_val_batches", "GPTDataModule.eval_iters"), type=int, default=10,
             help="global batches per validation (0: none)")
    add_flag(g, "--log-interval", ("Trainer.log_every_n_steps", "MFUMonitor.log_every_n_steps"), type=int,
             default=10, help="optimizer steps between log lines")
    add_flag(g, "--log-throughput", "MFUMonitor", action="store_true",
             help="MFUMonitor and a log line every --log-interval steps also without --data-path")
    add_flag(g, "--peak-tflops", "MFUMonitor.peak_flops", type=float, default=None,
             help="peak TFLOP/s per device, for mfu")

    g = p.add_argument_group("precision (MegatronPrecision; docs/precision.md)")
    add_flag(g, "--bf16", ("MegatronPrecision.precision", "MegatronPrecision.params_dtype"), action="store_true",
             help="Megatron's bf16: bf16-mixed with parameters stored in bf16, fp32 main parameters (as 16-bit "
                  "remainders unless --no-store-param-remainders) and fp32 main gradients (params_dtype="
                  "torch.bfloat16); fp32 parameters under bf16 autocast: --precision bf16-mixed")
    add_flag(g, "--fp16", "MegatronPrecision.precision", action="store_true",
             help="16-mixed, dynamic loss scaling over all ranks")
    add_flag(g, "--precision", ("Trainer.precision", "MegatronPrecision.precision"), default=None,
             help="(not a Megatron flag) Lightning's precision string (default 32-true); with the flags here, the "
                  "plugin's (bf16-mixed, 16-mixed, 32-true)")
    add_flag(g, "--accumulate-allreduce-grads-in-fp32", "MegatronPrecision.params_dtype", action="store_true",
             help="what --bf16 does already (Megatron sets it with --bf16): parameters stored in bf16, fp32 main "
                  "parameters in the optimizer, gradients accumulated, reduced and clipped in fp32")
    add_flag(g, "--store-param-remainders", "MegatronPrecision.store_param_remainders",
             action=argparse.BooleanOptionalAction, default=None,
             help="with bf16 parameters: fp32 main parameters held as the bf16 parameters plus 16-bit remainders "
                  "(the same values, 2 bytes per parameter less); on by default with --bf16, as Megatron's")
    add_flag(g, "--initial-loss-scale", "MegatronPrecision.initial_loss_scale", type=float, default=None,
             help="fp16: starting loss scale (default 65536)")
    add_flag(g, "--loss-scale-window", "MegatronPrecision.loss_scale_window", type=int, default=None,
             help="fp16: overflow-free steps before the loss scale doubles (default 1000)")
    add_flag(g, "--fp8-format", "MegatronPrecision.fp8", choices=FP8_FORMATS, default=None,
             help="FP8 GEMMs in the transformer layers: e4m3, or hybrid (e4m3 forward, e5m2 gradients)")
    add_flag(g, "--fp8-hybrid", "MegatronPrecision.fp8", action="store_true", help="= --fp8-format hybrid")
    add_flag(g, "--fp8-recipe", "MegatronPrecision.fp8_recipe", choices=FP8_RECIPES + ("blockwise",), default=None,
             help="delayed (default), tensorwise, rowwise (torch backend), mxfp8 (Transformer Engine, compute "
                  "capability >= 10)")
    add_flag(g, "--fp8-margin", "MegatronPrecision.fp8_margin", type=int, default=None)
    add_flag(g, "--fp8-amax-history-len", "MegatronPrecision.fp8_amax_history_len", type=int, default=None,
             help="delayed recipe (default 1)")
    add_flag(g, "--fp8-amax-compute-algo", "MegatronPrecision.fp8_amax_compute_algo",
             choices=AMAX_COMPUTE_ALGOS, default=None, help="delayed recipe (default most_recent)")
    add_flag(g, "--fp8-backend", "MegatronPrecision.fp8_backend", choices=FP8_BACKENDS, default=None,
             help="(not a Megatron flag) auto (default: Transformer Engine on CUDA when installed, else torch), te, "
                  "torch (torch._scaled_mm, also on CPU)")
    add_flag(g, "--first-last-layers-bf16", "MegatronPrecision.first_last_layers_bf16", action="store_true",
             help="keep the first / last transformer layers out of FP8 (not with --fp8-recipe delayed)")
    add_flag(g, "--num-layers-at-start-in-bf16", "MegatronPrecision.num_layers_at_start_in_bf16", type=int,
             default=None, help="with --first-last-layers-bf16 (default 1)")
    add_flag(g, "--num-layers-at-end-in-bf16", "MegatronPrecision.num_layers_at_end_in_bf16", type=int,
             default=None, help="with --first-last-layers-bf16 (default 1)")

    g = p.add_argument_group("data")
    add_flag(g, "--data-path", "GPTDataModule.data_path", nargs="+", default=None,
             help="indexed-dataset prefix(es), or a weighted blend '0.3 a 0.7 b' (one quoted string or separate "
                  "words); default: the shipped corpus (TinyCorpusDataModule)")
    add_flag(g, "--split", "GPTDataModule.split", default=None, help="train,valid,test weights (default 969,30,1)")
    add_flag(g, "--tokenizer-type", ("TinyCorpusDataModule.tokenizer", "GPTConfig.vocab_size", "GPTDataModule.eod_id"),
             default=None,
             help="SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer, ByteTokenizer, "
                  "NullTokenizer (needs --vocab-size)")
    add_flag(g, "--tokenizer-model", ("GPTConfig.vocab_size", "GPTDataModule.eod_id"), default=None)
    add_flag(g, "--data-cache-path", ("TinyCorpusDataModule.cache_dir", "GPTDataModule.cache_dir"), default=None,
             help="where tokenised data / dataset indices are cached")
    add_flag(g, "--eod-mask-loss", ("GPTDataModule.eod_mask_loss", "GPTDataModule.eod_id"), action="store_true")
    add_flag(g, "--reset-position-ids", ("GPTDataModule.reset_position_ids", "GPTDataModule.eod_id"),
             action="store_true", help="positions restart at 0 after every end-of-document token")
    add_flag(g, "--reset-attention-mask", ("GPTDataModule.reset_attention_mask", "GPTDataModule.eod_id"),
             action="store_true",
             help="a token attends only to its own document of the packed sample (batches carry document_ids)")
    add_flag(g, "--num-workers", ("TinyCorpusDataModule.num_workers", "GPTDataModule.num_workers"), type=int,
             default=None, help="DataLoader workers (default 2; shipped corpus 0)")

    g = p.add_argument_group("checkpoints")
    add_flag(g, "--save", ("ModelCheckpoint.dirpath", "Trainer.enable_checkpointing"), default=None,
             help="checkpoint directory (last.ckpt at the end)")
    add_flag(g, "--save-interval", "ModelCheckpoint.every_n_train_steps", type=int, default=None,
             help="also save every N optimizer steps")
    add_flag(g, "--load", ("Trainer.fit.ckpt_path", "CheckpointWeights.path"), default=None,
             help="checkpoint file, or a directory holding last.ckpt, to resume from; a file of weights only (python "
                  "-m lightning_megatron.hf import) is started from at iteration 0")
    add_flag(g, "--ckpt-format", "MegatronStrategy.ckpt_format", choices=("torch", "torch_dist"), default=None,
             help="torch: one file of full tensors (default); torch_dist: a directory of each rank's shards")
    add_flag(g, "--async-save", "MegatronStrategy.async_save", action="store_true",
             help="write torch_dist checkpoints in the background")
    add_flag(g, "--distributed-timeout-minutes", "MegatronStrategy.distributed_timeout_minutes", type=float,
             default=None, help="timeout of every process group (default 30)")

    g = p.add_argument_group("run control, logging, profiling")
    add_flag(g, "--mock-data", "MockGPTDataModule", action="store_true",
             help="random tokens below the vocabulary instead of a dataset (--vocab-size sets it)")
    add_flag(g, "--tensorboard-dir", "TensorBoardLogger.save_dir", default=None,
             help="TensorBoard event files (Lightning's TensorBoardLogger; CSV files there, with a note, when "
                  "tensorboard is not installed)")
    add_flag(g, "--exit-duration-in-mins", "Timer.duration", type=float, default=None,
             help="stop cleanly after this many minutes of training (Lightning's Timer; --save still saves)")
    add_flag(g, "--profile", "StepProfiler", action="store_true",
             help="torch.profiler over steps [--profile-step-start, --profile-step-end) on --profile-ranks; "
                  "traces under --tensorboard-dir (else ./profile)")
    add_flag(g, "--profile-step-start", "StepProfiler.start_step", type=int, default=None, help="default 10")
    add_flag(g, "--profile-step-end", "StepProfiler.end_step", type=int, default=None, help="default 12")
    add_flag(g, "--profile-ranks", "StepProfiler.ranks", type=int, nargs="+", default=None, help="default 0")
    add_flag(g, "--manual-gc", "MemoryHousekeeping.manual_gc", action="store_true",
             help="Python's garbage collector off during training, run every --manual-gc-interval steps")
    add_flag(g, "--manual-gc-interval", "MemoryHousekeeping.gc_interval", type=int, default=None,
             help="steps between collections with --manual-gc (default 0: only at validation)")
    add_flag(g, "--empty-unused-memory-level", "MemoryHousekeeping.empty_unused_memory_level", type=int,
             choices=(0, 1, 2), default=None,
             help="CUDA caching allocator: 1 empties it after each optimizer step, 2 also after validation")
    add_flag(g, "--loss-curve", "LossCurve.path", default=None,
             help="(not a Megatron flag) the loss curve's path without suffix: .csv, and .png with matplotlib, "
                  "else .svg (default: <--tensorboard-dir, else lightning_logs>/loss_curve)")
    add_accepted_flag(g, "--use-mcore-models", "the one model here is built as Megatron Core's GPTModel",
                      action="store_true")
    add_accepted_flag(g, "--transformer-impl", "the layers are torch modules either way; Transformer Engine is "
                      "used for the FP8 GEMMs only, as --fp8-backend says", choices=("local", "transformer_engine"),
                      default=None)
    add_accepted_flag(g, "--rotary-percent", "rotary embeddings cover the whole head dimension (only 1.0 is "
                      "accepted)", type=float, default=None)
    add_accepted_flag(g, "--apply-layernorm-1p", "norm weights stay fp32 and, as in Megatron, get no weight decay, "
                      "so storing them as scale - 1 would train the same up to fp32 rounding; they are stored as the "
                      "scale", action="store_true")
    add_accepted_flag(g, "--cross-entropy-loss-fusion", "the vocabulary-parallel cross entropy is already one "
                      "autograd function over the logit shards (no separate unfused path)", action="store_true")
    add_accepted_flag(g, "--calculate-per-token-loss", "without a loss mask every micro-batch counts the same "
                      "tokens, so the loss is already the step's per-token mean (refused with --eod-mask-loss)",
                      action="store_true")
    add_accepted_flag(g, "--tiktoken-pattern", "only a TikTokenizer reads it, and that tokenizer type is not "
                      "offered here", default=None)
    add_accepted_flag(g, "--no-create-attention-mask-in-dataloader", "the data modules never build attention masks "
                      "(attention is causal inside the kernel)", action="store_true")
    add_accepted_flag(g, "--no-mmap-bin-files", ".bin files are read through memory maps either way (the same "
                      "tokens)", action="store_true")

    g = p.add_argument_group("not supported yet (refused with a message)")

    add_refused_flag(g, "--fp8-param-gather", "FP8 parameters and their all-gather", action="store_true")
    # FSDP runs through Megatron's sharding levels: --use-custom-fsdp --data-parallel-sharding-strategy ...
    add_refused_flag(g, "--use-torch-fsdp2", "FSDP2 outside the sharding levels", action="store_true")

    g = p.add_argument_group("mixture of experts (with --expert-model-parallel-size / --expert-tensor-parallel-size)")
    add_flag(g, "--num-experts", "GPTConfig.num_moe_experts", type=int, default=None,
             help="routed experts per MoE layer (default: dense)")
    add_flag(g, "--moe-grouped-gemm", "GPTConfig.moe_grouped_gemm", action="store_true", default=None,
             help="one grouped GEMM for the local experts (torch._grouped_mm; loop fallback)")
    add_flag(g, "--moe-router-topk", "GPTConfig.moe_router_topk", type=int, default=None,
             help="experts per token (default 2)")
    add_flag(g, "--moe-ffn-hidden-size", "GPTConfig.moe_ffn_hidden_size", type=int, default=None,
             help="expert ffn size (default --ffn-hidden-size)")
    add_flag(g, "--moe-layer-freq", "GPTConfig.moe_layer_freq", type=_layer_freq, default=None,
             help="N (every N-th layer is MoE) or a 0/1 list such as [1,0,1,0] (default 1)")
    add_flag(g, "--moe-router-score-function", "GPTConfig.moe_router_score_function", choices=("softmax", "sigmoid"),
             default=None)
    add_flag(g, "--moe-router-pre-softmax", "GPTConfig.moe_router_pre_softmax", action="store_true", default=None)
    add_flag(g, "--moe-router-load-balancing-type", "GPTConfig.moe_router_load_balancing_type",
             choices=("aux_loss", "seq_aux_loss", "none"), default=None)
    add_flag(g, "--moe-aux-loss-coeff", "GPTConfig.moe_aux_loss_coeff", type=float, default=None)
    add_flag(g, "--moe-z-loss-coeff", "GPTConfig.moe_z_loss_coeff", type=float, default=None)
    add_flag(g, "--moe-router-enable-expert-bias", "GPTConfig.moe_router_enable_expert_bias", action="store_true",
             default=None)
    add_flag(g, "--moe-router-bias-update-rate", "GPTConfig.moe_router_bias_update_rate", type=float, default=None)
    add_flag(g, "--moe-expert-capacity-factor", "GPTConfig.moe_expert_capacity_factor", type=float, default=None,
             help="default: dropless")
    add_flag(g, "--moe-token-drop-policy", "GPTConfig.moe_token_drop_policy", choices=("probs", "position"),
             default=None)
    add_flag(g, "--moe-shared-expert-intermediate-size", "GPTConfig.moe_shared_expert_intermediate_size", type=int,
             default=None)
    add_flag(g, "--moe-token-dispatcher-type", "GPTConfig.moe_token_dispatcher_type", choices=("alltoall", "allgather"),
             default=None)
    return p
