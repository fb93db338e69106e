"""Pretrain a GPT / LLaMA-style model with MegatronStrategy, from Megatron-LM's command-line flags.

With no arguments: a tiny LLaMA (4 layers, hidden 128, GQA 4/2, SwiGLU, RoPE) on the small English corpus
shipped in the repo, tokenised locally with a SentencePiece model trained on it (no downloads), on CPU with
2 processes, tensor parallel 2 with sequence parallelism. About a minute on 2 cores; the progress bar shows
``train_loss`` falling and ``val_loss`` at each validation.

    python examples/pretrain_gpt.py

On a Megatron-LM indexed dataset (``python -m lightning_megatron.data.preprocess``, see
``lightning_megatron/data/README_DATA.md``), with the flags of a Megatron-LM command line:

    python examples/pretrain_gpt.py --accelerator gpu --devices 8 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \\
        --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention \\
        --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 2048 \\
        --micro-batch-size 2 --global-batch-size 64 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 \\
        --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \\
        --train-iters 2000 --eval-interval 200 --eval-iters 10 --log-interval 10 \\
        --data-path 0.3 out/web_text_document 0.7 out/books_text_document --split 969,30,1 \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --save ckpt --save-interval 500 --load ckpt

How the flags map:

* Layout: ``MegatronStrategy(tp, pp, vp, cp, ep, etp, sequence_parallel, cp_comm_type, ...)``;
  dp = world / (tp * pp * cp) with world = devices * nodes.
* ``--global-batch-size`` = micro-batch x dp x micro-batches: the micro-batches per optimizer step become
  ``Trainer(accumulate_grad_batches=...)`` (under pipeline parallelism they are the pipeline's micro-batches,
  at least pp for the 1f1b schedules). Without it the global batch is micro-batch x dp (Megatron's default).
* ``--train-iters`` is ``max_steps`` (optimizer steps); ``--eval-interval`` is in optimizer steps and
  ``--eval-iters`` in global batches, as in Megatron.
* ``--data-path`` uses ``GPTDataModule`` (one prefix, several, or a weighted blend ``0.3 a 0.7 b``); the
  vocabulary comes from ``--tokenizer-type`` / ``--tokenizer-model``. Such runs print one line per
  ``--log-interval`` steps with the loss and ``MFUMonitor``'s throughput (``--log-throughput`` adds it to the
  shipped-corpus run too; ``--peak-tflops`` gives the peak for ``mfu`` on devices the table does not know).
* ``--save DIR`` keeps ``DIR/last.ckpt`` (and one every ``--save-interval`` steps, and at the end);
  ``--load`` resumes from a file or from ``DIR/last.ckpt`` (a directory without one starts fresh, as Megatron).

Defaults are those of the shipped tiny run where it needs them, which differ from Megatron-LM's in places:
sequence parallelism is on when tp > 1 (``--no-sequence-parallel``), lr decay is cosine, weight decay 0.1,
Adam beta2 0.95, no dropout, and the model is LLaMA-style (RMSNorm, RoPE, SwiGLU, no linear biases, untied
embeddings) unless ``--normalization`` / ``--position-embedding-type`` / ``--no-swiglu`` say otherwise.
When ``--hidden-size`` is given, ``--ffn-hidden-size`` defaults to Megatron's rule; when
``--num-attention-heads`` is given, query groups default to the heads (``--group-query-attention``: 1).
Flags of features that have not landed are recognised and refused with a message naming them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule
from lightning_megatron.parallel.config import CP_COMM_TYPES, ParallelConfig
from lightning_megatron.parallel.pipeline import SCHEDULE_NAMES, layers_per_stage, min_microbatches

# The default (shipped-corpus) model; shape flags left out take these values.
TINY = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=352,
            seq_length=128, vocab_size=2048)
TINY_LR = dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=20)

# Flags of features that have not landed yet: refused before anything starts, with the reason.
NOT_SUPPORTED = {
    "fp8_hybrid": ("--fp8-hybrid", "FP8 training"),
    "fp8_format": ("--fp8-format", "FP8 training"),
    "recompute_granularity": ("--recompute-granularity", "activation recompute"),
    "recompute_activations": ("--recompute-activations", "activation recompute"),
    "recompute_method": ("--recompute-method", "activation recompute"),
    "recompute_num_layers": ("--recompute-num-layers", "activation recompute"),
    "overlap_grad_reduce": ("--overlap-grad-reduce", "communication overlap"),
    "overlap_param_gather": ("--overlap-param-gather", "communication overlap"),
    "tp_comm_overlap": ("--tp-comm-overlap", "tensor-parallel communication overlap"),
    "use_custom_fsdp": ("--use-custom-fsdp", "FSDP"),
    "use_torch_fsdp2": ("--use-torch-fsdp2", "FSDP"),
}
# Megatron's MoE flags -> GPTConfig fields (parsed values are passed on unchanged; None = not given)
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
# Sizes whose > 1 values MegatronStrategy may refuse (NotImplementedError): probed, so they work once landed.
PROBED_SIZES = {"cp": "--context-parallel-size", "ep": "--expert-model-parallel-size"}


class FlagError(ValueError):
    """A flag (or a combination) that cannot run; ``main`` turns it into an argparse error (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    """The command line, with Megatron-LM's flag names (``allow_abbrev=False`` as Megatron's parser)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [Megatron-LM flags] (--help lists them)", allow_abbrev=False)
    g = p.add_argument_group("parallel layout")
    g.add_argument("--tensor-model-parallel-size", type=int, default=2, help="tp (default 2)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pp")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="vp: model chunks per pipeline rank (interleaved schedule)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default=None,
                   help="(not a Megatron flag) default: interleaved_1f1b with vp > 1, else 1f1b")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1, help="cp")
    g.add_argument("--cp-comm-type", nargs="+", choices=CP_COMM_TYPES, default=["p2p"])
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="ep")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="etp (default tp)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on when tp > 1")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer states over dp x cp (ZeRO-1)")
    g.add_argument("--delay-wgrad-compute", action=argparse.BooleanOptionalAction, default=None,
                   help="a2a context parallel (tp=1): run the weight-gradient GEMMs during the backward all-to-alls "
                        "(default: on wherever it applies; --no-delay-wgrad-compute keeps them in place)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce data-parallel gradients in bf16 (half the traffic)")
    g.add_argument("--accelerator", default="cpu")
    g.add_argument("--devices", type=int, default=2, help="processes per node")
    g.add_argument("--num-nodes", type=int, default=1)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help=f"default {TINY['num_layers']}")
    g.add_argument("--hidden-size", type=int, default=None, help=f"default {TINY['hidden_size']}")
    g.add_argument("--num-attention-heads", type=int, default=None, help=f"default {TINY['num_attention_heads']}")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help=f"default {TINY['num_query_groups']} for the default heads, else heads (MHA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help=f"default {TINY['ffn_hidden_size']}")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None, help=f"default {TINY['seq_length']}")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"shipped corpus: SentencePiece vocabulary to train (default {TINY['vocab_size']}); "
                        "--data-path: at least the tokenizer's (NullTokenizer: ids below it, plus eod)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default=None)
    g.add_argument("--norm-epsilon", type=float, default=None)
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default=None)
    g.add_argument("--use-rotary-position-embeddings", action="store_true")
    g.add_argument("--rotary-base", type=int, default=None)
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None, help="default on")
    g.add_argument("--disable-bias-linear", action="store_true", help="(the default here)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", help="(the default here)")
    g.add_argument("--init-method-std", type=float, default=None)
    g.add_argument("--hidden-dropout", type=float, default=None)
    g.add_argument("--attention-dropout", type=float, default=None)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro-batch x dp")
    g.add_argument("--train-iters", type=int, default=400)
    g.add_argument("--lr", type=float, default=None, help=f"default {TINY_LR['lr']}")
    g.add_argument("--min-lr", type=float, default=None,
                   help=f"default {TINY_LR['min_lr']} with the default --lr, else 0 (Megatron's)")
    g.add_argument("--lr-warmup-iters", type=int, default=None, help=f"default {TINY_LR['lr_warmup_iters']}")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warmup = fraction x decay iters")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="= --precision bf16-mixed")
    g.add_argument("--fp16", action="store_true", help="= --precision 16-mixed")
    g.add_argument("--precision", default=None, help="Lightning's precision (default 32-true)")
    g.add_argument("--eval-interval", type=int, default=100, help="optimizer steps between validations")
    g.add_argument("--eval-iters", type=int, default=10, help="global batches per validation (0: none)")
    g.add_argument("--log-interval", type=int, default=10, help="optimizer steps between log lines")
    g.add_argument("--log-throughput", action="store_true", help="MFUMonitor also without --data-path")
    g.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device, for mfu")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed-dataset prefix(es), or a weighted blend '0.3 a 0.7 b' (one quoted string or "
                        "separate words); default: the shipped corpus")
    g.add_argument("--split", default=None, help="train,valid,test weights (default 969,30,1)")
    g.add_argument("--tokenizer-type", default=None,
                   help="SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer, ByteTokenizer, "
                        "NullTokenizer (needs --vocab-size)")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--data-cache-path", default=None, help="where dataset indices are cached")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default 2; shipped corpus 0)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="checkpoint directory (last.ckpt at the end)")
    g.add_argument("--save-interval", type=int, default=None, help="also save every N optimizer steps")
    g.add_argument("--load", default=None, help="checkpoint file, or a directory holding last.ckpt")

    g = p.add_argument_group("not supported yet (refused with a message)")
    g.add_argument("--fp8-hybrid", action="store_true")
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None)
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--tp-comm-overlap", action="store_true")
    g.add_argument("--use-custom-fsdp", action="store_true")
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g = p.add_argument_group("mixture of experts (with --expert-model-parallel-size / --expert-tensor-parallel-size)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (default: dense)")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                   help="one grouped GEMM for the local experts (torch._grouped_mm; loop fallback)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token (default 2)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="expert ffn size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=None,
                   help="N (every N-th layer is MoE) or a 0/1 list such as [1,0,1,0] (default 1)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default=None)
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None)
    g.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "none"), default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None)
    g.add_argument("--moe-router-bias-update-rate", type=float, default=None)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="default: dropless")
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default=None)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default=None)
    return p


def _layer_freq(text: str) -> Union[int, List[int]]:
    """``--moe-layer-freq``: an int, or a list literal of 0/1 (Megatron also takes ``"([1]*N)"``-style code;
    write the list out here)."""
    import ast

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or a list such as [1,0,1,0]") from e
    if isinstance(value, (list, tuple)):
        return [int(x) for x in value]
    if isinstance(value, int):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not an int or a list such as [1,0,1,0]")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@dataclasses.dataclass
class RunPlan:
    """What a command line turns into (built without starting anything, so it can be tested).

    ``model``: ``GPTConfig`` kwargs (``vocab_size`` is None for the shipped corpus until its tokenizer is
    trained); ``module``: ``ParallelGPTModule`` optimizer/schedule kwargs; ``strategy``: ``MegatronStrategy``
    kwargs; ``trainer``: ``pl.Trainer`` kwargs; ``data_kind`` ``"gpt"`` (``GPTDataModule``) or ``"tiny"``
    (``TinyCorpusDataModule``) with its kwargs ``data``; ``mfu``: ``MFUMonitor`` kwargs or None;
    ``checkpoint``: ``ModelCheckpoint`` kwargs or None; ``resume``: the ``ckpt_path`` or None.
    """

    model: Dict[str, Any]
    module: Dict[str, Any]
    strategy: Dict[str, Any]
    trainer: Dict[str, Any]
    data_kind: str
    data: Dict[str, Any]
    mfu: Optional[Dict[str, Any]]
    checkpoint: Optional[Dict[str, Any]]
    resume: Optional[str]
    seed: int
    data_parallel_size: int
    num_microbatches: int
    global_batch_size: int
    notes: List[str] = dataclasses.field(default_factory=list)

    def as_tuple(self):
        """``(GPTConfig kwargs, strategy kwargs, trainer kwargs, data kwargs)``."""
        return self.model, self.strategy, self.trainer, self.data


def parse_data_path_args(words: Sequence[str]) -> List[Any]:
    """Megatron's ``--data-path`` words (``a``, ``a b``, ``0.3 a 0.7 b``, or one quoted string of them) as
    ``GPTDataModule(data_path=...)`` takes it: weights as floats, prefixes as strings."""
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


def _unsupported(args: argparse.Namespace) -> List[str]:
    refused = []
    for dest, (flag, what) in NOT_SUPPORTED.items():
        value = getattr(args, dest)
        if value is not None and value is not False:
            refused.append(f"{flag} ({what})")
    for name, flag in PROBED_SIZES.items():
        size = getattr(args, {"cp": "context_parallel_size", "ep": "expert_model_parallel_size"}[name])
        if size > 1:
            try:
                MegatronStrategy(**{name: size})
            except NotImplementedError:
                refused.append(f"{flag} {size} ({'context' if name == 'cp' else 'expert'} parallelism > 1)")
    return refused


def _resolve_tokenizer(args: argparse.Namespace):
    """(vocab size, eod id) of ``--tokenizer-type`` / ``--tokenizer-model`` for a ``--data-path`` run."""
    from lightning_megatron.data import build_tokenizer

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
    heads = args.num_attention_heads
    hidden = args.hidden_size
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
    kw: Dict[str, Any] = dict(
        num_layers=args.num_layers if args.num_layers is not None else TINY["num_layers"],
        hidden_size=hidden if hidden is not None else TINY["hidden_size"],
        num_attention_heads=heads if heads is not None else TINY["num_attention_heads"],
        num_query_groups=groups, ffn_hidden_size=ffn,
        seq_length=args.seq_length if args.seq_length is not None else TINY["seq_length"],
        vocab_size=None, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, swiglu=swiglu,
    )
    pos = args.position_embedding_type or ("rope" if args.use_rotary_position_embeddings else None)
    for key, value in (("kv_channels", args.kv_channels), ("max_position_embeddings", args.max_position_embeddings),
                       ("normalization", args.normalization), ("norm_epsilon", args.norm_epsilon),
                       ("position_embedding_type", pos), ("rotary_base", args.rotary_base),
                       ("init_method_std", args.init_method_std), ("hidden_dropout", args.hidden_dropout),
                       ("attention_dropout", args.attention_dropout)):
        if value is not None:
            kw[key] = value
    for dest, field in MOE_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            kw[field] = value
    if "num_moe_experts" not in kw:
        given = [f"--{dest.replace('_', '-')}" for dest in MOE_FLAGS if field_given(args, dest)]
        if given:
            raise FlagError(f"{', '.join(given)} need --num-experts (the model is dense without it)")
    return kw


def field_given(args: argparse.Namespace, dest: str) -> bool:
    return dest != "num_experts" and getattr(args, dest) is not None


def config_from_args(args: argparse.Namespace) -> RunPlan:
    """Map parsed flags onto the model, strategy, Trainer and data, checking everything that can be checked
    before any process starts.

    Raises:
        FlagError: a flag of a feature that has not landed, or a layout / batch / shape that cannot run
            (the message names the flags and numbers).
    """
    refused = _unsupported(args)
    if refused:
        raise FlagError("not supported yet in lightning-megatron: " + ", ".join(refused)
                        + "; drop these flags (sizes: use 1); each feature lands with its own issue")
    if args.bf16 and args.fp16:
        raise FlagError("--bf16 and --fp16 are mutually exclusive")
    precision = "bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else None
    if precision and args.precision and args.precision != precision:
        raise FlagError(f"--{'bf16' if args.bf16 else 'fp16'} means --precision {precision}, "
                        f"but --precision {args.precision} was given")
    precision = precision or args.precision or "32-true"
    for flag, value in (("--devices", args.devices), ("--num-nodes", args.num_nodes),
                        ("--micro-batch-size", args.micro_batch_size), ("--train-iters", args.train_iters),
                        ("--eval-interval", args.eval_interval), ("--log-interval", args.log_interval)):
        if value < 1:
            raise FlagError(f"{flag} must be >= 1, got {value}")
    if args.eval_iters < 0:
        raise FlagError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    gpt_data = args.data_path is not None
    if not gpt_data:
        for flag, value in (("--split", args.split), ("--tokenizer-model", args.tokenizer_model),
                            ("--data-cache-path", args.data_cache_path), ("--eod-mask-loss", args.eod_mask_loss)):
            if value:
                raise FlagError(f"{flag} needs --data-path (the shipped corpus has its own tokenizer and split)")
    if args.save_interval is not None and not args.save:
        raise FlagError("--save-interval needs --save")
    notes: List[str] = []

    # ---- model
    model = _model_kwargs(args)
    try:
        GPTConfig(**{**model, "vocab_size": 1})
    except (ValueError, TypeError) as e:
        raise FlagError(f"model shape: {e}") from e

    # ---- layout
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    vp = args.virtual_pipeline_model_parallel_size
    sp = args.sequence_parallel if args.sequence_parallel is not None else tp > 1
    if sp and tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it")
        sp = False
    cp_comm = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else list(args.cp_comm_type)
    strategy: Dict[str, Any] = dict(tp=tp, pp=pp, vp=vp, cp=cp, ep=args.expert_model_parallel_size,
                                    sequence_parallel=sp)
    optional = (("etp", args.expert_tensor_parallel_size), ("pipeline_schedule", args.pipeline_schedule),
                ("num_layers_in_first_pipeline_stage", args.decoder_first_pipeline_num_layers),
                ("num_layers_in_last_pipeline_stage", args.decoder_last_pipeline_num_layers),
                ("hierarchical_context_parallel_sizes", args.hierarchical_context_parallel_sizes))
    strategy.update({k: v for k, v in optional if v is not None})
    if cp_comm != "p2p":
        strategy["cp_comm_type"] = cp_comm
    if args.grad_reduce_in_bf16:
        strategy["grad_reduce_in_bf16"] = True
    if args.use_distributed_optimizer:
        strategy["use_distributed_optimizer"] = True
    if args.delay_wgrad_compute is not None:
        strategy["delay_wgrad_compute"] = args.delay_wgrad_compute
    world = args.devices * args.num_nodes
    try:
        probe = MegatronStrategy(**strategy)  # constructor checks (sizes, schedule); starts nothing
        layout = ParallelConfig(**{k: strategy[k] for k in ("tp", "pp", "vp", "cp", "ep", "etp",
                                                             "sequence_parallel", "cp_comm_type",
                                                             "hierarchical_context_parallel_sizes")
                                   if k in strategy}).resolve(world)
        layout.validate_model(GPTConfig(**{**model, "vocab_size": 1}))
        if pp > 1:
            layers_per_stage(model["num_layers"], pp * (vp or 1), args.decoder_first_pipeline_num_layers,
                             args.decoder_last_pipeline_num_layers)
    except (ValueError, NotImplementedError) as e:
        raise FlagError(f"parallel layout (world size {world} = --devices {args.devices} x --num-nodes "
                        f"{args.num_nodes}): {e}") from e
    dp = layout.dp

    # ---- batch arithmetic: global = micro x dp x micro-batches
    from lightning_megatron.data import compute_num_microbatches

    gbs = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
    try:
        micro_batches = compute_num_microbatches(gbs, args.micro_batch_size, dp)
    except ValueError as e:
        raise FlagError(f"--global-batch-size {gbs}, --micro-batch-size {args.micro_batch_size}, data-parallel "
                        f"size {dp} (= world {world} / (tp {tp} x pp {pp} x cp {cp})): {e}") from e
    if pp > 1:
        need = min_microbatches(probe.pipeline_schedule, pp)
        if micro_batches < need:
            raise FlagError(
                f"--pipeline-model-parallel-size {pp} with the {probe.pipeline_schedule!r} schedule needs at least "
                f"{need} micro-batches per optimizer step, but --global-batch-size {gbs} / (--micro-batch-size "
                f"{args.micro_batch_size} x dp {dp}) = {micro_batches}: use --global-batch-size >= "
                f"{need * args.micro_batch_size * dp}")

    # ---- optimizer and schedule
    lr = args.lr if args.lr is not None else TINY_LR["lr"]
    min_lr = args.min_lr if args.min_lr is not None else (TINY_LR["min_lr"] if args.lr is None else 0.0)
    if min_lr > lr:
        raise FlagError(f"--min-lr {min_lr} is larger than --lr {lr}")
    decay_iters = args.lr_decay_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters is not None:
            raise FlagError("give --lr-warmup-iters or --lr-warmup-fraction, not both")
        warmup = int(args.lr_warmup_fraction * (decay_iters or args.train_iters))
    else:
        warmup = args.lr_warmup_iters if args.lr_warmup_iters is not None else TINY_LR["lr_warmup_iters"]
    module = dict(lr=lr, min_lr=min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                  adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, lr_warmup_iters=warmup,
                  lr_decay_iters=decay_iters, lr_decay_style=args.lr_decay_style)

    # ---- data
    if gpt_data:
        vocab, eod = _resolve_tokenizer(args)
        model["vocab_size"] = vocab
        data_kind = "gpt"
        data = dict(data_path=parse_data_path_args(args.data_path), seq_length=model["seq_length"],
                    micro_batch_size=args.micro_batch_size, global_batch_size=gbs, split=args.split or "969,30,1",
                    seed=args.seed, train_iters=args.train_iters, eval_iters=args.eval_iters,
                    num_workers=args.num_workers if args.num_workers is not None else 2,
                    cache_dir=args.data_cache_path, eod_mask_loss=args.eod_mask_loss,
                    eod_id=eod if args.eod_mask_loss else None, data_parallel_size=dp)
        limit_val = 1.0 if args.eval_iters > 0 else 0  # the valid set is eval_iters global batches
    else:
        kind = args.tokenizer_type or "SentencePieceTokenizer"
        tiny_tok = {"SentencePieceTokenizer": "sentencepiece", "GPTSentencePieceTokenizer": "sentencepiece",
                    "ByteTokenizer": "byte"}.get(kind)
        if tiny_tok is None:
            raise FlagError(f"--tokenizer-type {kind} needs --data-path; the shipped corpus is tokenised with "
                            "SentencePieceTokenizer (trained on it) or ByteTokenizer")
        data_kind = "tiny"
        data = dict(seq_length=model["seq_length"], micro_batch_size=args.micro_batch_size, tokenizer=tiny_tok,
                    vocab_size=args.vocab_size if args.vocab_size is not None else TINY["vocab_size"],
                    num_workers=args.num_workers if args.num_workers is not None else 0)
        limit_val = args.eval_iters * micro_batches  # micro-batches per rank

    # ---- trainer (Lightning counts validation interval / limits in micro-batches, steps in optimizer steps)
    trainer = dict(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                   precision=precision, max_steps=args.train_iters, accumulate_grad_batches=micro_batches,
                   val_check_interval=min(args.eval_interval, args.train_iters) * micro_batches,
                   limit_val_batches=limit_val, gradient_clip_val=args.clip_grad if args.clip_grad > 0 else None,
                   log_every_n_steps=args.log_interval, logger=False, enable_checkpointing=bool(args.save),
                   num_sanity_val_steps=0)
    if args.num_nodes == 1:
        del trainer["num_nodes"]

    mfu = None
    if gpt_data or args.log_throughput or args.peak_tflops is not None:
        mfu = dict(log_every_n_steps=args.log_interval,
                   peak_flops=args.peak_tflops * 1e12 if args.peak_tflops is not None else None)
    checkpoint = None
    if args.save:
        checkpoint = dict(dirpath=args.save, save_last=True, enable_version_counter=False)
        if args.save_interval is not None:
            checkpoint["every_n_train_steps"] = args.save_interval
    resume = None
    if args.load:
        path = Path(args.load)
        if path.is_dir():
            if (path / "last.ckpt").is_file():
                resume = str(path / "last.ckpt")
            else:
                notes.append(f"--load {args.load}: no last.ckpt there; starting from scratch")
        elif path.is_file():
            resume = str(path)
        else:
            raise FlagError(f"--load {args.load}: no such checkpoint file or directory")
    return RunPlan(model=model, module=module, strategy=strategy, trainer=trainer, data_kind=data_kind, data=data,
                   mfu=mfu, checkpoint=checkpoint, resume=resume, seed=args.seed, data_parallel_size=dp,
                   num_microbatches=micro_batches, global_batch_size=gbs, notes=notes)


class LastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also writes ``last.ckpt`` at the end of training when the last step was not
    saved yet (Megatron saves at the end of a run)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step
        else:
            super().on_train_end(trainer, pl_module)


class IterationPrinter(Callback):
    """Megatron-style log line on global rank 0 every ``every`` optimizer steps: loss, lr and the
    ``MFUMonitor`` metrics of that step (put it after the monitor in ``callbacks``)."""

    def __init__(self, every: int, global_batch_size: int, monitor: Any = None) -> None:
        self.every, self.global_batch_size, self.monitor = every, global_batch_size, monitor
        self._last_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step in this batch
            return
        self._last_step = step
        if step % self.every or not trainer.is_global_zero:
            return
        parts = [f"iteration {step:>6}/{trainer.max_steps}", f"consumed samples {step * self.global_batch_size}"]
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            parts.append(f"train_loss {float(loss):.4f}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3e}")
        for key, value in (getattr(self.monitor, "last_metrics", None) or {}).items():
            parts.append(f"{key} {value:.4g}")
        print(" | ".join(parts), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = config_from_args(args)
    except FlagError as e:
        parser.error(str(e))  # exits with status 2, before any process group exists

    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    pl.seed_everything(plan.seed, verbose=False)
    if plan.data_kind == "gpt":
        from lightning_megatron.data import GPTDataModule

        data = GPTDataModule(**plan.data)
    else:
        from lightning_megatron.data import TinyCorpusDataModule

        data = TinyCorpusDataModule(**plan.data)
        plan.model["vocab_size"] = data.vocab_size
    config = GPTConfig(**plan.model)
    model = ParallelGPTModule(config, **plan.module)
    strategy = MegatronStrategy(**plan.strategy)
    callbacks: List[Callback] = []
    monitor = None
    if plan.mfu is not None:
        from lightning_megatron.callbacks import MFUMonitor

        monitor = MFUMonitor(**plan.mfu)
        callbacks += [monitor, IterationPrinter(plan.mfu["log_every_n_steps"], plan.global_batch_size, monitor)]
    if plan.checkpoint is not None:
        callbacks.append(LastCheckpoint(**plan.checkpoint))
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, **plan.trainer)
    if trainer.is_global_zero:
        for note in plan.notes:
            print(f"note: {note}", flush=True)
        if plan.data_kind == "gpt":
            print(f"layout: world {trainer.world_size}, dp {plan.data_parallel_size}, global batch "
                  f"{plan.global_batch_size} = micro {args.micro_batch_size} x dp {plan.data_parallel_size} x "
                  f"{plan.num_microbatches} micro-batches; model {config.num_parameters / 1e6:.2f}M parameters",
                  flush=True)
    trainer.fit(model, datamodule=data, ckpt_path=plan.resume)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {metrics}")


if __name__ == "__main__":
    main()
