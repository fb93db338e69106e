"""The shipped examples run end to end (real processes): the default pretraining run learns, and the
torchrun quick-start loop trains under tp=2 with the loss identical on every rank."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, tmp_path, timeout=300):
    env = dict(os.environ, LIGHTNING_MEGATRON_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_pretrain_gpt_default_run_learns(tmp_path):
    """A shortened default run (same model, data and layout: CPU, 2 processes, tp=2 + SP)."""
    log = _run([sys.executable, "examples/pretrain_gpt.py", "--train-iters", "60", "--eval-interval", "60",
                "--eval-iters", "4", "--save", str(tmp_path / "ckpt")], tmp_path)
    done = re.search(r"done: \{'train_loss': ([0-9.]+), 'val_loss': ([0-9.]+)\}", log)
    assert done, log[-2000:]
    val_loss = float(done.group(2))
    # Uniform guessing over the 2048-token vocabulary costs ln(2048) = 7.62 nats.
    assert val_loss < math.log(2048) - 1.5, val_loss
    assert (tmp_path / "ckpt" / "last.ckpt").exists()


def _loop_losses(nproc, tmp_path):
    log = _run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "examples/run_simple_train_loop.py", "--steps", "6"], tmp_path)
    assert f"tp={nproc}" in log, log[-2000:]
    return [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", log)]


def test_simple_train_loop_torchrun_matches_one_process(tmp_path):
    """tp=2 + SP under torchrun prints the same losses as the same loop in one process."""
    tp2, tp1 = _loop_losses(2, tmp_path), _loop_losses(1, tmp_path)
    assert len(tp2) == 6 and len(tp1) == 6
    for a, b in zip(tp2, tp1):
        assert abs(a - b) <= 2e-4, (tp2, tp1)
