"""``python -m lightning_megatron fit --config ...`` (LightningCLI): the reference-table configurations of
``examples/configs`` parse and check against their world size and presets without launching anything, a
configuration that cannot run is refused before anything is built, and ``tiny_cpu.yaml`` trains on CPU
(2 processes, tp=2 + SP) exactly as the default run of ``examples/pretrain_gpt.py`` starts."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_megatron import GPTConfig
from lightning_megatron.cli import check_config
from lightning_megatron.utils.optional import MATPLOTLIB

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"


@pytest.mark.parametrize("name, preset, world, sizes, global_batch", [
    ("llama3_8b", "llama3_8b", 8, dict(tp=1, pp=1, cp=2, ep=1, dp=4), 128),
    ("llama3_70b", "llama3_70b", 64, dict(tp=4, pp=4, cp=2, ep=1, dp=2), 128),
    ("gpt3_175b", "gpt3_175b", 512, dict(tp=4, pp=8, cp=1, ep=1, dp=16), 1536),
    ("mixtral_8x7b", "mixtral_8x7b", 64, dict(tp=1, pp=4, cp=1, ep=8, dp=16), 256),
])
def test_reference_configurations_check_without_launching(name, preset, world, sizes, global_batch):
    checked = check_config(["--config", str(CONFIGS / f"{name}.yaml")])
    lay = checked.layout
    assert lay.world_size == world
    assert {k: getattr(lay, k) for k in sizes} == sizes
    assert checked.model_config == getattr(GPTConfig, preset)()   # the YAML's model is the published preset
    assert checked.global_batch_size == global_batch
    assert not (dist.is_available() and dist.is_initialized())


@pytest.mark.parametrize("name, override, needle", [
    ("llama3_8b", ["--trainer.devices", "7"], "world size 7 = trainer.devices 7 x trainer.num_nodes 1"),
    ("llama3_8b", ["--data.init_args.seq_length", "4096"], "data.init_args.seq_length=4096 differs from "
                                                           "model.config.seq_length=8192"),
    ("llama3_70b", ["--trainer.accumulate_grad_batches", "2"], "pp=4 with the '1f1b' schedule needs at least 4"),
    ("mixtral_8x7b", ["--model.config.num_moe_experts", "6"], "ep"),
    ("gpt3_175b", ["--model.config.num_layers", "100"], "num_layers"),
])
def test_a_configuration_that_cannot_run_is_refused_before_anything_is_built(capsys, name, override, needle):
    with pytest.raises(SystemExit) as exc:
        check_config(["--config", str(CONFIGS / f"{name}.yaml")] + override)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "the configuration cannot run" in err and needle in err, err[-2000:]


def test_tiny_cpu_configuration_trains(tmp_path):
    """20 steps of ``tiny_cpu.yaml`` (the default run's model, data, layout and schedule of a 400-step run):
    the first loss is the default run's (7.668 at seed 1234, see test_examples.py) and it falls by more than 1
    nat in 20 steps (measured 7.668 -> 5.976); the loss curve and the resolved config.yaml are written."""
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run([sys.executable, "-m", "lightning_megatron", "fit", "--config", str(CONFIGS / "tiny_cpu.yaml"),
                          "--trainer.max_steps", "20", "--trainer.val_check_interval", "20",
                          "--trainer.limit_val_batches", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    with open(tmp_path / "lightning_logs" / "loss_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 21)), rows
    first, last = float(rows[0]["train_loss"]), float(rows[-1]["train_loss"])
    assert 7.60 < first < 7.72, first
    assert last < first - 1.0, (first, last)
    assert rows[-1]["val_loss"] and float(rows[-1]["val_loss"]) < first - 1.0
    # LightningCLI's record of the resolved configuration, beside the loss curve, not in the working directory
    assert (tmp_path / "lightning_logs" / "config.yaml").is_file() and not (tmp_path / "config.yaml").exists()
    assert (tmp_path / "lightning_logs" / f"loss_curve.{'png' if MATPLOTLIB else 'svg'}").is_file()
    # what the user sees: the model summary counts the whole model (tp=2's rank 0 holds half of it; 1,262,720
    # parameters: GPTConfig.num_parameters of the file's model), and no warning about on_before_batch_transfer
    assert re.search(r"Total params\W+1\.3 M|1\.3 M\s+Total params", log), log[-4000:]
    assert "on_before_batch_transfer" not in log, log[-4000:]


def test_tiny_cpu_configuration_validates_as_the_default_run():
    """``tiny_cpu.yaml`` is the default run of ``examples/pretrain_gpt.py`` as YAML: the same Trainer arguments,
    validation included (every 100 steps over the whole run, ``check_val_every_n_epoch=None``: at 100, 200, 300 and
    400, not at 100, 200 and the epoch's end)."""
    from lightning_megatron.cli import MegatronCLI, parse_pretrain_args

    default = parse_pretrain_args([]).trainer_kwargs
    trainer = MegatronCLI(args=["--config", str(CONFIGS / "tiny_cpu.yaml")], run=False, check_only=True).config.trainer
    keys = ["accelerator", "devices", "max_steps", "accumulate_grad_batches", "val_check_interval",
            "check_val_every_n_epoch", "limit_val_batches", "gradient_clip_val", "log_every_n_steps",
            "num_sanity_val_steps", "logger", "enable_checkpointing"]
    assert {k: trainer[k] for k in keys} == {k: default[k] for k in keys}
    assert default["check_val_every_n_epoch"] is None and default["val_check_interval"] == 100


def test_packed_sequence_options_reach_the_gpt_data_module():
    """``reset_attention_mask`` / ``reset_position_ids`` (Megatron's packed-sequence flags) are GPTDataModule options
    the YAML CLI takes (an unknown option is refused by the parser)."""
    data = ["--data", "lightning_megatron.data.GPTDataModule", "--data.init_args.data_path", "x",
            "--data.init_args.seq_length", "8192", "--data.init_args.micro_batch_size", "1",
            "--data.init_args.global_batch_size", "128", "--data.init_args.eod_id", "128001"]
    checked = check_config(["--config", str(CONFIGS / "llama3_8b.yaml")] + data
                           + ["--data.init_args.reset_attention_mask", "true",
                              "--data.init_args.reset_position_ids", "true"])
    assert checked.global_batch_size == 128
    with pytest.raises(SystemExit):
        check_config(["--config", str(CONFIGS / "llama3_8b.yaml")] + data + ["--data.init_args.reset_attention", "true"])
