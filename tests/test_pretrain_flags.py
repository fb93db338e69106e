"""``lightning_megatron.cli`` takes Megatron-LM's flags: how they map onto GPTConfig / MegatronStrategy /
ParallelGPTModule / Trainer / data module (without launching), that every parsed flag reaches a real
constructor argument, that flags of features not landed yet are refused by name before any process starts,
and one real run of ``examples/pretrain_gpt.py`` on a preprocessed indexed dataset (tp=2, 2 processes, MFU
logged and checked against the FLOPs formula, resume)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_megatron.strategy import LAYOUT_OPTIONS
from lightning_megatron import GPTConfig, MegatronPrecision, MegatronStrategy, MFUMonitor, ParallelGPTModule
from lightning_megatron.callbacks import CheckpointWeights, LossCurve
from lightning_megatron.cli.callbacks import MemoryHousekeeping, StepProfiler
from lightning_megatron.cli.flags import TINY, accepted_flags
from lightning_megatron.cli import (
    FLAG_MAPPING,
    FlagError,
    build_parser,
    flag_targets,
    parse_data_path_args,
    parse_pretrain_args,
    plan_from_args,
    refused_flags,
)
from lightning_megatron.data import (
    GPTDataModule,
    MockGPTDataModule,
    TinyCorpusDataModule,
    parse_data_path,
    train_sentencepiece,
)

ROOT = Path(__file__).resolve().parents[1]
LLAMA = GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=352,
                  vocab_size=2048, seq_length=128)  # the shipped-corpus model
GPT_DATA = ["--data-path", "x", "--tokenizer-type", "ByteTokenizer"]  # a --data-path run (nothing is read)


def plan_of(argv):
    return plan_from_args(build_parser().parse_args(argv))


def exit_message(argv, capsys):
    """``parse_pretrain_args(argv)`` must exit with argparse's status 2 before any process group starts."""
    with pytest.raises(SystemExit) as exc:
        parse_pretrain_args(argv)
    assert exc.value.code == 2
    assert not (dist.is_available() and dist.is_initialized())
    return capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- mapping
def test_no_arguments_is_the_shipped_default_run():
    """The no-argument run: the tiny LLaMA on the shipped corpus, tp=2 + SP on 2 CPU processes, 400 steps."""
    plan = plan_of([])
    assert isinstance(plan.data_module, TinyCorpusDataModule)
    assert plan.data_kwargs == dict(seq_length=128, micro_batch_size=8, tokenizer="sentencepiece", vocab_size=2048,
                                    num_workers=0)
    assert plan.config == LLAMA
    assert plan.module_kwargs == dict(lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                                      adam_eps=1e-8, lr_warmup_iters=20, lr_decay_iters=None, lr_decay_style="cosine")
    assert plan.strategy_kwargs == dict(tp=2, pp=1, vp=None, cp=1, ep=1, sequence_parallel=True)
    assert isinstance(plan.strategy, MegatronStrategy)
    layout = plan.layout
    assert (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp, layout.sequence_parallel) == (2, 1, 1, 1, 1, True)
    assert plan.trainer_kwargs == dict(accelerator="cpu", devices=2, precision="32-true", max_steps=400,
                                       accumulate_grad_batches=1, val_check_interval=100, check_val_every_n_epoch=None,
                                       limit_val_batches=10,
                                       gradient_clip_val=1.0, log_every_n_steps=10, logger=False,
                                       enable_checkpointing=False, num_sanity_val_steps=0)
    assert plan.mfu_kwargs is None and plan.checkpoint_kwargs is None and plan.resume is None and plan.seed == 1234
    assert plan.summary() == ("layout: world 2 (tp 2, pp 1, cp 1, ep 1, dp 1); global batch 8 = micro 8 x dp 1 x 1 "
                              f"micro-batches; model {LLAMA.num_parameters / 1e6:.2f}M parameters")


def test_megatron_llama_command_maps_onto_strategy_model_trainer(tmp_path):
    argv = ("--accelerator gpu --devices 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--virtual-pipeline-model-parallel-size 2 --sequence-parallel --num-layers 8 --hidden-size 256 "
            "--num-attention-heads 8 --group-query-attention --num-query-groups 4 --ffn-hidden-size 688 "
            "--seq-length 512 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 64 --lr 3e-4 "
            "--min-lr 3e-5 --lr-warmup-iters 10 --lr-decay-iters 900 --lr-decay-style linear --weight-decay 0.05 "
            "--adam-beta1 0.8 --adam-beta2 0.99 --clip-grad 0.5 --train-iters 1000 --eval-interval 50 "
            "--eval-iters 3 --bf16 --seed 7 --log-interval 5 --normalization RMSNorm --swiglu "
            "--disable-bias-linear --untie-embeddings-and-output-weights --use-rotary-position-embeddings "
            "--rotary-base 500000 --tokenizer-type ByteTokenizer --split 98,2,0 "
            f"--data-path {tmp_path / 'a_text_document'} --save {tmp_path / 'ck'} --save-interval 100").split()
    plan = plan_of(argv)
    # dp = 8 / (tp 2 x pp 2) = 2; micro-batches = 64 / (2 x 2) = 16
    assert plan.data_parallel_size == 2 and plan.num_microbatches == 16
    assert plan.strategy_kwargs == dict(tp=2, pp=2, vp=2, cp=1, ep=1, sequence_parallel=True)
    assert plan.strategy.pipeline_schedule == "interleaved_1f1b" and not plan.strategy.parallel_config.grad_reduce_in_bf16
    assert plan.config == GPTConfig(num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                                    ffn_hidden_size=688, seq_length=512, vocab_size=257, max_position_embeddings=1024,
                                    normalization="RMSNorm", position_embedding_type="rope", rotary_base=500000)
    assert plan.module_kwargs == dict(lr=3e-4, min_lr=3e-5, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.99,
                                      adam_eps=1e-8, lr_warmup_iters=10, lr_decay_iters=900, lr_decay_style="linear")
    t = plan.trainer_kwargs
    assert (t["accelerator"], t["devices"], t["max_steps"]) == ("gpu", 8, 1000) and "precision" not in t
    assert plan.precision_kwargs == dict(precision="bf16-mixed", params_dtype=torch.bfloat16)   # Megatron's bf16
    assert plan.precision.precision == "bf16-mixed" and plan.precision.store_param_remainders
    assert t["accumulate_grad_batches"] == 16
    assert t["val_check_interval"] == 50 * 16  # Lightning counts micro-batches, Megatron optimizer steps
    assert t["gradient_clip_val"] == 0.5 and t["log_every_n_steps"] == 5 and t["enable_checkpointing"]
    assert isinstance(plan.data_module, GPTDataModule)
    d = plan.data_kwargs
    assert d["data_path"] == [str(tmp_path / "a_text_document")]
    assert (d["seq_length"], d["micro_batch_size"], d["global_batch_size"]) == (512, 2, 64)
    assert (d["split"], d["seed"], d["train_iters"], d["eval_iters"], d["data_parallel_size"]) == (
        "98,2,0", 7, 1000, 3, 2)
    assert plan.data_module.num_microbatches == 16
    assert plan.mfu_kwargs == dict(log_every_n_steps=5, peak_flops=None)
    assert plan.checkpoint_kwargs == dict(dirpath=str(tmp_path / "ck"), save_last=True, enable_version_counter=False,
                                          every_n_train_steps=100)
    plan = plan_of(argv + ["--grad-reduce-in-bf16", "--use-distributed-optimizer"])
    assert plan.strategy_kwargs == dict(tp=2, pp=2, vp=2, cp=1, ep=1, sequence_parallel=True,
                                        grad_reduce_in_bf16=True, use_distributed_optimizer=True)
    config = plan.strategy.parallel_config
    assert config.grad_reduce_in_bf16 and config.use_distributed_optimizer


def test_context_parallel_flags_map_onto_the_layout():
    """cp takes its ranks out of dp; per-layer and hierarchical comm types reach the strategy's layout."""
    plan = plan_of(["--devices", "8", "--context-parallel-size", "2", "--cp-comm-type", "all_gather"])
    assert (plan.layout.tp, plan.layout.cp, plan.layout.dp) == (2, 2, 2)  # 8 = tp 2 x cp 2 x dp 2
    assert plan.layout.cp_comm_type == "all_gather" and plan.strategy_kwargs["cp_comm_type"] == "all_gather"
    assert plan.global_batch_size == 16 and plan.num_microbatches == 1  # micro 8 x dp 2
    per_layer = ["p2p", "a2a", "all_gather", "p2p"]
    plan = plan_of(["--tensor-model-parallel-size", "1", "--context-parallel-size", "2", "--cp-comm-type", *per_layer])
    assert plan.layout.cp_comm_type == per_layer and plan.layout.dp == 1
    plan = plan_of(["--devices", "4", "--tensor-model-parallel-size", "1", "--context-parallel-size", "4",
                    "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"])
    assert plan.layout.hierarchical_context_parallel_sizes == [2, 2] and plan.layout.cp_comm_type == "a2a+p2p"
    assert plan.strategy.delay_wgrad_compute  # on by default for the a2a types at tp=1


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "4", "--context-parallel-size", "2", "--seq-length", "100"],
     "seq_length=100 is not divisible by 2*cp*tp (load-balanced CP chunks, each split over tp by SP) = 8"),
    (["--context-parallel-size", "2"], "world size 2 is not divisible by tp*pp*cp = 2*1*2 = 4"),
    (["--tensor-model-parallel-size", "1", "--context-parallel-size", "2", "--cp-comm-type", "a2a", "p2p"],
     "cp_comm_type has 2 entries but the model has num_layers=4"),
    (["--devices", "4", "--tensor-model-parallel-size", "1", "--context-parallel-size", "4", "--cp-comm-type",
      "a2a+p2p"], "cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes"),
])
def test_context_parallel_flag_errors(capsys, argv, needle):
    assert needle in exit_message(argv, capsys)


def test_expert_parallel_flags_map_onto_the_layout():
    """ep is carved out of the dp x cp x tp ranks: edp = world / (etp x ep x pp)."""
    plan = plan_of(["--devices", "4", "--tensor-model-parallel-size", "1", "--num-experts", "4",
                    "--expert-model-parallel-size", "2"])
    assert (plan.layout.ep, plan.layout.etp, plan.layout.dp, plan.layout.edp) == (2, 1, 4, 2)
    assert plan.config.num_moe_experts == 4 and plan.strategy_kwargs["ep"] == 2
    plan = plan_of(["--devices", "4", "--num-experts", "4", "--expert-model-parallel-size", "2"])
    assert (plan.layout.tp, plan.layout.ep, plan.layout.etp, plan.layout.dp, plan.layout.edp) == (2, 2, 2, 2, 1)


def test_delay_wgrad_compute_maps_onto_the_strategy():
    a2a = ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tensor-model-parallel-size", "1"]
    plan = plan_of(a2a + ["--delay-wgrad-compute"])
    assert plan.strategy_kwargs["delay_wgrad_compute"] is True and plan.strategy.delay_wgrad_compute
    default = plan_of(a2a)
    assert "delay_wgrad_compute" not in default.strategy_kwargs and default.strategy.delay_wgrad_compute
    off = plan_of(a2a + ["--no-delay-wgrad-compute"])
    assert off.strategy_kwargs["delay_wgrad_compute"] is False and not off.strategy.delay_wgrad_compute


def test_moe_flags_map_onto_config_and_strategy():
    argv = ("--devices 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
            "--expert-tensor-parallel-size 1 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
            "--moe-grouped-gemm --moe-layer-freq [1,0,1,0] --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
            "--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type allgather "
            "--moe-expert-capacity-factor 1.25 --moe-token-drop-policy position "
            "--moe-shared-expert-intermediate-size 32").split()
    plan = plan_of(argv)
    assert plan.strategy_kwargs == dict(tp=2, pp=1, vp=None, cp=1, ep=2, sequence_parallel=True, etp=1)
    m = plan.config
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_grouped_gemm) == (8, 2, 64, True)
    assert m.moe_layer_freq == [1, 0, 1, 0] and m.moe_router_load_balancing_type == "seq_aux_loss"
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_expert_capacity_factor) == (0.01, 0.001, 1.25)
    assert (m.moe_token_dispatcher_type, m.moe_token_drop_policy) == ("allgather", "position")
    assert m.moe_shared_expert_intermediate_size == 32
    assert m.is_moe_layer(2) and not m.is_moe_layer(1)
    assert (plan.layout.ep, plan.layout.etp, plan.layout.edp) == (2, 1, 2)


@pytest.mark.parametrize("argv,needle", [
    (["--moe-router-topk", "2"], "--moe-router-topk need --num-experts"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4", "--devices", "4",
      "--tensor-model-parallel-size", "1"], "num_moe_experts=6 is not divisible by ep=4"),
    (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "1"], "needs a mixture-of-experts model"),
    (["--expert-model-parallel-size", "2"], "world size 2 is not divisible by etp*ep*pp = 2*2*1 = 4"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "moe_router_topk (5) must be <= num_moe_experts (4)"),
    (["--num-experts", "4", "--no-sequence-parallel"], "a mixture-of-experts model with tp=2 needs sequence_parallel"),
])
def test_moe_flag_errors(capsys, argv, needle):
    assert needle in exit_message(argv, capsys)


def test_shape_defaults_follow_megatron_when_shape_flags_are_given():
    plan = plan_of(["--hidden-size", "256", "--num-attention-heads", "8", "--devices", "1",
                    "--tensor-model-parallel-size", "1"])
    assert plan.config.num_query_groups == 8  # multi-head attention, as Megatron without GQA
    assert plan.config.ffn_hidden_size == int((4 * 256 * 2 / 3) / 64) * 64  # Megatron's SwiGLU default
    assert plan.strategy_kwargs["sequence_parallel"] is False  # default on only when tp > 1
    gqa = ["--num-attention-heads", "8", "--group-query-attention", "--tensor-model-parallel-size", "1"]
    assert plan_of(gqa).config.num_query_groups == 1  # Megatron's --num-query-groups default
    assert plan_of(["--no-swiglu", "--hidden-size", "64"]).config.ffn_hidden_size == 256


@pytest.mark.parametrize("words, expected", [
    (["0.3 a 0.7 b"], [0.3, "a", 0.7, "b"]),
    (["0.3", "a", "0.7", "b"], [0.3, "a", 0.7, "b"]),
    (["1", "out/x_text_document"], [1.0, "out/x_text_document"]),
    (["a"], ["a"]),
    (["a", "b"], ["a", "b"]),
    (["a b"], ["a", "b"]),
])
def test_data_path_forms(words, expected):
    out = parse_data_path_args(words)
    assert out == expected
    prefixes, weights = parse_data_path(out)
    assert prefixes == [x for x in expected if isinstance(x, str)]
    assert (weights is None) == all(isinstance(x, str) for x in expected)


@pytest.mark.parametrize("words", [["0.3", "a", "b"], ["0.3", "a", "0.7"], ["a", "0.5"], ["-1", "a", "2", "b"]])
def test_data_path_malformed(words):
    with pytest.raises(FlagError, match="--data-path"):
        parse_data_path_args(words)


def test_weighted_data_path_through_the_parser():
    plan = plan_of(["--data-path", "0.3", "web", "0.7", "books", "--tokenizer-type", "ByteTokenizer"])
    assert plan.data_kwargs["data_path"] == [0.3, "web", 0.7, "books"]
    assert (plan.data_module.prefixes, plan.data_module.weights) == (["web", "books"], [0.3, 0.7])


@pytest.mark.parametrize("devices, tp, pp, micro, gbs, dp, acc", [
    (2, 2, 1, 8, None, 1, 1),   # default global batch: micro x dp
    (8, 2, 1, 2, 64, 4, 8),
    (8, 2, 2, 2, 64, 2, 16),
    (8, 1, 1, 4, 32, 8, 1),
    (4, 1, 2, 1, 6, 2, 3),
])
def test_global_batch_sets_accumulation_for_the_layout(devices, tp, pp, micro, gbs, dp, acc):
    argv = ["--devices", str(devices), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", str(micro)]
    if gbs is not None:
        argv += ["--global-batch-size", str(gbs)]
    for data in ([], GPT_DATA):
        plan = plan_of(argv + data)
        assert plan.data_parallel_size == dp
        assert plan.trainer_kwargs["accumulate_grad_batches"] == acc
        assert plan.global_batch_size == (gbs if gbs is not None else micro * dp)
        if data:
            assert plan.data_kwargs["global_batch_size"] == plan.global_batch_size
            assert plan.data_kwargs["data_parallel_size"] == dp and plan.data_module.num_microbatches == acc
        else:
            assert plan.trainer_kwargs["limit_val_batches"] == 10 * acc


def test_global_batch_mismatch_is_an_error_naming_the_numbers(capsys):
    argv = ["--devices", "8", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
            "--global-batch-size", "10"]
    with pytest.raises(FlagError, match=r"global_batch_size \(10\).*micro_batch_size \(2\).*\(4\)"):
        plan_of(argv)
    assert "--global-batch-size 10" in exit_message(argv, capsys)


def test_pipeline_needs_enough_microbatches(capsys):
    argv = ["--devices", "2", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--micro-batch-size", "2", "--global-batch-size", "2"]
    err = exit_message(argv, capsys)
    assert "--pipeline-model-parallel-size 2" in err and "'1f1b'" in err and "--global-batch-size >= 4" in err
    assert plan_of(argv + ["--pipeline-schedule", "gpipe"]).num_microbatches == 1  # gpipe runs one


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "3"], "not divisible by tp*pp*cp"),
    (["--num-attention-heads", "6", "--num-query-groups", "3", "--hidden-size", "96"], "num_query_groups=3"),
    (["--seq-length", "63"], "seq_length=63"),
    (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1", "--num-layers", "3",
      "--global-batch-size", "32"], "num_layers=3"),
    (["--virtual-pipeline-model-parallel-size", "2"], "vp=2"),
    (["--tokenizer-type", "ByteTokenizer", "--data-path"], "expected at least one argument"),
    (["--data-path", "x"], "--tokenizer-type"),
    (["--data-path", "x", "--tokenizer-type", "NullTokenizer"], "--vocab-size"),
    (["--data-path", "x", "--tokenizer-type", "ByteTokenizer", "--vocab-size", "100"], "--vocab-size 100"),
    (GPT_DATA + ["--split", "1,2,3,4"], "data: split '1,2,3,4' has 4 parts"),
    (["--tokenizer-type", "ByteTokenizer", "--vocab-size", "512"], "fixed vocabulary of 257"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer needs --data-path"),
    (["--split", "9,1,0"], "--split needs --data-path"),
    (["--reset-attention-mask"], "--reset-attention-mask needs --data-path"),
    (["--mock-data", "--reset-position-ids"], "--reset-position-ids with --mock-data: random tokens have no documents"),
    (["--bf16", "--fp16"], "mutually exclusive"),
    (["--bf16", "--precision", "16-mixed"], "--bf16 means --precision bf16-mixed"),
    (["--fp8-recipe", "tensorwise"], "precision flags: MegatronPrecision(fp8_recipe='tensorwise') sets FP8 options "
                                     "without fp8"),
    (["--fp8-format", "hybrid", "--fp8-backend", "te"], "Transformer Engine runs on CUDA GPUs only"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "fp8_recipe='mxfp8' needs fp8_backend='te'"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"], "does not work with fp8_recipe='delayed'"),
    (["--fp8-format", "e4m3", "--fp8-hybrid"], "--fp8-hybrid contradicts --fp8-format e4m3"),
    (["--fp8-format", "hybrid", "--precision", "bf16-true"], "--precision bf16-true: half-precision weights without "
                                                             "fp32 main parameters"),
    (["--precision", "bf16-true"], "use --precision bf16-mixed (fp32 parameters, bf16 compute) or --bf16 (bf16 "
                                   "parameters with fp32 main parameters"),
    (["--precision", "16-true"], "--precision 16-true: half-precision weights without fp32 main parameters (no "
                                 "Megatron recipe keeps them; MegatronStrategy refuses them); use --fp16"),
    (["--bf16", "--initial-loss-scale", "1024"], "apply to precision='16-mixed' only"),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], "bf16 parameters need precision='bf16-mixed'"),
    (["--precision", "bf16-mixed", "--store-param-remainders"],
     "complete bf16 parameters to their fp32 main parameters"),
    (["--save-interval", "5"], "--save-interval needs --save"),
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt"),
    (["--min-lr", "1.0"], "--min-lr"),
    (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], "not both"),
    (["--train-iters", "0"], "--train-iters must be >= 1"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"], "contradicts"),
    (["--delay-wgrad-compute"], "delay_wgrad_compute=True runs the weight-gradient GEMMs during the a2a"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--tensor-model-parallel-size", "1",
      "--global-batch-size", "16"], "pipeline_schedule='zbv' places two stages per rank in a V: it needs vp=2"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "5"],
     "recompute_num_layers=5 is larger than the model's num_layers (4)"),
    (["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
      "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
     "the layers of each of the pp*vp = 2 pipeline chunks [2, 2] (2)"),
    (["--recompute-granularity", "full"], "recompute_granularity='full' needs recompute_method"),
    (["--recompute-method", "block", "--recompute-num-layers", "1"],
     "they need recompute_granularity='full', got recompute_granularity=None"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "got recompute_granularity='selective'"),
    (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations means"),
    (["--recompute-modules", "mlp"], "recompute_modules=['mlp'] needs recompute_granularity='selective'"),
    (["--recompute-activations", "--recompute-modules", "moe"], "recompute_modules ['moe'] recompute parts of "
                                                                "mixture-of-experts layers, but the model is dense"),
    (["--recompute-activations", "--recompute-modules", "mla_up_proj"], "no multi-latent attention"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: rotary embeddings over part of the head dimension"),
    (GPT_DATA + ["--eod-mask-loss", "--calculate-per-token-loss"], "--calculate-per-token-loss with --eod-mask-loss"),
    (["--train-iters", "5", "--train-samples", "80"], "give --train-iters or --train-samples, not both"),
    (["--lr-warmup-samples", "8"], "--lr-warmup-samples need --train-samples"),
    (["--train-samples", "80", "--lr-decay-iters", "5"], "give --lr-decay-samples (as Megatron)"),
    (["--train-samples", "4"], "--train-samples 4 is less than one global batch (8 samples)"),
    (["--mock-data"] + GPT_DATA, "--mock-data and --data-path: give one"),
    (["--profile-step-start", "3"], "--profile-step-start need --profile"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], "need 0 <= start < end"),
    (["--manual-gc-interval", "5"], "--manual-gc-interval needs --manual-gc"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype needs --use-precision-aware-optimizer"),
    (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3"], "--decoupled-min-lr 0.001 is larger than"),
])
def test_bad_combinations_exit_before_launch(capsys, argv, needle):
    assert needle in exit_message(argv, capsys)


def test_unknown_flags_are_listed(capsys):
    err = exit_message(["--foo", "1", "--no-such-flag"], capsys)
    assert "unrecognized arguments: --foo 1 --no-such-flag" in err
    # no prefix matching (Megatron's parser sets allow_abbrev=False too)
    assert "unrecognized arguments: --hidden" in exit_message(["--hidden", "64"], capsys)


NOT_SUPPORTED = [
    ["--fp8-param-gather"], ["--use-torch-fsdp2"],
]


@pytest.mark.parametrize("argv", NOT_SUPPORTED, ids=lambda a: " ".join(a))
def test_not_supported_flags_are_refused_by_name(capsys, argv):
    err = exit_message(argv, capsys)
    feature = refused_flags(build_parser())[argv[0][2:].replace("-", "_")][1]
    assert f"not supported yet in lightning-megatron: {argv[0]} ({feature})" in err, err


def test_every_refused_flag_is_tested():
    assert {flag for flag, _ in refused_flags(build_parser()).values()} == {a[0] for a in NOT_SUPPORTED}


def test_several_not_supported_flags_are_all_named(capsys):
    err = exit_message(["--fp8-param-gather", "--use-torch-fsdp2"], capsys)
    for flag in ("--fp8-param-gather (FP8 parameters and their all-gather)", "--use-torch-fsdp2 (FSDP2 outside the sharding levels)"):
        assert flag in err


# Megatron flags that change nothing here, with a value each: the plan with the flag equals the plan without it
ACCEPTED = {"--use-mcore-models": [], "--transformer-impl": ["transformer_engine"],
            "--rotary-percent": ["1.0"], "--cross-entropy-loss-fusion": [], "--calculate-per-token-loss": [],
            "--tiktoken-pattern": ["v2"], "--no-create-attention-mask-in-dataloader": [], "--no-mmap-bin-files": [],
            "--apply-layernorm-1p": []}


def test_accepted_flags_change_nothing_and_say_so():
    assert set(ACCEPTED) == {flag for flag, _ in accepted_flags(build_parser()).values()}
    base = plan_of(GPT_DATA)
    for flag, values in ACCEPTED.items():
        plan = plan_of(GPT_DATA + [flag] + values)
        for field in ("config", "strategy_kwargs", "module_kwargs", "data_kwargs", "precision_kwargs",
                      "callback_kwargs", "mfu_kwargs", "checkpoint_kwargs"):
            assert getattr(plan, field) == getattr(base, field), (flag, field)
        assert {k: v for k, v in plan.trainer_kwargs.items()} == base.trainer_kwargs, flag
        assert base.notes == [] and len(plan.notes) == 1 and plan.notes[0].startswith(f"{flag} "), plan.notes
        assert "changes nothing here" in plan.notes[0]


def test_sample_counts_become_iterations_of_the_global_batch():
    """Megatron's sample-based schedule: samples // global batch, for the layout's global batch."""
    plan = plan_of(TP1 + ["--devices", "2", "--micro-batch-size", "2", "--global-batch-size", "12",
                          "--train-samples", "1000", "--lr-warmup-samples", "100", "--lr-decay-samples", "900"])
    assert plan.global_batch_size == 12 and plan.num_microbatches == 3
    assert plan.trainer_kwargs["max_steps"] == 83
    assert (plan.module_kwargs["lr_warmup_iters"], plan.module_kwargs["lr_decay_iters"]) == (8, 75)
    frac = plan_of(["--train-samples", "800", "--lr-warmup-fraction", "0.25", "--lr-decay-samples", "400"])
    assert frac.module_kwargs["lr_warmup_iters"] == 12   # a quarter of the 50 decay iterations


def test_tensorboard_dir_logs_with_tensorboard_or_says_it_writes_csv(monkeypatch, tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    from lightning_utilities.core.imports import RequirementCache

    import lightning_megatron.cli.plan as plan_module

    plan = plan_of(["--tensorboard-dir", str(tmp_path)])
    assert isinstance(plan.trainer_kwargs["logger"], TensorBoardLogger) and plan.notes == []
    assert Path(plan.trainer_kwargs["logger"].log_dir) == tmp_path   # events directly in the directory, as Megatron
    assert plan.callback_kwargs["LossCurve"] == {"path": str(tmp_path / "loss_curve")}
    monkeypatch.setattr(plan_module, "TENSORBOARD", RequirementCache("tensorboard-not-installed-here"))
    plan = plan_of(["--tensorboard-dir", str(tmp_path)])
    assert isinstance(plan.trainer_kwargs["logger"], CSVLogger)
    assert len(plan.notes) == 1 and "tensorboard is not installed" in plan.notes[0] and "metrics.csv" in plan.notes[0]


def test_precision_tokenizers_and_load(tmp_path):
    # --bf16 is Megatron's bf16: bf16 parameters, fp32 main parameters as remainders (the default), fp32 gradients
    bf16 = plan_of(["--bf16"])
    assert bf16.precision_kwargs == dict(precision="bf16-mixed", params_dtype=torch.bfloat16)
    assert bf16.precision.params_dtype == torch.bfloat16 and bf16.precision.store_param_remainders
    assert not plan_of(["--bf16", "--no-store-param-remainders"]).precision.store_param_remainders
    assert plan_of(["--fp16"]).precision.scaler is None and plan_of(["--fp16"]).precision.precision == "16-mixed"
    assert plan_of(["--precision", "bf16-mixed"]).trainer_kwargs["precision"] == "bf16-mixed"   # Lightning's own
    fp8 = plan_of(["--bf16", "--fp8-format", "hybrid"])
    assert isinstance(fp8.precision, MegatronPrecision) and "precision" not in fp8.trainer_kwargs
    assert (fp8.precision.fp8, fp8.precision.fp8_config.recipe) == ("hybrid", "delayed")
    byte = plan_of(["--tokenizer-type", "ByteTokenizer"])
    assert byte.data_kwargs["tokenizer"] == "byte" and byte.config.vocab_size == 257
    null = plan_of(["--data-path", "x", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--eod-mask-loss"])
    assert null.config.vocab_size == 1001 and null.data_kwargs["eod_id"] == 1000 and null.data_kwargs["eod_mask_loss"]
    assert plan_of(GPT_DATA + ["--vocab-size", "512"]).config.vocab_size == 512
    assert plan_of(["--clip-grad", "0"]).trainer_kwargs["gradient_clip_val"] is None
    assert plan_of(["--peak-tflops", "2.5"]).mfu_kwargs == dict(log_every_n_steps=10, peak_flops=2.5e12)
    assert plan_of(["--lr-warmup-fraction", "0.1", "--train-iters", "50"]).module_kwargs["lr_warmup_iters"] == 5
    # --load: a directory resumes from its last.ckpt; one without starts fresh (as Megatron); a file as is
    empty = plan_of(["--load", str(tmp_path)])
    assert empty.resume is None and "starting from scratch" in empty.notes[0]
    (tmp_path / "last.ckpt").write_bytes(b"x")
    with pytest.raises(FlagError, match=r"last.ckpt is not a readable checkpoint \("):
        plan_of(["--load", str(tmp_path)])
    torch.save({"state_dict": {}, "optimizer_states": [], "loops": {}, "pytorch-lightning_version": "2.6.0"},
               tmp_path / "last.ckpt")
    assert plan_of(["--load", str(tmp_path)]).resume == str(tmp_path / "last.ckpt")
    assert plan_of(["--load", str(tmp_path / "last.ckpt")]).resume == str(tmp_path / "last.ckpt")
    # a file of weights only (python -m lightning_megatron.hf import): started from, at iteration 0; its config must
    # give the weights the flags' shapes, and other model differences are noted
    weights = tmp_path / "weights.ckpt"
    tiny = plan_of([]).config
    for saved, error, note in ((tiny, None, None),
                               (tiny.replace(num_layers=2), "num_layers=2 (here 4) [--num-layers]", None),
                               (tiny.replace(norm_epsilon=1e-6, seq_length=64), None,
                                "norm_epsilon=1e-06 (here 1e-05) [--norm-epsilon]")):
        torch.save({"state_dict": {}, "hyper_parameters": {"config": saved.to_dict()}}, weights)
        if error is not None:
            with pytest.raises(FlagError, match="the checkpoint's model has other weights than the flags' model") as e:
                plan_of(["--load", str(weights)])
            assert error in str(e.value), str(e.value)
            continue
        plan = plan_of(["--load", str(weights)])
        assert plan.resume is None and plan.callback_kwargs["CheckpointWeights"] == dict(path=str(weights))
        assert isinstance(plan.build_callbacks()[0], CheckpointWeights)
        assert "training starts from these weights at iteration 0 with a fresh optimizer" in plan.notes[-1]
        assert (note is None) == (len(plan.notes) == 1) and (note is None or note in plan.notes[0]), plan.notes
    torch.save({"hyper_parameters": {}}, weights)
    with pytest.raises(FlagError, match="weights.ckpt holds no state_dict"):
        plan_of(["--load", str(weights)])


# ---------------------------------------------------------------------------------------------- every flag lands
TARGET_OWNERS = {  # "Class" of a "Class.argument" target -> the callable whose argument it is
    "GPTConfig": GPTConfig, "MegatronStrategy": MegatronStrategy, "ParallelGPTModule": ParallelGPTModule,
    "Trainer": pl.Trainer, "TinyCorpusDataModule": TinyCorpusDataModule, "GPTDataModule": GPTDataModule,
    "MFUMonitor": MFUMonitor, "ModelCheckpoint": ModelCheckpoint, "seed_everything": pl.seed_everything,
    "MegatronPrecision": MegatronPrecision,
    "Trainer.fit": pl.Trainer.fit,
    "MockGPTDataModule": MockGPTDataModule, "TensorBoardLogger": TensorBoardLogger, "Timer": Timer,
    "StepProfiler": StepProfiler, "MemoryHousekeeping": MemoryHousekeeping, "LossCurve": LossCurve,
    "CheckpointWeights": CheckpointWeights,
}


def value_at(plan, target):
    """The value ``plan`` gives the ``Class.argument`` target (None where the plan leaves it out)."""
    if target == "Trainer.fit.ckpt_path":
        return plan.resume
    if target == "seed_everything.seed":
        return plan.seed
    owner, _, name = target.partition(".")
    source = {
        "GPTConfig": dataclasses.asdict(plan.config), "MegatronStrategy": plan.strategy_kwargs,
        "ParallelGPTModule": plan.module_kwargs, "Trainer": plan.trainer_kwargs, "MFUMonitor": plan.mfu_kwargs,
        "ModelCheckpoint": plan.checkpoint_kwargs, "MegatronPrecision": plan.precision_kwargs,
        "TinyCorpusDataModule": plan.data_kwargs if isinstance(plan.data_module, TinyCorpusDataModule) else None,
        "GPTDataModule": plan.data_kwargs if isinstance(plan.data_module, GPTDataModule) else None,
        "MockGPTDataModule": plan.data_kwargs if isinstance(plan.data_module, MockGPTDataModule) else None,
        "TensorBoardLogger": plan.logger_kwargs,
    }.get(owner, plan.callback_kwargs.get(owner))   # the run-control callbacks: their kwargs, or None
    if not name:
        return source
    return None if source is None else source.get(name)


TP1 = ["--tensor-model-parallel-size", "1"]
PP2 = TP1 + ["--global-batch-size", "16"]  # with --pipeline-model-parallel-size 2: 2 micro-batches
MOE = ["--num-experts", "4"]
EOD = ["--data-path", "x", "--eod-mask-loss", "--tokenizer-type", "ByteTokenizer"]
RECOMPUTE_FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
FP8 = ["--bf16", "--fp8-format", "hybrid"]
FP8_CS = FP8 + ["--fp8-recipe", "tensorwise"]
# (context, argv, {target: value}), the flag under test being argv[0]: added to the context, it must give each
# target that value, which must differ from the context's alone (a parsed flag whose value goes nowhere fails)
CASES = [
    ([], ["--tensor-model-parallel-size", "1"], {"MegatronStrategy.tp": 1}),
    (PP2, ["--pipeline-model-parallel-size", "2"], {"MegatronStrategy.pp": 2}),
    (PP2 + ["--pipeline-model-parallel-size", "2"], ["--virtual-pipeline-model-parallel-size", "2"],
     {"MegatronStrategy.vp": 2}),
    (PP2 + ["--pipeline-model-parallel-size", "2"], ["--pipeline-schedule", "gpipe"],
     {"MegatronStrategy.pipeline_schedule": "gpipe"}),
    (PP2 + ["--pipeline-model-parallel-size", "2"], ["--decoder-first-pipeline-num-layers", "1"],
     {"MegatronStrategy.num_layers_in_first_pipeline_stage": 1}),
    (PP2 + ["--pipeline-model-parallel-size", "2"], ["--decoder-last-pipeline-num-layers", "3"],
     {"MegatronStrategy.num_layers_in_last_pipeline_stage": 3}),
    (TP1, ["--context-parallel-size", "2"], {"MegatronStrategy.cp": 2}),
    (TP1 + ["--context-parallel-size", "2"], ["--cp-comm-type", "a2a"], {"MegatronStrategy.cp_comm_type": "a2a"}),
    (TP1 + ["--devices", "4", "--context-parallel-size", "4"],
     ["--hierarchical-context-parallel-sizes", "2", "2", "--cp-comm-type", "a2a+p2p"],
     {"MegatronStrategy.hierarchical_context_parallel_sizes": [2, 2]}),
    (TP1 + MOE, ["--expert-model-parallel-size", "2"], {"MegatronStrategy.ep": 2}),
    (MOE, ["--expert-tensor-parallel-size", "1"], {"MegatronStrategy.etp": 1}),
    ([], ["--no-sequence-parallel"], {"MegatronStrategy.sequence_parallel": False}),
    ([], ["--use-distributed-optimizer"], {"MegatronStrategy.use_distributed_optimizer": True}),
    ([], ["--use-custom-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
     {"MegatronStrategy.data_parallel_sharding_strategy": "optim_grads"}),
    (["--use-custom-fsdp"], ["--data-parallel-sharding-strategy", "optim_grads_params"],
     {"MegatronStrategy.data_parallel_sharding_strategy": "optim_grads_params"}),
    (TP1 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], ["--no-delay-wgrad-compute"],
     {"MegatronStrategy.delay_wgrad_compute": False}),
    ([], ["--grad-reduce-in-bf16"], {"MegatronStrategy.grad_reduce_in_bf16": True}),
    ([], ["--no-overlap-grad-reduce"], {"MegatronStrategy.overlap_grad_reduce": False}),
    ([], ["--ddp-bucket-size", "1000000"], {"MegatronStrategy.bucket_size": 1000000}),
    (["--use-distributed-optimizer"], ["--overlap-param-gather"], {"MegatronStrategy.overlap_param_gather": True}),
    ([], ["--exit-signal-handler"], {"MegatronStrategy.exit_signal_handler": True}),
    ([], ["--tp-comm-overlap"], {"MegatronStrategy.tp_comm_overlap": True}),
    ([], ["--compile"], {"MegatronStrategy.compile": True}),
    (["--compile"], ["--enable-cuda-graph"], {"MegatronStrategy.enable_cuda_graph": True}),
    ([], ["--no-check-for-nan-in-loss-and-grad"], {"MegatronStrategy.check_for_nan_in_loss_and_grad": False}),
    ([], ["--ckpt-format", "torch_dist"], {"MegatronStrategy.ckpt_format": "torch_dist"}),
    (["--ckpt-format", "torch_dist"], ["--async-save"], {"MegatronStrategy.async_save": True}),
    ([], ["--distributed-timeout-minutes", "5"], {"MegatronStrategy.distributed_timeout_minutes": 5.0}),
    ([], ["--recompute-activations"], {"MegatronStrategy.recompute_granularity": "selective"}),
    ([], ["--recompute-granularity", "selective"], {"MegatronStrategy.recompute_granularity": "selective"}),
    (RECOMPUTE_FULL, ["--recompute-method", "block"], {"MegatronStrategy.recompute_method": "block"}),
    (RECOMPUTE_FULL, ["--recompute-num-layers", "1"], {"MegatronStrategy.recompute_num_layers": 1}),
    (["--recompute-activations"], ["--recompute-modules", "core_attn", "mlp", "layernorm"],
     {"MegatronStrategy.recompute_modules": ["core_attn", "mlp", "layernorm"]}),
    ([], ["--accelerator", "gpu"], {"Trainer.accelerator": "gpu"}),
    ([], ["--devices", "4"], {"Trainer.devices": 4}),
    ([], ["--num-nodes", "2"], {"Trainer.num_nodes": 2}),
    # model
    ([], ["--num-layers", "2"], {"GPTConfig.num_layers": 2}),
    ([], ["--hidden-size", "64"], {"GPTConfig.hidden_size": 64}),
    ([], ["--num-attention-heads", "8"], {"GPTConfig.num_attention_heads": 8}),
    (TP1 + ["--num-attention-heads", "8"], ["--group-query-attention"], {"GPTConfig.num_query_groups": 1}),
    ([], ["--num-query-groups", "4"], {"GPTConfig.num_query_groups": 4}),
    ([], ["--ffn-hidden-size", "256"], {"GPTConfig.ffn_hidden_size": 256}),
    ([], ["--kv-channels", "16"], {"GPTConfig.kv_channels": 16}),
    ([], ["--seq-length", "64"], {"GPTConfig.seq_length": 64, "TinyCorpusDataModule.seq_length": 64}),
    (GPT_DATA, ["--seq-length", "64"], {"GPTDataModule.seq_length": 64}),
    ([], ["--max-position-embeddings", "256"], {"GPTConfig.max_position_embeddings": 256}),
    ([], ["--vocab-size", "1000"], {"GPTConfig.vocab_size": 1000, "TinyCorpusDataModule.vocab_size": 1000}),
    ([], ["--make-vocab-size-divisible-by", "64"], {"GPTConfig.make_vocab_size_divisible_by": 64}),
    ([], ["--normalization", "LayerNorm"], {"GPTConfig.normalization": "LayerNorm"}),
    ([], ["--norm-epsilon", "1e-6"], {"GPTConfig.norm_epsilon": 1e-6}),
    ([], ["--position-embedding-type", "learned_absolute"], {"GPTConfig.position_embedding_type": "learned_absolute"}),
    ([], ["--use-rotary-position-embeddings"], {"GPTConfig.position_embedding_type": "rope"}),
    ([], ["--rotary-base", "500000"], {"GPTConfig.rotary_base": 500000}),
    ([], ["--use-rope-scaling"], {"GPTConfig.rope_scaling": True}),
    (["--use-rope-scaling"], ["--rope-scaling-factor", "4"], {"GPTConfig.rope_scaling_factor": 4.0}),
    ([], ["--no-swiglu"], {"GPTConfig.swiglu": False}),
    ([], ["--disable-bias-linear"], {"GPTConfig.add_bias_linear": False}),
    ([], ["--untie-embeddings-and-output-weights"], {"GPTConfig.untie_embeddings_and_output_weights": True}),
    ([], ["--init-method-std", "0.01"], {"GPTConfig.init_method_std": 0.01}),
    ([], ["--hidden-dropout", "0.1"], {"GPTConfig.hidden_dropout": 0.1}),
    ([], ["--attention-dropout", "0.1"], {"GPTConfig.attention_dropout": 0.1}),
    ([], ["--attention-backend", "flash"], {"GPTConfig.attention_backend": "flash"}),
    # training
    ([], ["--micro-batch-size", "4"], {"TinyCorpusDataModule.micro_batch_size": 4}),
    (GPT_DATA, ["--micro-batch-size", "4"], {"GPTDataModule.micro_batch_size": 4}),
    ([], ["--global-batch-size", "32"], {"Trainer.accumulate_grad_batches": 4}),
    (GPT_DATA, ["--global-batch-size", "32"], {"GPTDataModule.global_batch_size": 32}),
    ([], ["--train-iters", "50"], {"Trainer.max_steps": 50}),
    ([], ["--train-samples", "800"], {"Trainer.max_steps": 100}),   # global batch 8
    (GPT_DATA, ["--train-samples", "800"], {"GPTDataModule.train_iters": 100}),
    (["--train-samples", "800"], ["--lr-warmup-samples", "87"], {"ParallelGPTModule.lr_warmup_iters": 10}),
    (["--train-samples", "800"], ["--lr-decay-samples", "400"], {"ParallelGPTModule.lr_decay_iters": 50}),
    (GPT_DATA, ["--train-iters", "50"], {"GPTDataModule.train_iters": 50}),
    ([], ["--lr", "1e-3"], {"ParallelGPTModule.lr": 1e-3}),
    ([], ["--min-lr", "1e-4"], {"ParallelGPTModule.min_lr": 1e-4}),
    ([], ["--lr-warmup-iters", "5"], {"ParallelGPTModule.lr_warmup_iters": 5}),
    ([], ["--lr-warmup-fraction", "0.1"], {"ParallelGPTModule.lr_warmup_iters": 40}),
    ([], ["--lr-decay-iters", "300"], {"ParallelGPTModule.lr_decay_iters": 300}),
    ([], ["--lr-decay-style", "linear"], {"ParallelGPTModule.lr_decay_style": "linear"}),
    ([], ["--decoupled-lr", "5e-3"], {"ParallelGPTModule.decoupled_lr": 5e-3}),
    (["--decoupled-lr", "5e-3"], ["--decoupled-min-lr", "5e-4"], {"ParallelGPTModule.decoupled_min_lr": 5e-4}),
    ([], ["--weight-decay", "0.01"], {"ParallelGPTModule.weight_decay": 0.01}),
    ([], ["--adam-beta1", "0.8"], {"ParallelGPTModule.adam_beta1": 0.8}),
    ([], ["--adam-beta2", "0.99"], {"ParallelGPTModule.adam_beta2": 0.99}),
    ([], ["--adam-eps", "1e-6"], {"ParallelGPTModule.adam_eps": 1e-6}),
    ([], ["--use-precision-aware-optimizer"],
     {"ParallelGPTModule.exp_avg_dtype": "fp32", "ParallelGPTModule.exp_avg_sq_dtype": "fp32"}),
    (["--use-precision-aware-optimizer"], ["--exp-avg-dtype", "bf16"], {"ParallelGPTModule.exp_avg_dtype": "bf16"}),
    (["--use-precision-aware-optimizer"], ["--exp-avg-sq-dtype", "bf16"],
     {"ParallelGPTModule.exp_avg_sq_dtype": "bf16"}),
    ([], ["--clip-grad", "0.5"], {"Trainer.gradient_clip_val": 0.5}),
    ([], ["--seed", "7"], {"seed_everything.seed": 7}),
    (GPT_DATA, ["--seed", "7"], {"GPTDataModule.seed": 7}),
    ([], ["--bf16"], {"MegatronPrecision.precision": "bf16-mixed", "MegatronPrecision.params_dtype": torch.bfloat16}),
    ([], ["--fp16"], {"MegatronPrecision.precision": "16-mixed"}),
    ([], ["--precision", "64-true"], {"Trainer.precision": "64-true"}),
    (["--fp8-format", "hybrid"], ["--precision", "bf16-mixed"], {"MegatronPrecision.precision": "bf16-mixed"}),
    (["--fp16"], ["--initial-loss-scale", "1024"], {"MegatronPrecision.initial_loss_scale": 1024.0}),
    (["--fp16"], ["--loss-scale-window", "100"], {"MegatronPrecision.loss_scale_window": 100}),
    ([], ["--fp8-format", "e4m3"], {"MegatronPrecision.fp8": "e4m3"}),
    ([], ["--fp8-hybrid"], {"MegatronPrecision.fp8": "hybrid"}),
    (FP8, ["--fp8-recipe", "tensorwise"], {"MegatronPrecision.fp8_recipe": "tensorwise"}),
    (FP8, ["--fp8-margin", "1"], {"MegatronPrecision.fp8_margin": 1}),
    (FP8, ["--fp8-amax-history-len", "16"], {"MegatronPrecision.fp8_amax_history_len": 16}),
    (FP8, ["--fp8-amax-compute-algo", "max"], {"MegatronPrecision.fp8_amax_compute_algo": "max"}),
    (FP8, ["--fp8-backend", "torch"], {"MegatronPrecision.fp8_backend": "torch"}),
    (FP8_CS, ["--first-last-layers-bf16"], {"MegatronPrecision.first_last_layers_bf16": True}),
    (["--precision", "bf16-mixed"], ["--accumulate-allreduce-grads-in-fp32"],
     {"MegatronPrecision.params_dtype": torch.bfloat16}),
    (["--bf16"], ["--no-store-param-remainders"], {"MegatronPrecision.store_param_remainders": False}),
    (FP8_CS + ["--first-last-layers-bf16"], ["--num-layers-at-start-in-bf16", "2"],
     {"MegatronPrecision.num_layers_at_start_in_bf16": 2}),
    (FP8_CS + ["--first-last-layers-bf16"], ["--num-layers-at-end-in-bf16", "0"],
     {"MegatronPrecision.num_layers_at_end_in_bf16": 0}),
    ([], ["--eval-interval", "50"], {"Trainer.val_check_interval": 50}),
    ([], ["--eval-iters", "3"], {"Trainer.limit_val_batches": 3}),
    (GPT_DATA, ["--eval-iters", "3"], {"GPTDataModule.eval_iters": 3}),
    ([], ["--log-interval", "5"], {"Trainer.log_every_n_steps": 5}),
    (["--log-throughput"], ["--log-interval", "5"], {"MFUMonitor.log_every_n_steps": 5}),
    ([], ["--log-throughput"], {"MFUMonitor": dict(log_every_n_steps=10, peak_flops=None)}),
    ([], ["--peak-tflops", "2.5"], {"MFUMonitor.peak_flops": 2.5e12}),
    # data
    (["--tokenizer-type", "ByteTokenizer"], ["--data-path", "x"], {"GPTDataModule.data_path": ["x"]}),
    (GPT_DATA, ["--split", "98,2,0"], {"GPTDataModule.split": "98,2,0"}),
    ([], ["--tokenizer-type", "ByteTokenizer"], {"TinyCorpusDataModule.tokenizer": "byte", "GPTConfig.vocab_size": 257}),
    (EOD, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"],
     {"GPTConfig.vocab_size": 1001, "GPTDataModule.eod_id": 1000}),
    ([], ["--data-cache-path", "/tmp/c"], {"TinyCorpusDataModule.cache_dir": "/tmp/c"}),
    (GPT_DATA, ["--data-cache-path", "/tmp/c"], {"GPTDataModule.cache_dir": "/tmp/c"}),
    (GPT_DATA, ["--eod-mask-loss"], {"GPTDataModule.eod_mask_loss": True, "GPTDataModule.eod_id": 256}),
    (GPT_DATA, ["--reset-position-ids"], {"GPTDataModule.reset_position_ids": True, "GPTDataModule.eod_id": 256}),
    (GPT_DATA, ["--reset-attention-mask"], {"GPTDataModule.reset_attention_mask": True,
                                            "GPTDataModule.eod_id": 256}),
    ([], ["--num-workers", "3"], {"TinyCorpusDataModule.num_workers": 3}),
    (GPT_DATA, ["--num-workers", "3"], {"GPTDataModule.num_workers": 3}),
    ([], ["--mock-data"], {"MockGPTDataModule": dict(vocab_size=2048, seq_length=128, micro_batch_size=8,
                                                     num_train_samples=400 * 8, num_val_samples=10 * 8, seed=1234,
                                                     num_workers=0)}),
    # run control
    ([], ["--tensorboard-dir", "/tmp/tb"], {"TensorBoardLogger.save_dir": "/tmp/tb"}),
    ([], ["--exit-duration-in-mins", "5"], {"Timer.duration": {"minutes": 5.0}}),
    ([], ["--profile"], {"StepProfiler": dict(start_step=10, end_step=12, ranks=[0], output_dir="profile")}),
    (["--profile"], ["--profile-step-start", "3"], {"StepProfiler.start_step": 3}),
    (["--profile"], ["--profile-step-end", "20"], {"StepProfiler.end_step": 20}),
    (["--profile"], ["--profile-ranks", "0", "1"], {"StepProfiler.ranks": [0, 1]}),
    ([], ["--manual-gc"], {"MemoryHousekeeping.manual_gc": True}),
    (["--manual-gc"], ["--manual-gc-interval", "10"], {"MemoryHousekeeping.gc_interval": 10}),
    ([], ["--empty-unused-memory-level", "2"], {"MemoryHousekeeping.empty_unused_memory_level": 2}),
    ([], ["--loss-curve", "/tmp/lc"], {"LossCurve.path": "/tmp/lc"}),
    # checkpoints
    ([], ["--save", "/tmp/ck"], {"ModelCheckpoint.dirpath": "/tmp/ck", "Trainer.enable_checkpointing": True}),
    (["--save", "/tmp/ck"], ["--save-interval", "5"], {"ModelCheckpoint.every_n_train_steps": 5}),
    # mixture of experts
    ([], MOE, {"GPTConfig.num_moe_experts": 4}),
    (MOE, ["--moe-grouped-gemm"], {"GPTConfig.moe_grouped_gemm": True}),
    (MOE, ["--moe-router-topk", "3"], {"GPTConfig.moe_router_topk": 3}),
    (MOE, ["--moe-ffn-hidden-size", "64"], {"GPTConfig.moe_ffn_hidden_size": 64}),
    (MOE, ["--moe-layer-freq", "2"], {"GPTConfig.moe_layer_freq": 2}),
    (MOE, ["--moe-router-score-function", "sigmoid"], {"GPTConfig.moe_router_score_function": "sigmoid"}),
    (MOE, ["--moe-router-pre-softmax"], {"GPTConfig.moe_router_pre_softmax": True}),
    (MOE, ["--moe-router-load-balancing-type", "seq_aux_loss"],
     {"GPTConfig.moe_router_load_balancing_type": "seq_aux_loss"}),
    (MOE, ["--moe-aux-loss-coeff", "0.01"], {"GPTConfig.moe_aux_loss_coeff": 0.01}),
    (MOE, ["--moe-z-loss-coeff", "0.001"], {"GPTConfig.moe_z_loss_coeff": 0.001}),
    (MOE + ["--moe-router-score-function", "sigmoid"], ["--moe-router-enable-expert-bias"],
     {"GPTConfig.moe_router_enable_expert_bias": True}),
    (MOE, ["--moe-router-bias-update-rate", "0.01"], {"GPTConfig.moe_router_bias_update_rate": 0.01}),
    (MOE, ["--moe-expert-capacity-factor", "1.5"], {"GPTConfig.moe_expert_capacity_factor": 1.5}),
    (MOE, ["--moe-token-drop-policy", "position"], {"GPTConfig.moe_token_drop_policy": "position"}),
    (MOE, ["--moe-shared-expert-intermediate-size", "64"], {"GPTConfig.moe_shared_expert_intermediate_size": 64}),
    (MOE, ["--moe-token-dispatcher-type", "allgather"], {"GPTConfig.moe_token_dispatcher_type": "allgather"}),
]
# LLaMA-style defaults that Megatron's flags only confirm: they cannot change the plan, only set its value
CONFIRMS_THE_DEFAULT = {"--disable-bias-linear", "--untie-embeddings-and-output-weights",
                        "--use-rotary-position-embeddings"}


def test_every_flag_target_is_a_real_argument():
    """Each flag's ``Class.argument`` targets name a real constructor argument / field / parameter."""
    targets = flag_targets(build_parser())
    assert len(targets) > 80
    for flag, names in targets.items():
        for target in names:
            owner, _, name = target.rpartition(".") if target.count(".") else (target, "", "")
            assert owner in TARGET_OWNERS, (flag, target)
            if name:
                params = set(inspect.signature(TARGET_OWNERS[owner]).parameters)
                if owner == "MegatronStrategy":   # its **options are the ParallelConfig fields
                    params |= set(LAYOUT_OPTIONS)
                assert name in params, f"{flag} -> {target}: {owner} has no argument {name!r}"


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    text = (ROOT / "lightning_megatron" / "data" / "corpus" / "ch01.txt").read_text(encoding="utf-8")
    return train_sentencepiece([text], str(tmp_path_factory.mktemp("spm") / "spm"), vocab_size=512)


def test_every_flag_sets_its_targets(tmp_path, spm_model):
    """Every flag of the parser (refused ones aside) sets each of its targets to the value it was given; the
    table covers every (flag, target) pair the parser declares, so a new flag needs a case here."""
    torch.save({"state_dict": {}, "optimizer_states": [], "loops": {}, "pytorch-lightning_version": "2.6.0"},
               tmp_path / "last.ckpt")   # a training checkpoint: resumed from
    torch.save({"state_dict": {}, "hyper_parameters": {"config": GPTConfig(**TINY).to_dict()}},
               tmp_path / "weights.ckpt")   # weights only (python -m lightning_megatron.hf import): started from
    cases = CASES + [
        ([], ["--load", str(tmp_path)], {"Trainer.fit.ckpt_path": str(tmp_path / "last.ckpt")}),
        ([], ["--load", str(tmp_path / "weights.ckpt")], {"CheckpointWeights.path": str(tmp_path / "weights.ckpt")}),
        # no context without a tokenizer model is valid: only the values are checked
        (None, ["--tokenizer-model", spm_model, "--data-path", "x", "--tokenizer-type", "SentencePieceTokenizer",
                "--eod-mask-loss"], {"GPTConfig.vocab_size": 512, "GPTDataModule.eod_id": 2}),
    ]
    parser = build_parser()
    covered = set()
    for context, argv, expected in cases:
        flag = parser._option_string_actions[argv[0]].option_strings[0]  # --no-swiglu is --swiglu's
        plan = plan_from_args(parser.parse_args((context or []) + argv))
        base = plan_from_args(parser.parse_args(context)) if context is not None else None
        for target, value in expected.items():
            assert value_at(plan, target) == value, (argv, target, value_at(plan, target))
            if base is not None and flag not in CONFIRMS_THE_DEFAULT:
                assert value_at(base, target) != value, (argv, target, "the context alone has this value")
            covered.add((flag, target))
    declared = {(flag, target) for flag, names in flag_targets(parser).items() for target in names}
    assert declared - covered == set(), "flags / targets without a case in CASES"
    assert covered - declared == set(), "cases checking a target the flag does not declare"


def help_entries(text):
    """``{"--flag": its help entry}`` of an argparse ``--help`` text (entries start with two spaces and a dash)."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current is not None and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def test_help_lists_every_flag_with_its_target(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exc:
        parse_pretrain_args(["--help"], description="Pretrain something.")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ") and "Pretrain something." in text
    assert " ".join(FLAG_MAPPING.split()) in " ".join(text.split()) and "docs/data.md" in text
    entries = help_entries(text)
    refused = {flag: feature for flag, feature in refused_flags(build_parser()).values()}
    accepted = {flag: reason for flag, reason in accepted_flags(build_parser()).values()}
    targets = flag_targets(build_parser())
    assert set(entries) == set(targets) | {"-h"}
    for flag, names in targets.items():
        if flag in refused:
            assert entries[flag].endswith(f"refused: {refused[flag]} has not landed"), entries[flag]
        elif flag in accepted:
            assert entries[flag].endswith(f"accepted, changes nothing: {' '.join(accepted[flag].split())}"), \
                entries[flag]
        else:
            assert entries[flag].endswith("-> " + ", ".join(names)), entries[flag]


# ---------------------------------------------------------------------------------------------- end to end
def _run(cmd, tmp_path, timeout=240):
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")  # the data cache: ~/.cache
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return log


def _done(log):
    match = re.search(r"^done: (\{.*\})$", log, re.M)
    assert match, log[-3000:]
    return ast.literal_eval(match.group(1))


def _iterations(log):
    """``{step: {key: value}}`` of the Megatron-style log lines."""
    out = {}
    for line in log.replace("\r", "\n").splitlines():
        if "iteration " in line:
            parts = line[line.index("iteration"):].split(" | ")
            step = int(parts[0].split()[1].split("/")[0])
            out[step] = {p.rsplit(" ", 1)[0]: float(p.rsplit(" ", 1)[1]) for p in parts[1:]}
    return out


# The e2e model: 2 layers, hidden h=32, 4 heads of d=8 (q=32), 2 query groups (kv=16), SwiGLU ffn f=64 (Megatron's
# default for h=32), seq s=64, vocabulary 257 bytes padded to V=384. Megatron's formula, per token, causal:
# 6 * [L*(h*(q+2kv) + q*h) + L*s*q + L*3*h*f + h*V] = 6 * (6144 + 4096 + 12288 + 12288)
E2E_FLOPS_PER_TOKEN = 6 * (2 * (32 * (32 + 2 * 16) + 32 * 32) + 2 * 64 * 32 + 2 * 3 * 32 * 64 + 32 * 384)
MFU_KEYS = ("step_time", "tokens_per_sec", "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu")


def check_throughput(metrics, world=2, tokens_per_step=4 * 64, peak_tflops=1.0, rel=1e-9):
    """The logged throughput is self-consistent: tokens per step x steps per second = tokens per second, and the
    TFLOP/s per device and MFU follow from tokens/s and the FLOPs formula."""
    tps = metrics["tokens_per_sec"]
    assert 0 < tps < 1e7 and math.isfinite(tps), metrics
    assert metrics["step_time"] * tps == pytest.approx(tokens_per_step, rel=rel)
    assert metrics["tokens_per_sec_per_gpu"] == pytest.approx(tps / world, rel=rel)
    assert metrics["tflops_per_gpu"] == pytest.approx(tps * E2E_FLOPS_PER_TOKEN / world / 1e12, rel=rel)
    assert metrics["mfu"] == pytest.approx(metrics["tflops_per_gpu"] / peak_tflops, rel=rel)


def test_end_to_end_on_a_preprocessed_dataset_tp2_with_mfu_and_resume(tmp_path):
    from lightning_megatron import flops_per_token

    assert flops_per_token(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                     ffn_hidden_size=64, seq_length=64, vocab_size=257)) == E2E_FLOPS_PER_TOKEN
    corpus = (ROOT / "lightning_megatron" / "data" / "corpus" / "ch01.txt").read_text(encoding="utf-8")
    docs = [p.strip() for p in corpus.split("\n\n") if len(p.strip()) > 40][:60]
    assert len(docs) >= 40
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    _run([sys.executable, "-m", "lightning_megatron.data.preprocess", "--input", str(jsonl), "--output-prefix",
          str(tmp_path / "data" / "train"), "--tokenizer-type", "ByteTokenizer", "--append-eod", "--quiet"], tmp_path)
    prefix = tmp_path / "data" / "train_text_document"
    assert prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()

    ckpt = tmp_path / "ckpt"
    args = [sys.executable, "examples/pretrain_gpt.py", "--data-path", str(prefix), "--split", "90,10,0",
            "--tokenizer-type", "ByteTokenizer", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "64", "--devices", "2",
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "6", "--eval-interval", "6",
            "--eval-iters", "1", "--peak-tflops", "1", "--log-interval", "1", "--save", str(ckpt),
            "--save-interval", "4"]
    log = _run(args, tmp_path)
    assert "global batch 4 = micro 2 x dp 1 x 2 micro-batches" in log, log[-3000:]
    lines = _iterations(log)
    assert sorted(lines) == [1, 2, 3, 4, 5, 6], lines
    for step, metrics in lines.items():
        assert metrics["consumed samples"] == 4 * step
        # --lr 1e-2, 1 warmup step, cosine to 0 (--min-lr defaults to 0 with --lr) over --train-iters 6
        assert metrics["lr"] == pytest.approx(0.5e-2 * (1 + math.cos(math.pi * (step - 1) / 5)), rel=1e-3, abs=1e-6)
        check_throughput({k: metrics[k] for k in MFU_KEYS}, rel=1e-5)  # the log line prints 6 digits
    done = _done(log)
    check_throughput({k: done[k] for k in MFU_KEYS}, rel=1e-6)  # float32 metrics
    # Measured, seed 1234 (seeds 1 and 2 in brackets): the first step's loss 5.567 (5.541, 5.555) is a fresh
    # model's ln(257) = 5.549 over the 257 byte ids; after 6 steps train_loss 4.405 (4.295, 4.337) and val_loss
    # 4.275 (4.248, 4.260). Bands: the seed spread plus 0.05.
    assert abs(lines[1]["train_loss"] - math.log(257)) < 0.05, lines[1]
    assert done["train_loss"] == pytest.approx(lines[6]["train_loss"], abs=1e-4)
    assert 4.25 < done["train_loss"] < 4.46 and 4.20 < done["val_loss"] < 4.33, done
    # --save-interval 4 saved step 4; last.ckpt holds the final step 6 and the data position
    last = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 6 and last["GPTDataModule"]["consumed_samples"] == 24
    (step4,) = [p for p in ckpt.iterdir() if "step=4" in p.name]

    # --load of the step-4 checkpoint continues to step 6 exactly as the uninterrupted run did (model, optimizer,
    # lr schedule and data position restored)
    log = _run(args + ["--load", str(step4)], tmp_path)
    assert "Restored all states from the checkpoint" in log, log[-3000:]
    resumed = _iterations(log)
    assert sorted(resumed) == [5, 6], resumed
    for step in (5, 6):
        assert (resumed[step]["train_loss"], resumed[step]["lr"]) == (lines[step]["train_loss"], lines[step]["lr"])
    again = _done(log)
    assert (again["train_loss"], again["val_loss"]) == pytest.approx((done["train_loss"], done["val_loss"]), abs=1e-6)


def test_sharding_strategy_flags():
    """Megatron's FSDP spelling: the FSDP levels need --use-custom-fsdp; contradictions are refused by name."""
    assert plan_of(["--use-custom-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
                   ).strategy.parallel_config.fsdp
    assert plan_of(["--data-parallel-sharding-strategy", "optim"]).strategy.parallel_config.use_distributed_optimizer
    with pytest.raises(FlagError, match="optim_grads shards gradients .* add --use-custom-fsdp"):
        plan_of(["--data-parallel-sharding-strategy", "optim_grads"])
    with pytest.raises(FlagError, match="'no_shard' contradicts use_distributed_optimizer=True"):
        plan_of(["--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"])
