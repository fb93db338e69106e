"""Mixture of experts end to end: MegatronStrategy(ep=..., etp=...) composed with TP+SP, PP, CP and DP under the
real Trainer against the single-process run of the same MoE model (dropless): loss of every optimizer step,
the logged ``moe_aux_loss``, and the final weights (1e-5 relative; float64 on the CPU, tests.parity.CPU_PRECISION). Plus: expert tensor parallelism and
capacity drops at layer level, checkpoints of expert weights, and the layout errors."""
from __future__ import annotations

from typing import Any, Dict, Optional

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
    StepLossRecorder,
    assert_state_close,
    collate,
    lightning_train_order,
    make_samples,
    new_module,
    to_reference_dtype,
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
    to_reference_dtype(module)
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


def moe_layout_run(rank, world, cfg, strategy_kwargs, samples, micro_batch, accumulate, clip, path=None):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    recorder = StepLossRecorder(accumulate, keys=("train_loss", "moe_aux_loss"))
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), STEPS, callbacks=[recorder],
                          gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    if path is not None:
        trainer.save_checkpoint(path)
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "aux": recorder.values["moe_aux_loss"], "state": state if rank == 0 else None}


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
    "ep2xcp2-seqaux": (4, dict(ep=2, cp=2), dict(moe_router_load_balancing_type="seq_aux_loss"), 1, None),
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


# ------------------------------------------------------------------ layer level: ep x etp, capacity drops
H, E = 16, 4
LAYER_CASES = [
    dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0, moe_token_drop_policy="position",
         moe_grouped_gemm=True),
    dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=8),
]


def _etp_layer_worker(rank, world):
    """ep=2 x etp=2 on 4 ranks (expert grid (edp, ep, etp) = (1, 2, 2)); every rank routes its own tokens, as
    under sequence parallelism. Reference: the single-process layer on each rank's tokens, capacity per rank."""
    init_gloo(rank, world)
    etp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_etp = dist.new_group([0, 1, 2, 3])
    etp_g, ep_g = etp_groups[rank // 2], ep_groups[rank % 2]
    s, b = 6, 2
    dropped = []
    for ci, kw in enumerate(LAYER_CASES):
        c = MoEConfig(num_moe_experts=E, moe_ffn_hidden_size=12, moe_router_topk=2, moe_aux_loss_coeff=0.01, **kw)
        xs = [torch.randn(s, b, H, generator=torch.Generator().manual_seed(10 * ci + r), dtype=torch.float64)
              for r in range(world)]
        gs = [torch.randn(s, b, H, generator=torch.Generator().manual_seed(500 + 10 * ci + r), dtype=torch.float64)
              for r in range(world)]
        ref = MoELayer(H, c, seed=3 + ci, init_std=0.3).double()
        par = MoELayer(H, c, ep_group=ep_g, etp_group=etp_g, ep_etp_group=ep_etp, seed=3 + ci, init_std=0.3).double()
        outs, xgrads, n_drop = [], [], 0
        for r in range(world):
            xr = xs[r].clone().requires_grad_(True)
            yr = ref(xr)
            (yr * gs[r]).sum().backward()
            outs.append(yr.detach())
            xgrads.append(xr.grad)
            n_drop += int((ref.router(xs[r])[1] < 0).sum())
        x = xs[rank].clone().requires_grad_(True)
        y = par(x)
        (y * gs[rank]).sum().backward()
        torch.testing.assert_close(y, outs[rank])
        torch.testing.assert_close(x.grad, xgrads[rank])
        rg = par.router.weight.grad.clone()
        dist.all_reduce(rg)
        torch.testing.assert_close(rg, ref.router.weight.grad)
        for name in ("weight1", "weight2"):
            got = par.experts.gather_global(name, getattr(par.experts, name).grad)
            torch.testing.assert_close(got, getattr(ref.experts, name).grad, msg=lambda m: f"case {ci} {name}: {m}")
            full = par.experts.gather_global(name, getattr(par.experts, name).detach())
            torch.testing.assert_close(full, getattr(ref.experts, name).detach())
        if par.shared_experts is not None:
            for p, q in zip(par.shared_experts.parameters(), ref.shared_experts.parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)
                torch.testing.assert_close(g, q.grad)
        dropped.append(n_drop)
    return dropped


def test_expert_tensor_parallel_layer_and_capacity_drops():
    """ep=2 x etp=2: outputs, input/router/expert/shared grads match one process; with a capacity factor the
    dropped (token, expert) slots are the reference's (each rank's tokens, Megatron's per-rank capacity)."""
    dropped = run_distributed(_etp_layer_worker, 4, timeout=120)[0]
    assert dropped[0] > 0 and dropped[1] > 0 and dropped[2] == 0, dropped


# ------------------------------------------------------------------ checkpoints under another layout
def _reshard_worker(rank, world, cfg, strategy_kwargs, ckpt_path):
    pl.seed_everything(SEED + 1, verbose=False)          # other initial weights: the load must overwrite them
    module = new_module(cfg, 1)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1)
    trainer.validate(module, DataLoader(ListDataset(make_samples(cfg, 4)), batch_size=2), verbose=False)
    ckpt = torch.load(ckpt_path, weights_only=True, map_location="cpu")
    trainer.strategy.load_model_state_dict(ckpt)
    state = trainer.strategy.lightning_module_state_dict()
    return state if rank == 0 else None


def test_checkpoint_reshards_experts(tmp_path):
    """A checkpoint saved under ep=2 x tp=2 (etp=2) holds the full single-process state (all experts, full ffn
    dim) and loads under ep=4 and under ep=1 x etp=1 x dp=2."""
    cfg = moe_config()
    world, kwargs, micro_batch = 4, dict(ep=2, tp=2, sequence_parallel=True), 2
    samples = make_samples(cfg, STEPS * micro_batch * 2)
    _, _, ref_state = moe_reference(cfg, samples, micro_batch * 2, 1, None)
    path = str(tmp_path / "moe.ckpt")
    run_distributed(moe_layout_run, world, cfg, kwargs, samples, micro_batch, 1, None, path)
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    assert ckpt["state_dict"]["model.decoder.layers.0.mlp.experts.weight1"].shape == (4, 32, 64)
    assert_state_close(ckpt["state_dict"], ref_state)
    opt = ckpt["optimizer_states"][0]["state"]
    assert opt["model.decoder.layers.0.mlp.experts.weight2"]["exp_avg"].shape == (4, 32, 32)
    for layout in (dict(ep=4), dict(ep=2, tp=2, etp=1, sequence_parallel=True)):
        got = run_distributed(_reshard_worker, 4, cfg, layout, path)[0]
        assert_state_close(got, ckpt["state_dict"], rtol=0.0)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs,overrides,pattern", [
    (dict(ep=3), dict(), r"num_moe_experts=4 is not divisible by ep=3"),
    (dict(ep=2, tp=2), dict(), r"tp=2 needs sequence_parallel=True"),
    (dict(ep=2), dict(num_moe_experts=None), r"ep=2 \(expert parallelism\) needs a mixture-of-experts model"),
    (dict(ep=2, etp=3), dict(), r"moe_ffn_hidden_size=32 is not divisible by etp=3"),
], ids=["experts-not-divisible", "tp-without-sp", "dense-model", "ffn-not-divisible-by-etp"])
def test_layout_errors(kwargs, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelConfig(**kwargs).validate_model(moe_config(**overrides))


@pytest.mark.parametrize("overrides,pattern", [
    (dict(moe_router_topk=5), r"moe_router_topk \(5\) must be <= num_moe_experts \(4\)"),
    (dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"),
     r"moe_expert_capacity_factor only works with load balancing types"),
    (dict(moe_layer_freq=[1, 0, 1]), r"moe_layer_freq=\[1, 0, 1\] must be an int or a 0/1 list of length num_layers=2"),
    (dict(moe_token_dispatcher_type="flex"), r"moe_token_dispatcher_type must be one of"),
], ids=["topk-gt-experts", "capacity-with-sinkhorn", "layer-freq-length", "dispatcher"])
def test_config_errors(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        moe_config(**overrides)


def test_presets():
    mixtral = GPTConfig.mixtral_8x7b()
    assert abs(mixtral.num_parameters / 1e9 - 46.7) < 0.05           # Mixtral 8x7B: 46.7B parameters
    assert GPTConfig.tiny_moe().is_moe_layer(1)
    bench = GPTConfig.mixtral_small_bench()
    assert (bench.num_moe_experts, bench.moe_router_topk, bench.hidden_size, bench.num_layers) == (8, 2, 2048, 8)
    from lightning_megatron import flops_per_token

    dense = flops_per_token(bench.replace(num_moe_experts=None))
    assert flops_per_token(bench) > dense                             # MFU counts the two routed experts
