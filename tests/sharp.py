"""The sharp numerics oracle: float64 runs under plain SGD, compared by weight change.

The fp32 parity tier (:mod:`tests.parity`) trains with AdamW, which normalises the gradient's scale away (a
gradient twice too large moves the weights almost as far), and compares at 1e-5, where float32 noise lives.
Here the model runs in float64 (``Trainer(precision="64-true")``) with plain SGD (no momentum, no weight decay,
constant learning rate), so after ``steps`` optimizer steps every weight has moved by exactly
``-lr * (sum over steps of its gradient)``. The parallel run's change ``final - initial`` of every parameter
is compared with the single-process float64 run's change: a gradient that is wrong by any factor, on any one
parameter, shows up at its full size, whereas a comparison of the final weights would shrink it by ``lr``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule
from lightning_megatron.moe import set_aux_loss_scale_of, update_expert_biases
from tests._dist import run_each
from tests.parity import SEED, ListDataset, collate, lightning_train_order, make_samples, trainer_for

#: SGD learning rate: large enough that the later steps' gradients are taken at visibly moved weights, small
#: enough that the tiny model's loss still falls.
LR = 0.5


class SGDModule(ParallelGPTModule):
    """``ParallelGPTModule`` trained by plain SGD (no momentum, no weight decay, constant ``lr``): a step moves
    every parameter by exactly ``-lr`` times its gradient, so the weight change is the summed gradient."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.0, weight_decay=0.0)


def sharp_module(cfg: GPTConfig) -> SGDModule:
    return SGDModule(cfg, lr=LR)


def state_of(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def sharp_reference(cfg: GPTConfig, samples, steps: int, global_batch: int, accumulate: int,
                    clip: Optional[float]) -> Dict[str, Any]:
    """The single-process float64 run: the same seeded initial weights (drawn as under the strategy, then made
    float64, as ``precision="64-true"`` does), the same micro-batches in Lightning's order, the same steps.

    Returns ``initial`` and ``final`` state dicts, ``buffers`` (the state keys that are buffers, not
    parameters) and ``norms`` (the global gradient norm before clipping, one per step, when ``clip`` is set).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a tiny model: more threads only contend on a shared CPU (100x slower seen)
    try:
        return _sharp_reference(cfg, samples, steps, global_batch, accumulate, clip)
    finally:
        torch.set_num_threads(threads)


def _sharp_reference(cfg: GPTConfig, samples, steps: int, global_batch: int, accumulate: int,
                     clip: Optional[float]) -> Dict[str, Any]:
    pl.seed_everything(SEED, verbose=False)
    module = sharp_module(cfg)
    module.configure_model()
    module.double()
    initial = state_of(module)
    opt = module.configure_optimizers()
    set_aux_loss_scale_of(module, 1.0 / accumulate)   # MoE aux / z losses scaled like the main loss
    order = lightning_train_order(len(samples))
    norms: List[float] = []
    micro = 0
    for _ in range(steps):
        for _ in range(accumulate):
            indices = order[micro * global_batch:(micro + 1) * global_batch]
            assert len(indices) == global_batch, "not enough samples for the requested steps"
            loss_sum, count = module.loss_sum_and_count(collate([samples[i] for i in indices]))
            (loss_sum / count / accumulate).backward()
            micro += 1
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip)))
        update_expert_biases(module)
        opt.step()
        opt.zero_grad()
    buffers = {name for name, _ in module.named_buffers()}
    return {"initial": initial, "final": state_of(module), "buffers": buffers, "norms": norms}


class InitialState(pl.Callback):
    """The full (layout-independent) state at the start of training: collective on every rank, kept on rank 0."""

    def __init__(self) -> None:
        self.state: Optional[Dict[str, torch.Tensor]] = None

    def on_train_start(self, trainer, pl_module) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        # replicated tensors come back as the parameters themselves, which the optimizer then updates in place
        self.state = {k: v.detach().clone() for k, v in state.items()} if trainer.global_rank == 0 else None


def sharp_layout_run(rank: int, world: int, cfg: GPTConfig, strategy_kwargs: Dict[str, Any], samples,
                     micro_batch: int, accumulate: int, clip: Optional[float], steps: int) -> Dict[str, Any]:
    """One rank of the float64 SGD run under ``MegatronStrategy(**strategy_kwargs)`` via the real Trainer:
    the full ``initial`` and ``final`` states (rank 0) and the number of optimizer steps taken."""
    pl.seed_everything(SEED, verbose=False)
    module = sharp_module(cfg)
    initial = InitialState()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, precision="64-true",
                          callbacks=[initial], gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    final = trainer.strategy.lightning_module_state_dict()
    return {"initial": initial.state, "final": final if rank == 0 else None, "steps": trainer.global_step}


class SharpCase:
    """One layout of the sharp tier: ``world`` processes, ``MegatronStrategy(**kwargs)``, the model ``cfg``,
    ``accumulate`` micro-batches of ``micro_batch`` samples per data-parallel rank and step, optional clip."""

    def __init__(self, world: int, kwargs: Dict[str, Any], cfg: GPTConfig, accumulate: int = 1,
                 clip: Optional[float] = None, steps: int = 2, micro_batch: int = 2) -> None:
        self.world, self.kwargs, self.cfg = world, kwargs, cfg
        self.accumulate, self.clip, self.steps, self.micro_batch = accumulate, clip, steps, micro_batch

    @property
    def global_batch(self) -> int:
        model_parallel = 1
        for name in ("tp", "pp", "cp"):
            model_parallel *= self.kwargs.get(name, 1)
        return self.micro_batch * (self.world // model_parallel)

    def samples(self):
        return make_samples(self.cfg, self.steps * self.accumulate * self.global_batch)

    def run_args(self) -> Tuple:
        return (self.cfg, self.kwargs, self.samples(), self.micro_batch, self.accumulate, self.clip, self.steps)

    def reference(self) -> Dict[str, Any]:
        return sharp_reference(self.cfg, self.samples(), self.steps, self.global_batch, self.accumulate, self.clip)


def run_cases(rank: int, world: int, cases: Sequence[Tuple[str, Tuple]]) -> Dict[str, Any]:
    """Worker of :func:`run_layouts`: each ``(name, sharp_layout_run arguments)`` in turn in this one process group
    (:func:`tests._dist.run_each`)."""
    return run_each(rank, world, sharp_layout_run, cases)


def run_layouts(cases: Dict[str, SharpCase]) -> Dict[str, Any]:
    """Run every case (all of the same world size) in one set of gloo processes; rank 0's result per case."""
    from tests._dist import run_distributed

    worlds = {c.world for c in cases.values()}
    assert len(worlds) == 1, worlds
    results = run_distributed(run_cases, worlds.pop(), [(name, c.run_args()) for name, c in cases.items()])
    return results[0]


def relative_change_errors(result: Dict[str, Any], ref: Dict[str, Any]) -> Dict[str, float]:
    """Per parameter ``||(final - initial) - (final_ref - initial_ref)|| / ||final_ref - initial_ref||``
    (Frobenius), after checking that the run started from the reference's exact initial weights. Buffers
    (e.g. expert biases) are compared by value: ``||final - final_ref|| / max(||final_ref||, 1)``."""
    initial, final = result["initial"], result["final"]
    assert final.keys() == ref["final"].keys(), (sorted(final), sorted(ref["final"]))
    assert initial.keys() == ref["initial"].keys()
    errors: Dict[str, float] = {}
    params = set(ref["final"]) - ref["buffers"]
    for k, want_final in ref["final"].items():
        got_final = final[k]
        assert got_final.dtype == torch.float64, (k, got_final.dtype)
        assert got_final.shape == want_final.shape, (k, got_final.shape, want_final.shape)
        assert torch.equal(initial[k], ref["initial"][k]), f"{k}: initial weights differ from the reference's"
        if k in params:
            want = want_final - ref["initial"][k]
            got = got_final - initial[k]
            assert want.norm() > 0, f"{k}: the reference did not move it; the comparison would be empty"
            errors[k] = float((got - want).norm() / want.norm())
        else:
            errors[k] = float((got_final - want_final).norm() / want_final.norm().clamp(min=1.0))
    return errors
