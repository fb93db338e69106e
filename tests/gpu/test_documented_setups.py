"""Every documented GPU setup starts and trains (:func:`tests.doc_snippets.gpu_setups`: the Python blocks of README.md
and docs/*.md that build a ``Trainer(accelerator="gpu", ...)``, among them the fastest bf16 and FP8 setups of
docs/performance.md).

Each block runs as written, on a small model of the benchmark model's shape (``config``: 2 layers, hidden 256, every
GEMM dimension a multiple of 16 for FP8), with the Trainer's own arguments plus a short run's (8 steps, no logger or
checkpoints). The run must train: the loss of a fixed batch seen 8 times falls by a tenth, every loss is finite, and
where the block asks for ``compile=True`` the layers were compiled (dynamo graphs), with ``enable_cuda_graph=True``
no layer's CUDA graph was skipped. A documented setup that crashes (as the FP8 delayed recipe under ``compile=True``
did on CUDA while its CPU lowering ran) fails the tier.
"""
from __future__ import annotations

import math
import re
import types
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_megatron
from tests.doc_snippets import Snippet, gpu_setups
from tests.parity import SEED, ListDataset, StepLossRecorder, make_samples

STEPS = 8
SETUPS = gpu_setups()
_LIGHTNING_IMPORT = re.compile(r"^\s*(import lightning|from lightning)\b.*$", re.M)


def _small_config() -> lightning_megatron.GPTConfig:
    return lightning_megatron.GPTConfig.llama_1b_bench(num_layers=2, hidden_size=256, num_attention_heads=4,
                                                        num_query_groups=2, ffn_hidden_size=704, vocab_size=1024,
                                                        seq_length=256)


def _run(snippet: Snippet) -> Dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(SEED, verbose=False)
    recorder = StepLossRecorder(1)

    def trainer(**kwargs: Any) -> pl.Trainer:
        kwargs.update(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[*kwargs.get("callbacks", []), recorder])
        return pl.Trainer(**kwargs)

    namespace: Dict[str, Any] = {name: getattr(lightning_megatron, name) for name in lightning_megatron.__all__}
    namespace.update(torch=torch, L=types.SimpleNamespace(Trainer=trainer), pl=types.SimpleNamespace(Trainer=trainer),
                     config=_small_config())
    exec(compile(_LIGHTNING_IMPORT.sub("", snippet.code), snippet.name, "exec"), namespace)
    cfg = namespace["config"]
    module = namespace.get("module") or lightning_megatron.ParallelGPTModule(cfg)
    batch = make_samples(cfg, 4)            # one fixed batch, every step: the loss must fall
    namespace["trainer"].fit(module, DataLoader(ListDataset(batch * STEPS), batch_size=4, pin_memory=True))
    return dict(losses=recorder.losses, graphs=counters["stats"]["unique_graphs"],
                skips=counters["inductor"]["cudagraph_skips"], strategy=namespace["trainer"].strategy)


@pytest.mark.parametrize("snippet", SETUPS, ids=[s.name for s in SETUPS])
def test_documented_gpu_setup_trains(snippet: Snippet, measured):
    out = _run(snippet)
    losses = out["losses"]
    measured(first_loss=losses[0], last_loss=losses[-1], graphs=float(out["graphs"]))
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.9 * losses[0], losses
    config = out["strategy"].parallel_config
    if config.compile:
        assert out["graphs"] > 0, "compile=True compiled no graph"
    if config.enable_cuda_graph:
        assert out["skips"] == 0, "Inductor skipped a layer's CUDA graph"
