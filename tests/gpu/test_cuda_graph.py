"""Per-layer CUDA graphs (``MegatronStrategy(enable_cuda_graph=True)``) on one GPU train exactly as the same
compiled layers without graphs (the replays run the recorded kernels):

- fp32 parameters, one micro-batch per step, bf16 autocast;
- bf16 parameters with fp32 main parameters and gradients, two micro-batches accumulated per step (the gradients
  leave the graphs' memory in the main-gradient hook);
- FP8 delayed recipe (torch backend), bf16 parameters, two micro-batches: the amax records written inside the
  graphs give the same histories;

and in every case validation batches (forward only, between training steps) give the same loss, no layer's graph
was skipped (Inductor's ``cudagraph_skips`` counter), and a profiled step launches at least one CUDA graph per layer
and direction at every micro-batch (10 layers, more than dynamo's recompile limit: every layer must share one
compiled graph).
"""
from __future__ import annotations

from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronPrecision, MegatronStrategy
from tests.parity import SEED, ListDataset, StepLossRecorder, make_samples, new_module, tiny_config

STEPS = 5


class GraphLaunches(pl.Callback):
    """Counts the host's ``cudaGraphLaunch`` calls during training batch ``profiled`` (the last step's last batch:
    at pp = 1 each of Lightning's batches is one micro-batch of the step; the FP8 delayed recipe compiles its layers
    only after the first step, and a graph is recorded at a layer's second call and replayed from its third)."""

    def __init__(self, profiled: int) -> None:
        self.launches, self.profiled = 0, profiled

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.profiled:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.profiled:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.launches = sum(e.count for e in self.prof.key_averages() if e.key == "cudaGraphLaunch")


class ValLosses(pl.Callback):
    """``val_loss`` at the end of each validation run."""

    def __init__(self) -> None:
        self.values: List[float] = []

    def on_validation_end(self, trainer, module) -> None:
        self.values.append(float(trainer.callback_metrics["val_loss"]))


def _fit(graphs: bool, accumulate: int, **precision: Any) -> Dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(SEED, verbose=False)
    # more layers than dynamo's recompile limit (8): a per-layer guard would leave the last layers eager
    cfg = tiny_config(num_layers=10, hidden_size=64, ffn_hidden_size=128, seq_length=32)
    recorder, launches, val_losses = StepLossRecorder(accumulate), GraphLaunches(STEPS * accumulate - 1), ValLosses()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=MegatronStrategy(compile=True, enable_cuda_graph=graphs),
                         plugins=[MegatronPrecision("bf16-mixed", **precision)], max_steps=STEPS,
                         accumulate_grad_batches=accumulate, val_check_interval=2 * accumulate, limit_val_batches=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder, launches, val_losses])
    batches = 4 * STEPS * accumulate
    train = DataLoader(ListDataset(make_samples(cfg, batches)), batch_size=4, pin_memory=True)
    val = DataLoader(ListDataset(make_samples(cfg, 8, seed=SEED + 1)), batch_size=4)
    module = new_module(cfg, STEPS, adamw="bf16_moments")
    trainer.fit(module, train, val)
    fp8 = trainer.strategy.parallelized.fp8
    return dict(losses=recorder.losses, val=val_losses.values, skips=counters["inductor"]["cudagraph_skips"],
                copied_inputs=counters["inductor"]["cudagraph_recorded_non_static_inputs"],
                launches=launches.launches, expected_launches=2 * cfg.num_layers,
                histories=fp8.state_dict() if fp8 is not None else {})


CASES = {
    "fp32-params": (1, {}),
    "bf16-params-accumulate-2": (2, dict(params_dtype=torch.bfloat16)),
    "fp8-delayed-bf16-params-accumulate-2": (2, dict(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="delayed",
                                                     fp8_backend="torch")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_graph_layers_train_as_the_compiled_layers(case, measured):
    accumulate, precision = CASES[case]
    plain = _fit(False, accumulate, **precision)
    graphed = _fit(True, accumulate, **precision)
    worst = max(abs(a - b) for a, b in zip(graphed["losses"], plain["losses"]))
    measured(**{f"{case} loss diff": worst, f"{case} graph launches": float(graphed["launches"])})
    assert len(graphed["losses"]) == len(plain["losses"]) == STEPS
    assert worst <= 1e-6, (graphed["losses"], plain["losses"])
    # the validation (no-grad) graphs are compiled and autotuned apart in each run, so their reductions may sum in
    # another order: 3.3e-6 relative measured on a cold compile cache (0 on a warm one), the training losses equal
    assert graphed["val"] and graphed["val"] == pytest.approx(plain["val"], rel=1e-5)
    assert graphed["skips"] == 0, "Inductor skipped a layer's CUDA graph"
    # the batches' position ids are arange (left out on the host) and the RoPE tables of the default positions are
    # kept at a fixed address (GPTModel.rotary): no layer's graph copies them in at each replay (before: two per
    # layer and recording, 43 here); what is copied is a graph's first input from outside the graphs
    measured(**{f"{case} copied inputs": float(graphed["copied_inputs"])})
    assert graphed["copied_inputs"] < 10 * 2, graphed["copied_inputs"]
    # every layer's forward and backward graph in the profiled micro-batch
    assert plain["launches"] == 0 and graphed["launches"] >= graphed["expected_launches"], graphed["launches"]
    for name, history in plain["histories"].items():
        assert torch.equal(graphed["histories"][name], history), name
