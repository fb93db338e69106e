"""a2a context parallelism with overlapped exchanges (``MegatronStrategy(overlap_cp_a2a=True)``): in real gloo runs
of the GPT model the loss and every gradient equal the plain a2a path's, at cp=2 and cp=4 (GQA), and the own
heads' projection backward runs while the reverse exchange is in flight. End-to-end training parity under
the strategy is in ``tests/test_parity_cp.py`` (the ``*-overlap`` cases)."""
from __future__ import annotations

import functools
from typing import Dict, List

import pytest

from tests._dist import init_gloo, run_distributed
from tests.parity import model_loss_and_grads, tiny_config, zigzag_batch


def _worker(rank: int, world: int) -> Dict[str, object]:
    import torch.distributed as dist

    from lightning_megatron.models.gpt import SelfAttention
    from lightning_megatron.parallel.context_parallel import a2a_overlap, context_parallel_attention

    init_gloo(rank, world)
    cfg = tiny_config(num_attention_heads=8, num_query_groups=4, seq_length=16)
    events: List[str] = []
    real_launch, real_wait, real_project = a2a_overlap.Exchange.launch, a2a_overlap.Exchange.wait, \
        SelfAttention._project_heads
    calls = [0]

    def launch(self, ops, buffers):
        events.append("launch")
        return real_launch(self, ops, buffers)

    def wait(self):
        events.append("wait")
        return real_wait(self)

    def project(self, x, w, b, rotary):  # peers' heads first, then my own: the world-th call of a layer is mine
        calls[0] += 1
        mine = calls[0] % world == 0
        events.append("project:" + ("own" if mine else "peer"))
        x = x.view_as(x)  # this projection's own input node: its hook fires right after the projection's backward
        x.register_hook(lambda g: events.append("grad:" + ("own" if mine else "peer")))
        return real_project(self, x, w, b, rotary)

    a2a_overlap.Exchange.launch, a2a_overlap.Exchange.wait, SelfAttention._project_heads = launch, wait, project
    batch = zigzag_batch(cfg, world, rank)
    attention = functools.partial(context_parallel_attention, group=dist.group.WORLD, comm_type="a2a")
    out = {}
    for overlap in (False, True):
        events.clear()
        overlap_group = (lambda layer: dist.group.WORLD) if overlap else None
        loss, grads = model_loss_and_grads(
            cfg, batch, lambda model: model.set_context_parallel(lambda layer: attention, None, overlap_group))
        out[overlap] = (loss, grads, list(events))
    grads_plain, grads_overlap = out[False][1], out[True][1]
    worst = max((grads_overlap[n] - grads_plain[n]).abs().max().item() for n in grads_plain)
    return {"loss": (out[False][0], out[True][0]), "worst": worst, "events": out[True][2],
            "events_plain": out[False][2]}


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def run(request):
    return request.param, run_distributed(_worker, request.param, timeout=300)


def test_loss_and_gradients_equal_the_plain_a2a_path(run):
    _, results = run
    for r in results:
        plain, overlapped = r["loss"]
        assert abs(plain - overlapped) <= 1e-6 * abs(plain), r["loss"]
        assert r["worst"] < 1e-6, r["worst"]


def test_own_heads_are_computed_while_the_peers_travel(run):
    """Forward, per layer: the peers' heads are projected and launched, my own projected while they travel, then
    waited for; then the output exchange. Backward, per layer (last first): the output's reverse exchange; then
    the q/k/v reverse exchange, during which my own heads' projection backward runs (``grad:own``), the peers'
    after it arrives."""
    world, results = run
    layer_forward = ["project:peer"] * (world - 1) + ["launch", "project:own", "wait", "launch", "wait"]
    layer_backward = ["launch", "wait", "launch", "grad:own", "wait"] + ["grad:peer"] * (world - 1)
    for r in results:
        assert r["events_plain"] == []
        assert r["events"] == layer_forward * 2 + layer_backward * 2, " ".join(r["events"])


@pytest.mark.parametrize("kwargs", [dict(cp=2), dict(cp=1, cp_comm_type="a2a"), dict(cp=2, tp=2, cp_comm_type="a2a"),
                                    dict(cp=2, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 1]),
                                    dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=True)])
def test_strategy_refuses_overlap_without_a_plain_a2a_layer_at_tp1(kwargs):
    from lightning_megatron import MegatronStrategy

    with pytest.raises(ValueError, match=r"overlap_cp_a2a=True .* needs cp > 1 with cp_comm_type 'a2a' .*; got cp="):
        MegatronStrategy(overlap_cp_a2a=True, **kwargs)


def _carveout_worker(rank: int, world: int) -> Dict[str, object]:
    import os

    import torch
    import torch.distributed as dist

    from lightning_megatron.models.gpt import SelfAttention
    from lightning_megatron.parallel.context_parallel import context_parallel_attention
    from lightning_megatron.parallel.context_parallel.sm_carveout import SM_CARVEOUT_ENV

    init_gloo(rank, world)
    os.environ[SM_CARVEOUT_ENV] = "4"
    cfg = tiny_config(num_attention_heads=8, num_query_groups=4, seq_length=16)
    seen: List[tuple] = []
    real_project = SelfAttention._project_heads
    calls = [0]

    def project(self, x, w, b, rotary):  # records the carveout when each projection and its backward are launched
        calls[0] += 1
        who = "own" if calls[0] % world == 0 else "peer"
        seen.append(("forward", who, torch._C._get_sm_carveout_experimental()))
        x = x.view_as(x)
        x.register_hook(lambda g: seen.append(("backward", who, torch._C._get_sm_carveout_experimental())))
        return real_project(self, x, w, b, rotary)

    SelfAttention._project_heads = project
    attention = functools.partial(context_parallel_attention, group=dist.group.WORLD, comm_type="a2a")
    model_loss_and_grads(cfg, zigzag_batch(cfg, world, rank),
                         lambda model: model.set_context_parallel(lambda layer: attention, None,
                                                                  lambda layer: dist.group.WORLD))
    return {"seen": seen, "after": torch._C._get_sm_carveout_experimental()}


def test_sm_carveout_covers_exactly_the_overlapped_gemms():
    """With ``LIGHTNING_MEGATRON_CP_SM_CARVEOUT`` the own heads' projections (forward and backward, launched while
    an exchange is in flight) run under the carveout; the peers' projections (before the launch / after the wait)
    and everything after the step run without it."""
    for result in run_distributed(_carveout_worker, 2, timeout=300):
        seen = result["seen"]
        assert {who for _, who, _ in seen} == {"own", "peer"} and {d for d, _, _ in seen} == {"forward", "backward"}
        for direction, who, carveout in seen:
            assert carveout == (4 if who == "own" else None), (direction, who, carveout)
        assert result["after"] is None


def test_sm_carveout_env_is_checked(monkeypatch):
    from lightning_megatron.parallel.context_parallel.sm_carveout import SM_CARVEOUT_ENV, sm_carveout_from_env

    monkeypatch.setenv(SM_CARVEOUT_ENV, "lots")
    with pytest.raises(ValueError, match="LIGHTNING_MEGATRON_CP_SM_CARVEOUT='lots': expected a number of SMs"):
        sm_carveout_from_env()
    monkeypatch.setenv(SM_CARVEOUT_ENV, "16")
    assert sm_carveout_from_env() == 16
    monkeypatch.delenv(SM_CARVEOUT_ENV)
    assert sm_carveout_from_env() is None and sm_carveout_from_env(16) == 16


def test_a_zero_carveout_window_leaves_the_setting_alone():
    import torch

    from lightning_megatron.parallel.context_parallel.sm_carveout import CarveoutWindow

    for sm, inside in ((0, None), (8, 8)):
        window = CarveoutWindow(sm)
        window.open()
        assert torch._C._get_sm_carveout_experimental() == inside
        window.close()
        assert torch._C._get_sm_carveout_experimental() is None
