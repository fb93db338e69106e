"""Delayed weight-gradient GEMMs (``MegatronStrategy(delay_wgrad_compute=True)``): the linear wrapper against
``nn.Linear``, and in a real 2-process gloo cp=2 a2a run of the GPT model, the same gradients as without delay,
with the delayed GEMMs run while the backward exchanges are in flight. End-to-end training parity under the
strategy is in ``tests/test_parity_cp.py`` (the ``*-delay-wgrad`` cases)."""
from __future__ import annotations

import functools
from typing import Dict, List

import pytest
import torch
from torch import nn

from lightning_megatron.parallel.deferred_wgrad import DeferredWgrad
from tests._dist import init_gloo, run_distributed
from tests.parity import model_loss_and_grads, tiny_config, zigzag_batch


def _grads(module: nn.Module, x: torch.Tensor, deferred: bool):
    x = x.clone().requires_grad_()
    wgrad = DeferredWgrad([module]) if deferred else None
    out = wgrad.linear(module, x) if deferred else module(x)
    (out.float() ** 2).sum().backward()
    return out, x.grad, wgrad


def test_delayed_linear_matches_nn_linear():
    torch.manual_seed(0)
    lin = nn.Linear(6, 5, dtype=torch.float64)
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    out, gx, _ = _grads(lin, x, deferred=False)
    want_w, want_b = lin.weight.grad.clone(), lin.bias.grad.clone()
    lin.zero_grad(set_to_none=True)
    out2, gx2, wgrad = _grads(lin, x, deferred=True)
    assert torch.equal(out, out2) and torch.allclose(gx, gx2, rtol=0, atol=1e-12)
    assert torch.allclose(lin.bias.grad, want_b, rtol=0, atol=1e-12)  # the bias gradient is not delayed
    assert lin.weight.grad is None and wgrad.pending_flops() == 2 * 4 * 3 * 5 * 6
    (gw,) = wgrad.grads()
    assert torch.allclose(gw, want_w, rtol=0, atol=1e-12) and wgrad.pending_flops() == 0
    assert wgrad.grads() == (None,)  # handed out once


def test_delayed_linear_under_autocast_matches_nn_linear():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _, _ = _grads(lin, x, deferred=False)
        want = lin.weight.grad.clone()
        lin.zero_grad(set_to_none=True)
        out2, _, wgrad = _grads(lin, x, deferred=True)
    assert out2.dtype == torch.bfloat16 and torch.equal(out, out2)
    (gw,) = wgrad.grads()
    assert gw.dtype == torch.float32 and torch.allclose(gw, want, rtol=1e-2, atol=1e-2)


def test_only_plain_trainable_linears_are_delayed():
    frozen, plain = nn.Linear(4, 4), nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)

    class Sub(nn.Linear):
        pass

    wgrad = DeferredWgrad([frozen, plain, Sub(4, 4)])
    assert wgrad.weights == [plain.weight]
    x = torch.randn(2, 4, requires_grad=True)
    wgrad.linear(frozen, x).sum().backward()  # runs as usual: nothing pending
    assert wgrad.pending_flops() == 0 and frozen.bias.grad is not None
    with torch.no_grad():
        wgrad.linear(plain, x)
    assert wgrad.pending_flops() == 0


def _worker(rank: int, world: int) -> Dict[str, object]:
    import torch.distributed as dist

    from lightning_megatron.parallel.context_parallel import context_parallel_attention, ulysses
    from lightning_megatron.parallel.deferred_wgrad import DeferredWgrad as DW

    init_gloo(rank, world)
    cfg = tiny_config(num_attention_heads=4, num_query_groups=4)
    events: List[str] = []
    real_exchange, real_run = ulysses._exchange, DW.run

    def exchange(ops):
        events.append("exchange")
        return real_exchange(ops)

    def run(self, max_gemms=None):
        events.append(f"run:{max_gemms}:{len(self._pending)}:{torch._C._get_sm_carveout_experimental()}")
        return real_run(self, max_gemms)

    ulysses._exchange, DW.run = exchange, run
    batch = zigzag_batch(cfg, world, rank)
    # the GEMMs run while an exchange is in flight leave 4 SMs to it (an explicit carveout applies on CPU too)
    attention = functools.partial(context_parallel_attention, group=dist.group.WORLD, comm_type="a2a", sm_carveout=4)
    grads = {}
    for delay in (False, True):
        events.clear()
        delay_for = (lambda layer: True) if delay else None
        _, grads[delay] = model_loss_and_grads(
            cfg, batch, lambda model: model.set_context_parallel(lambda layer: attention, delay_for))
    worst = max((grads[True][n] - grads[False][n]).abs().max().item() for n in grads[False])
    delayed = [n for n in grads[True] if any(k in n for k in ("linear_proj.weight", "linear_fc1.weight",
                                                               "linear_fc2.weight"))]
    return {"worst": worst, "events": list(events), "delayed": delayed,
            "all_grads": all(v is not None for v in grads[True].values())}


@pytest.fixture(scope="module")
def cp2_run():
    return run_distributed(_worker, 2, timeout=300)


def test_model_gradients_unchanged_by_delay(cp2_run):
    for r in cp2_run:
        assert r["all_grads"] and len(r["delayed"]) == 3 * 2  # proj, fc1, fc2 of both layers
        assert r["worst"] < 1e-6, r["worst"]


def test_delayed_gemms_run_while_backward_exchanges_are_in_flight(cp2_run):
    """Forward: two exchanges per layer and no GEMM. Backward, per layer (last layer first): the ``dout``
    exchange, then the smallest pending GEMM (linear_proj's) while it travels; the ``dq, dk, dv`` exchange, then
    the other two (the MLP's), both under the SM carveout. Finally :meth:`grads` finds nothing left (after the
    wait: no carveout)."""
    per_layer_backward = ["exchange", "run:1:3:4", "exchange", "run:None:2:4", "run:None:0:None"]
    for r in cp2_run:
        assert r["events"] == ["exchange"] * 4 + per_layer_backward * 2, r["events"]


@pytest.mark.parametrize("kwargs", [dict(cp=2), dict(cp=1, cp_comm_type="a2a"), dict(cp=2, tp=2, cp_comm_type="a2a"),
                                    dict(cp=2, cp_comm_type=["p2p", "all_gather"])])
def test_strategy_refuses_delay_without_an_a2a_layer_at_tp1(kwargs):
    from lightning_megatron import MegatronStrategy

    with pytest.raises(ValueError, match=r"needs cp > 1 with cp_comm_type 'a2a' or 'a2a\+p2p' and tp=1; got cp="):
        MegatronStrategy(delay_wgrad_compute=True, **kwargs)


def test_apply_cp_delays_only_the_a2a_layers():
    from lightning_megatron import ParallelConfig
    from lightning_megatron.parallel.context_parallel.apply import apply_cp

    class Recorder(nn.Module):
        supports_delayed_wgrad = True

        def set_context_parallel(self, attention_for_layer, delay_wgrad_for_layer=None):
            self.delays = [delay_wgrad_for_layer(i) for i in range(3)]

    model = Recorder()
    config = ParallelConfig(cp=2, cp_comm_type=["p2p", "a2a", "a2a"], delay_wgrad_compute=True)
    assert apply_cp([model], None, config) is True   # the mesh is only read when an attention is built
    assert model.delays == [False, True, True]


def test_attention_refuses_wgrad_without_a2a():
    from lightning_megatron.parallel.context_parallel import context_parallel_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="comm_type must be 'a2a' or 'a2a\\+p2p' with cp > 1, got comm_type='p2p', cp=1"):
        context_parallel_attention(q, q, q, None, wgrad=DeferredWgrad([]))


@pytest.mark.parametrize("kwargs, on", [
    (dict(cp=2, cp_comm_type="a2a"), True),
    (dict(cp=2, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 1]), True),
    (dict(cp=2, cp_comm_type=["p2p", "a2a"]), True),
    (dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=False), False),
    (dict(cp=2, tp=2, cp_comm_type="a2a"), False),
    (dict(cp=2), False),
    (dict(cp=1), False),
])
def test_delay_is_on_by_default_where_it_applies(kwargs, on):
    from lightning_megatron import MegatronStrategy

    assert MegatronStrategy(**kwargs).delay_wgrad_compute is on


def test_automatic_delay_only_reaches_models_that_declare_it():
    """The automatic delay_wgrad_compute applies to models declaring ``supports_delayed_wgrad`` (the
    ContextParallelModel contract); an explicit True applies to every context-parallel model."""
    from lightning_megatron import GPTModel, ParallelConfig
    from lightning_megatron.contract import ContextParallelModel
    from lightning_megatron.parallel.context_parallel.apply import resolve_delay_wgrad

    class OwnModel(nn.Module):
        supports_delayed_wgrad = False

        def set_context_parallel(self, attention_for_layer, delay_wgrad_for_layer=None):
            pass

    gpt, own = GPTModel(tiny_config()), OwnModel()
    assert isinstance(gpt, ContextParallelModel) and isinstance(own, ContextParallelModel)
    assert not isinstance(nn.Linear(2, 2), ContextParallelModel)
    auto = ParallelConfig(cp=2, cp_comm_type="a2a")
    assert resolve_delay_wgrad(auto, [gpt]) and not resolve_delay_wgrad(auto, [own])
    assert not resolve_delay_wgrad(auto, [gpt, own])
    assert resolve_delay_wgrad(ParallelConfig(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True), [own])
    assert not resolve_delay_wgrad(ParallelConfig(cp=2, cp_comm_type="p2p"), [gpt])


def test_sm_carveout_default_is_16_on_cuda_only():
    from lightning_megatron.parallel.context_parallel.sm_carveout import DELAYED_WGRAD_SM_CARVEOUT, resolve_sm_carveout

    assert resolve_sm_carveout(None) == (DELAYED_WGRAD_SM_CARVEOUT if torch.cuda.is_available() else None)
    assert DELAYED_WGRAD_SM_CARVEOUT == 16 and resolve_sm_carveout(0) == 0 and resolve_sm_carveout(8) == 8


def test_a_zero_carveout_window_leaves_the_setting_alone():
    from lightning_megatron.parallel.context_parallel.sm_carveout import carveout_window

    for sm, inside in ((0, None), (8, 8)):
        with carveout_window(sm):
            assert torch._C._get_sm_carveout_experimental() == inside
        assert torch._C._get_sm_carveout_experimental() is None


def _strategy_options_worker(rank: int, world: int) -> Dict[str, object]:
    """One optimizer step under ``MegatronStrategy(cp=2, cp_comm_type=["p2p", "a2a"], cp_*=...)``, recording what
    reaches the kernels: the block-kernel choice, the ring merge's ``compile_merge`` (layer 0, p2p) and the SM
    carveout in force while the delayed weight-gradient GEMMs run (layer 1, a2a)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.parallel.context_parallel import kernels, ring
    from lightning_megatron.parallel.deferred_wgrad import DeferredWgrad as DW
    from tests.parity import ListDataset, make_samples, new_module, trainer_for

    seen = {"kernel": set(), "compile_merge": set(), "carveout": set()}
    real_block_kernel, real_merge, real_run = kernels.block_kernel, ring._merge, DW.run

    def block_kernel(q, mask_kind, sq, sk, kernel="auto"):
        seen["kernel"].add(kernel)
        return real_block_kernel(q, mask_kind, sq, sk, kernel)

    def merge(out, lse, rows, blk_out, blk_lse, compile_merge):
        seen["compile_merge"].add(compile_merge)
        return real_merge(out, lse, rows, blk_out, blk_lse, compile_merge)

    def run(self, max_gemms=None):
        if self._pending:  # a call with GEMMs left, i.e. inside an exchange (grads() runs none)
            seen["carveout"].add(torch._C._get_sm_carveout_experimental())
        return real_run(self, max_gemms)

    kernels.block_kernel, ring._merge, DW.run = block_kernel, merge, run
    cfg = tiny_config(num_attention_heads=4, num_query_groups=4)
    pl.seed_everything(0, verbose=False)
    strategy = MegatronStrategy(cp=2, cp_comm_type=["p2p", "a2a"], cp_attention_kernel="math", cp_compile_merge=False,
                                cp_sm_carveout=4)
    trainer = trainer_for(world, strategy, 1)
    trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(make_samples(cfg, 2)), batch_size=2))
    return seen


def test_strategy_passes_its_cp_kernel_options_to_the_attention():
    for seen in run_distributed(_strategy_options_worker, 2, timeout=300):
        assert seen == {"kernel": {"math"}, "compile_merge": {False}, "carveout": {4}}, seen


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_attention_kernel="fast"),
     r"cp_attention_kernel='fast' is not one of \('auto', 'cudnn', 'flash', 'math'\)"),
    (dict(cp_compile_merge="0"), r"cp_compile_merge='0' must be True \(compile .*\) or False"),
    (dict(cp_sm_carveout=-1), r"cp_sm_carveout=-1 must be None \(the default: 16 SMs on CUDA\), 0 \(no carveout\)"),
    (dict(cp_sm_carveout="16"), r"cp_sm_carveout='16' must be None"),
    (dict(cp_sm_carveout=True), r"cp_sm_carveout=True must be None"),
])
def test_cp_kernel_options_are_validated(kwargs, message):
    from lightning_megatron import MegatronStrategy, ParallelConfig

    with pytest.raises(ValueError, match=message):
        ParallelConfig(cp=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(cp=2, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention_kernel="cuDNN"), r"attention_kernel='cuDNN' is not one of"),
    (dict(compile_merge=None), r"compile_merge=None must be True"),
    (dict(sm_carveout=2.5), r"sm_carveout=2.5 must be None"),
])
def test_attention_validates_its_kernel_options(kwargs, message):
    from lightning_megatron.parallel.context_parallel import context_parallel_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, q, q, None, **kwargs)


def test_strategy_names_the_removed_overlap_option():
    from lightning_megatron import MegatronStrategy

    with pytest.raises(ValueError, match="overlap_cp_a2a was removed: .* measured no gain"):
        MegatronStrategy(cp=2, cp_comm_type="a2a", overlap_cp_a2a=True)
