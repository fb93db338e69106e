"""Pretrain a GPT / LLaMA-style model with MegatronStrategy.

With no arguments: a tiny LLaMA (4 layers, hidden 128, GQA, SwiGLU, RoPE) on the small English corpus
shipped in the repo, tokenised locally with a SentencePiece model trained on it (no downloads), on CPU with
2 processes, tensor parallel 2 with sequence parallelism. About a minute on 2 cores; the progress bar shows
``train_loss`` falling and ``val_loss`` at each validation.

    python examples/pretrain_gpt.py
    python examples/pretrain_gpt.py --accelerator gpu --devices 2 --tensor-model-parallel-size 2 \\
        --sequence-parallel --precision bf16-mixed --hidden-size 1024 --num-layers 12 --train-iters 2000

Flags keep Megatron-LM's names where they exist.
"""
from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule
from lightning_megatron.data import TinyCorpusDataModule


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-model-parallel-size", type=int, default=2)
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--ffn-hidden-size", type=int, default=352)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=2048, help="SentencePiece vocabulary trained on the corpus")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=20)
    p.add_argument("--train-iters", type=int, default=400)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--save", default=None, help="directory for checkpoints (saved at the end)")
    p.add_argument("--load", default=None, help="checkpoint file to resume from")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    pl.seed_everything(args.seed, verbose=False)
    data = TinyCorpusDataModule(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                tokenizer="sentencepiece", vocab_size=args.vocab_size)
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, vocab_size=data.vocab_size,
                       seq_length=args.seq_length, make_vocab_size_divisible_by=128)
    model = ParallelGPTModule(config, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
                              weight_decay=0.1, adam_beta2=0.95)
    strategy = MegatronStrategy(tp=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel)
    callbacks = [ModelCheckpoint(dirpath=args.save, save_last=True)] if args.save else []
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                         precision=args.precision, max_steps=args.train_iters, val_check_interval=args.eval_interval,
                         limit_val_batches=args.eval_iters, gradient_clip_val=args.clip_grad, log_every_n_steps=10,
                         logger=False, enable_checkpointing=bool(args.save), callbacks=callbacks,
                         num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data, ckpt_path=args.load)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {metrics}")


if __name__ == "__main__":
    main()
