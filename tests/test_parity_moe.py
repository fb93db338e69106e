"""Mixture of experts end to end: MegatronStrategy(ep=..., etp=...) composed with TP+SP, PP, CP and DP under the
real Trainer against the single-process run of the same MoE model (dropless): loss of every optimizer step,
the logged ``moe_aux_loss``, and the final weights (1e-5 relative, fp32). Plus: expert tensor parallelism and
capacity drops at layer level, checkpoints of expert weights, and the layout errors."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelConfig
from lightning_megatron.moe import MoEConfig, MoELayer, pop_aux_loss_sums, set_aux_loss_scale_of, update_expert_biases
from tests._dist import init_gloo, run_distributed
from tests.parity import (
    SEED,
    ListDataset,
    assert_state_close,
    collate,
    lightning_train_order,
    make_samples,
    new_module,
    trainer_for,
)

STEPS = 3


def moe_config(**overrides: Any) -> GPTConfig:
    """Tiny MoE: 2 layers, hidden 32, 4 SwiGLU experts of 32, top-2, aux and z losses, shared expert."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                vocab_size=200, seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=16)
    base.update(overrides)
    return GPTConfig(**base)


def aux_total(sums: Dict[str, torch.Tensor], cfg: GPTConfig) -> float:
    return float(sums.get(cfg.moe_router_load_balancing_type, torch.zeros(())))


def moe_reference(cfg: GPTConfig, samples, global_batch: int, accumulate: int, clip: Optional[float]):
    """Single process: per-step loss and aux loss (micro-batch means), final state. Aux/z gradients scaled by
    1/accumulate like the main loss; expert biases updated once per step."""
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    module.configure_model()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    set_aux_loss_scale_of(module, 1.0 / accumulate)
    order = lightning_train_order(len(samples))
    losses, aux, micro = [], [], 0
    for _ in range(STEPS):
        step_loss = step_aux = 0.0
        for _ in range(accumulate):
            batch = collate([samples[i] for i in order[micro * global_batch:(micro + 1) * global_batch]])
            loss_sum, count = module.loss_sum_and_count(batch)
            loss = loss_sum / count
            (loss / accumulate).backward()
            step_loss += loss.item() / accumulate
            step_aux += aux_total(pop_aux_loss_sums(module), cfg) / accumulate
            micro += 1
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        update_expert_biases(module)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(step_loss)
        aux.append(step_aux)
    return losses, aux, {k: v.detach().clone() for k, v in module.state_dict().items()}


class StepRecorder(pl.Callback):
    """``train_loss`` and ``moe_aux_loss`` per optimizer step (mean over its micro-batches)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate, self.losses, self.aux = accumulate, [], []
        self._loss = self._aux = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        pipeline = trainer.strategy.parallel_config.pp > 1
        last = (batch_idx + 1) % self.accumulate == 0
        if pipeline:  # the step's values are logged at its last micro-batch
            if last:
                self.losses.append(float(m["train_loss"]))
                self.aux.append(float(m["moe_aux_loss"]))
            return
        self._loss += float(m["train_loss"]) / self.accumulate
        self._aux += float(m["moe_aux_loss"]) / self.accumulate
        if last:
            self.losses.append(self._loss)
            self.aux.append(self._aux)
            self._loss = self._aux = 0.0


def moe_layout_run(rank, world, cfg, strategy_kwargs, samples, micro_batch, accumulate, clip, path=None):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    recorder = StepRecorder(accumulate)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), STEPS, callbacks=[recorder],
                          gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    if path is not None:
        trainer.save_checkpoint(path)
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "aux": recorder.aux, "state": state if rank == 0 else None}


CASES = {
    # id: (world, strategy kwargs, config overrides, micro-batches per step, clip)
    "ep2": (2, dict(ep=2), {}, 1, 0.05),
    "ep2-allgather-grouped": (2, dict(ep=2), dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=True), 2, None),
    "ep2-seqaux-expertbias": (2, dict(ep=2), dict(moe_router_load_balancing_type="seq_aux_loss",
                                                  moe_router_score_function="sigmoid",
                                                  moe_router_enable_expert_bias=True,
                                                  moe_router_bias_update_rate=0.05), 1, None),
    "ep4": (4, dict(ep=4), {}, 1, None),
    "ep2xdp2-edp2": (4, dict(ep=2), {}, 1, 0.05),
    "ep2xtp2-sp-etp2": (4, dict(ep=2, tp=2, sequence_parallel=True), {}, 1, 0.05),
    "ep2xtp2-sp-etp1-allgather": (4, dict(ep=2, tp=2, etp=1, sequence_parallel=True),
                                  dict(moe_token_dispatcher_type="allgather"), 1, None),
    "ep2xpp2-expertbias": (4, dict(ep=2, pp=2), dict(moe_layer_freq=[1, 0], moe_router_score_function="sigmoid",
                                                   moe_router_enable_expert_bias=True,
                                                   moe_router_bias_update_rate=0.05), 2, 0.05),
    "ep2xcp2": (4, dict(ep=2, cp=2), {}, 1, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layout_matches_single_process(case):
    world, kwargs, overrides, accumulate, clip = CASES[case]
    cfg = moe_config(**overrides)
    micro_batch = 2
    dp = world // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))
    global_batch = micro_batch * dp
    samples = make_samples(cfg, STEPS * accumulate * global_batch)
    ref_losses, ref_aux, ref_state = moe_reference(cfg, samples, global_batch, accumulate, clip)
    assert all(a > 0 for a in ref_aux)
    results = run_distributed(moe_layout_run, world, cfg, kwargs, samples, micro_batch, accumulate, clip)
    for r in results:
        assert len(r["losses"]) == STEPS, r["losses"]
        for got, want in zip(r["losses"], ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], ref_losses)
        for got, want in zip(r["aux"], ref_aux):
            assert abs(got - want) <= 1e-5 * abs(want), ("moe_aux_loss", r["aux"], ref_aux)
    assert_state_close(results[0]["state"], ref_state)
