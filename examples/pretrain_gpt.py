"""Pretrain a GPT / LLaMA-style model with MegatronStrategy, from Megatron-LM's command-line flags.

With no arguments: a tiny LLaMA (4 layers, hidden 128, GQA 4/2, SwiGLU, RoPE) on the small English corpus
shipped in the repo, tokenised locally with a SentencePiece model trained on it (no downloads), on CPU with
2 processes, tensor parallel 2 with sequence parallelism, 400 steps. About two minutes on 2 cores; the progress
bar's ``loss`` (refreshed every 10 steps) falls from about 6.9 to about 3.9 (the first step's loss is 7.67), and
``val_loss`` ends near 4.35; at the end it prints a short greedy continuation of a prompt (``sample: ...``).

    python examples/pretrain_gpt.py

On a Megatron-LM indexed dataset (``python -m lightning_megatron.data.preprocess``, see ``docs/data.md``),
with the flags of a Megatron-LM command line:

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

Such runs print one line per ``--log-interval`` steps with the loss and ``MFUMonitor``'s throughput
(``--log-throughput`` adds it to the shipped-corpus run; ``--peak-tflops`` gives the peak for ``mfu`` on
devices its table does not know). ``lightning_megatron.cli`` turns the flags into the objects below;
``--help`` lists every flag with the argument it sets.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ProgressBar

from lightning_megatron import MFUMonitor, ParallelGPTModule
from lightning_megatron.callbacks import SampleContinuation
from lightning_megatron.cli import IterationPrinter, LastCheckpoint, parse_pretrain_args
from lightning_megatron.data import TinyCorpusDataModule


def main(argv: Optional[Sequence[str]] = None) -> None:
    # Flags -> a GPTConfig, a MegatronStrategy and a data module (each validated by its own constructor, the
    # layout against the world size and the model), plus the arguments of the module, Trainer and callbacks.
    # A flag or combination that cannot run exits here with a message naming it, before any process starts.
    plan = parse_pretrain_args(argv, description=__doc__.split("\n\n")[0])
    if plan.trainer_kwargs["accelerator"] == "cpu":  # the processes share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.trainer_kwargs["devices"]))
    pl.seed_everything(plan.seed, verbose=False)

    data, config = plan.data_module, plan.config
    if isinstance(data, TinyCorpusDataModule):  # the vocabulary of the SentencePiece model trained on the corpus
        config = config.replace(vocab_size=data.vocab_size)
    # The model is built on the meta device; the strategy materialises it already sharded.
    model = ParallelGPTModule(config, **plan.module_kwargs)

    # --exit-duration-in-mins (Timer), --profile, --manual-gc / --empty-unused-memory-level, the loss curve (CSV, and
    # a PNG with matplotlib, else an SVG) written at the end, and the progress bar, refreshed once per --log-interval; the bar
    # goes first, so that it has ended its line when the others print at the end of training
    run_control = plan.build_callbacks()
    callbacks: List[Callback] = [c for c in run_control if isinstance(c, ProgressBar)]
    if plan.mfu_kwargs is not None:  # tokens/s, TFLOP/s per device and MFU, printed as Megatron's log line
        monitor = MFUMonitor(**plan.mfu_kwargs)
        callbacks += [monitor, IterationPrinter(plan.mfu_kwargs["log_every_n_steps"], plan.global_batch_size,
                                                monitor)]
    if plan.checkpoint_kwargs is not None:  # --save: last.ckpt at the end, and every --save-interval steps
        callbacks.append(LastCheckpoint(**plan.checkpoint_kwargs))
    if isinstance(data, TinyCorpusDataModule):  # at the end: how the model continues a prompt (greedy, 12 tokens)
        callbacks.append(SampleContinuation("The compiler", data.tokenizer, max_new_tokens=12))
    callbacks += [c for c in run_control if not isinstance(c, ProgressBar)]
    # --bf16 / --fp16 / --fp8-*: MegatronPrecision (mixed precision, fp16 loss scaling over all ranks, FP8 GEMMs)
    plugins = [plan.precision] if plan.precision is not None else None
    trainer = pl.Trainer(strategy=plan.strategy, callbacks=callbacks, plugins=plugins, **plan.trainer_kwargs)

    if trainer.is_global_zero:
        for note in plan.notes:
            print(f"note: {note}", flush=True)
        print(plan.summary(config), flush=True)
    trainer.fit(model, datamodule=data, ckpt_path=plan.resume)
    if trainer.is_global_zero:
        print("done:", {key: float(value) for key, value in trainer.callback_metrics.items()}, flush=True)


if __name__ == "__main__":
    main()
