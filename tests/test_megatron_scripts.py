"""Megatron-LM's own LLaMA-3 8B FP8 training script (examples/llama/train_llama3_8b_h100_fp8.sh): every flag it
passes is known to our parser (implemented, accepted as changing nothing, or refused by name), the refused ones
are named in one error, and ``examples/llama/train_llama3_8b_fp8.sh`` (the same layout) trains on CPU with
random tokens and a tiny shape, writing what its flags ask for (checkpoint, TensorBoard events, profile trace,
loss curve)."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_megatron.cli import FlagError, build_parser, plan_from_args, refused_flags
from lightning_megatron.cli.flags import accepted_flags
from lightning_megatron.data import MockGPTDataModule
from lightning_megatron.utils.optional import TENSORBOARD

ROOT = Path(__file__).resolve().parents[1]


def megatron_llama3_8b_fp8_argv(ckpt: str, tensorboard: str, cache: str) -> list:
    """The flags Megatron's script passes to pretrain_gpt.py (mock-data branch, DTYPE=fp8), in its order, plus
    the launch flags our script gives instead of torchrun's."""
    return [
        "--accelerator", "gpu", "--devices", "8",
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout",
        "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
        "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr",
        "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
        "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        # DTYPE_ARGS
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
        "--fp8-param-gather",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        # DDP_ARGS
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # DATA_ARGS_LIST (mock)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path", cache,
        "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
        "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
        "--save", ckpt, "--load", ckpt, "--tensorboard-dir", tensorboard,
    ]


def without(argv, flags):
    """``argv`` without ``flags``, each followed by one value unless the next word is a flag."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            continue
        out.append(argv[i])
        i += 1
    return out


def test_every_flag_of_megatrons_llama3_8b_fp8_script_is_known(tmp_path):
    (tmp_path / "ckpt").mkdir()   # the script creates it; --load of an empty directory starts fresh
    argv = megatron_llama3_8b_fp8_argv(str(tmp_path / "ckpt"), str(tmp_path / "tb"), str(tmp_path / "cache"))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    assert unknown == [], f"unrecognized arguments: {unknown}"
    flags = {a for a in argv if a.startswith("--")}
    refused = {flag: feature for flag, feature in refused_flags(parser).values()}
    accepted = {flag for flag, _ in accepted_flags(parser).values()}
    with pytest.raises(FlagError) as exc:
        plan_from_args(args)
    named = set(re.findall(r"(--[a-z0-9-]+) \(", str(exc.value)))
    assert named == flags & set(refused), str(exc.value)   # each refused flag named, with its feature
    for flag in named:
        assert f"{flag} ({refused[flag]})" in str(exc.value)
    # without the refused flags the script's command line plans (nothing starts): the layout, the batch, the
    # sample-based schedule, the FP8 recipe and the mock data as the script asks
    rest = without(argv, named)
    plan = plan_from_args(parser.parse_args(rest))
    lay = plan.layout
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.world_size) == (1, 1, 1, 8, 8)
    assert (plan.global_batch_size, plan.num_microbatches) == (128, 16)
    assert plan.trainer_kwargs["max_steps"] == 1953125000 // 128
    assert plan.module_kwargs["lr_warmup_iters"] == 3906252 // 128
    assert plan.module_kwargs["lr_decay_iters"] == 1949218748 // 128
    assert (plan.module_kwargs["decoupled_lr"], plan.module_kwargs["decoupled_min_lr"]) == (5.0e-4, 4.5e-5)
    # --bf16 is Megatron's bf16: bf16 parameters (fp32 main parameters as remainders by default), with the FP8 recipe
    assert plan.precision_kwargs == dict(precision="bf16-mixed", fp8="hybrid", fp8_amax_history_len=1024,
                                         fp8_amax_compute_algo="max", params_dtype=torch.bfloat16)
    assert plan.precision.store_param_remainders
    # the production options as one: distributed optimizer, both overlaps, gradients reduced in bf16
    options = plan.strategy_kwargs
    assert (options["use_distributed_optimizer"], options["overlap_grad_reduce"], options["overlap_param_gather"],
            options["grad_reduce_in_bf16"]) == (True, True, True, True), options
    assert isinstance(plan.data_module, MockGPTDataModule) and plan.config.vocab_size == 128257
    assert plan.callback_kwargs["Timer"]["duration"] == {"minutes": 235.0}
    assert plan.callback_kwargs["StepProfiler"]["start_step"] == 4
    assert plan.callback_kwargs["MemoryHousekeeping"] == dict(manual_gc=True, gc_interval=0,
                                                              empty_unused_memory_level=1)
    noted = {note.split()[0] for note in plan.notes}
    assert flags & accepted <= noted   # each accepted flag says why it changes nothing


TINY = ["--accelerator", "cpu", "--devices", "2", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size",
        "128", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "512", "--global-batch-size", "4", "--train-samples", "24",
        "--lr-decay-samples", "24", "--lr-warmup-samples", "4", "--eval-iters", "1", "--eval-interval", "6"]


def test_llama3_8b_fp8_script_trains_on_cpu_with_mock_data(tmp_path):
    """The script as shipped (8B layout, FP8 hybrid delayed, mock data, profile steps 4-6, TensorBoard), with
    tiny shape overrides and 2 CPU processes (dp=2: 2 micro-batches of 1 per step): 6 steps (24 samples)."""
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "examples" / "llama" / "train_llama3_8b_fp8.sh"), str(tmp_path / "ckpt"),
                          str(tmp_path / "tb"), "MOCK", "MOCK", "--"] + TINY, cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "layout: world 2 (tp 1, pp 1, cp 1, ep 1, dp 2); global batch 4 = micro 1 x dp 2 x 2 micro-batches" in log
    losses = [float(x) for x in re.findall(r"iteration +\d+/6 \| consumed samples \d+ \| train_loss ([0-9.]+)", log)]
    assert len(losses) == 6, log[-3000:]
    # random tokens over 513 ids (512 + NullTokenizer's eod): a fresh model's loss is near ln(513) = 6.24
    assert all(5.9 < x < 6.6 for x in losses), losses
    assert "note: --use-mcore-models changes nothing here" in log
    # --ckpt-format torch_dist: last.ckpt is a complete sharded directory (its metadata written last)
    assert (tmp_path / "ckpt" / "last.ckpt" / ".metadata").is_file(), list((tmp_path / "ckpt").iterdir())
    assert (tmp_path / "tb" / "profile" / "trace_rank0_steps4-6.json").is_file()   # --profile-step-start/end
    if TENSORBOARD:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*")), list((tmp_path / "tb").iterdir())
    else:
        assert (tmp_path / "tb" / "metrics.csv").is_file()
    with open(tmp_path / "tb" / "loss_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert [round(float(r["train_loss"]), 4) for r in rows] == [round(x, 4) for x in losses]
    assert rows[-1]["val_loss"] != ""


def test_eval_interval_counts_iterations_over_the_whole_run():
    """``--eval-interval`` counts optimizer steps over the whole run, as Megatron's does: a run longer than its data
    (several epochs: 2 batches per epoch, 7 steps) validates after steps 3 and 6, where Lightning on its own refuses
    a validation interval longer than an epoch."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_megatron import ParallelGPTModule

    class ValidationSteps(Callback):
        def __init__(self):
            self.steps = []

        def on_validation_end(self, trainer, pl_module):
            self.steps.append(trainer.global_step)

    plan = plan_from_args(build_parser().parse_args(
        ["--mock-data", "--tensor-model-parallel-size", "1", "--devices", "1", "--num-layers", "1", "--hidden-size",
         "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "2",
         "--train-iters", "7", "--eval-interval", "3", "--eval-iters", "1"]))
    seen = ValidationSteps()
    trainer = pl.Trainer(**dict(plan.trainer_kwargs, enable_progress_bar=False, enable_model_summary=False),
                         callbacks=[seen])
    short = MockGPTDataModule(64, seq_length=16, micro_batch_size=2, num_train_samples=4, num_val_samples=2)
    trainer.fit(ParallelGPTModule(plan.config, **plan.module_kwargs), datamodule=short)
    assert trainer.global_step == 7 and trainer.current_epoch >= 3
    assert seen.steps == [3, 6]


def test_run_control_callbacks_of_the_flags_act_in_a_real_fit(tmp_path):
    """The callbacks ``--manual-gc --manual-gc-interval 2`` and ``--exit-duration-in-mins`` build (one process,
    plain Trainer, random tokens): the collector is off during training, collects every 2 steps and is back on
    after; a duration of 1e-6 minutes stops the run after its first optimizer step."""
    import gc

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_megatron import ParallelGPTModule

    class Probe(Callback):
        def __init__(self):
            self.enabled, self.collections, self._count = [], [], 0

        def on_train_start(self, trainer, pl_module):
            gc.callbacks.append(self._on_gc)

        def _on_gc(self, phase, info):
            if phase == "start" and info["generation"] == 2:
                self._count += 1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.enabled.append(gc.isenabled())
            self.collections.append(self._count)

        def on_train_end(self, trainer, pl_module):
            gc.callbacks.remove(self._on_gc)

    def fit(argv, steps):
        plan = plan_from_args(build_parser().parse_args(
            ["--mock-data", "--tensor-model-parallel-size", "1", "--devices", "1", "--num-layers", "1",
             "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
             "--micro-batch-size", "2", "--train-iters", str(steps), "--loss-curve", str(tmp_path / "curve")] + argv))
        probe = Probe()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, callbacks=plan.build_callbacks(progress_bar=False) + [probe])
        trainer.fit(ParallelGPTModule(plan.config, **plan.module_kwargs), datamodule=plan.data_module)
        return trainer, probe

    assert gc.isenabled()
    trainer, probe = fit(["--manual-gc", "--manual-gc-interval", "2"], steps=6)
    assert trainer.global_step == 6 and probe.enabled == [False] * 6 and gc.isenabled()
    # a full collection after steps 2, 4 and 6 only (the probe reads the count after the callback collected)
    assert [b - a for a, b in zip([0] + probe.collections[:-1], probe.collections)] == [0, 1, 0, 1, 0, 1]
    trainer, probe = fit(["--exit-duration-in-mins", "1e-6"], steps=6)
    assert trainer.global_step == 1 and len(probe.enabled) == 1


def test_decoupled_lr_schedules_the_embedding_and_output_layer_on_their_own():
    """``--decoupled-lr 0.01 --decoupled-min-lr 0.001``: the word embedding and output layer (and only they) get
    their own AdamW group whose lr follows Megatron's schedule from 0.01 to 0.001, the rest from --lr to --min-lr,
    step by step through a real fit; and their weights move by more than with the plain lr."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_megatron import ParallelGPTModule
    from lightning_megatron.models.module import megatron_lr_lambda

    class LrProbe(Callback):
        def __init__(self):
            self.lrs = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lrs.append([g["lr"] for g in optimizer.param_groups])

    def fit(extra):
        plan = plan_from_args(build_parser().parse_args(
            ["--mock-data", "--tensor-model-parallel-size", "1", "--devices", "1", "--num-layers", "1",
             "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
             "--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
             "--lr-warmup-iters", "2"] + extra))
        torch.manual_seed(0)
        module = ParallelGPTModule(plan.config, **plan.module_kwargs)
        module.configure_model()
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        probe = LrProbe()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[probe])
        trainer.fit(module, datamodule=plan.data_module)
        groups = trainer.optimizers[0].param_groups
        names = {id(p): n for n, p in module.named_parameters()}
        moved = {n: float((p.detach() - before[n]).norm()) for n, p in module.named_parameters()}
        return probe.lrs, [sorted(names[id(p)] for p in g["params"]) for g in groups], moved

    lrs, groups, moved = fit(["--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3"])
    assert groups[2] == ["model.embedding.word_embeddings.weight", "model.output_layer.weight"]
    assert not any(n in groups[0] + groups[1] for n in groups[2])
    for step, (main, _, vocab) in enumerate(lrs):
        assert main == pytest.approx(1e-3 * megatron_lr_lambda(step, 1e-3, 1e-4, 2, 6, "cosine"), rel=1e-12)
        assert vocab == pytest.approx(1e-2 * megatron_lr_lambda(step, 1e-2, 1e-3, 2, 6, "cosine"), rel=1e-12)
    assert lrs[1][2] == pytest.approx(1e-2) and lrs[-1][2] > 1e-3   # peak after warmup, decaying towards 1e-3
    plain_lrs, plain_groups, plain_moved = fit([])
    assert len(plain_groups) == 2 and all(len(step) == 2 for step in plain_lrs)
    for name in ("model.embedding.word_embeddings.weight", "model.output_layer.weight"):
        assert moved[name] > 3 * plain_moved[name], (name, moved[name], plain_moved[name])


def test_loss_curve_reads_the_device_losses_in_batches(tmp_path):
    """``LossCurve`` keeps each step's loss on the device (a copy: the logged tensor may be reused) and reads them
    on the host every ``read_every`` steps and at the end, with the right step for each value; the progress bar of
    ``pretrain_gpt.py`` refreshes once per ``--log-interval`` iterations (each a host read)."""
    from types import SimpleNamespace

    import torch

    from lightning_megatron import LossCurve

    curve = LossCurve(tmp_path / "curve", read_every=3)
    logged = torch.zeros(())
    trainer = SimpleNamespace(is_global_zero=True, callback_metrics={"train_loss": logged})
    for step in range(1, 8):
        logged.fill_(step / 10)
        curve.on_optimizer_step_end(trainer, None, step)
        assert len(curve.train) == step // 3 * 3
    curve.read()
    assert curve.train == [(s, pytest.approx(s / 10)) for s in range(1, 8)]
    with pytest.raises(ValueError, match="read_every=0 must be >= 1"):
        LossCurve(tmp_path / "curve", read_every=0)
    plan = plan_from_args(build_parser().parse_args(["--log-interval", "5", "--global-batch-size", "16",
                                                     "--micro-batch-size", "4"]))
    assert plan.num_microbatches == 4
    assert plan.callback_kwargs["TQDMProgressBar"] == {"refresh_rate": 20}
    assert type(plan.build_callbacks()[-1]).__name__ == "TQDMProgressBar"
    assert "TQDMProgressBar" not in [type(c).__name__ for c in plan.build_callbacks(progress_bar=False)]
