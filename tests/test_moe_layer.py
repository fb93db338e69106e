"""MoE pieces: config checks, router formulas, capacity dropping, experts, and expert-parallel parity.

The expert-parallel cases run in one 4-process gloo job: EP groups of size 4 and 2, both dispatchers, dropless
and with a capacity factor; each is compared with the single-process ``MoELayer`` holding the same global
weights, applied to every EP rank's tokens (outputs, input grads, router/shared/expert weight grads).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.moe import (
    GroupedMLPExperts,
    MoEConfig,
    MoELayer,
    SequentialMLPExperts,
    TopKRouter,
    check_expert_parallel,
    expert_capacity,
    get_aux_loss_scale,
    set_aux_loss_scale,
)
from tests._dist import init_gloo, run_distributed

H, E, F_FFN = 16, 8, 12


def cfg(**kw) -> MoEConfig:
    base = dict(num_moe_experts=E, moe_ffn_hidden_size=F_FFN, moe_router_topk=2)
    base.update(kw)
    return MoEConfig(**base)


# ----------------------------------------------------------------------------------------------- config
def test_config_validation():
    with pytest.raises(ValueError, match="moe_router_topk"):
        cfg(moe_router_topk=9)
    with pytest.raises(ValueError, match="capacity_factor only works"):
        cfg(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn")
    with pytest.raises(NotImplementedError):
        cfg(moe_router_load_balancing_type="sinkhorn")
    with pytest.raises(ValueError, match="pre-softmax"):
        cfg(moe_router_topk=1)
    cfg(moe_router_topk=1, moe_router_pre_softmax=True)
    with pytest.raises(ValueError, match="sigmoid"):
        cfg(moe_router_enable_expert_bias=True)
    with pytest.raises(ValueError, match="drop_policy"):
        cfg(moe_expert_capacity_factor=1.0, moe_token_drop_policy="random")
    with pytest.raises(ValueError, match="dispatcher"):
        cfg(moe_token_dispatcher_type="flex")
    with pytest.raises(ValueError, match="divisible"):
        check_expert_parallel(cfg(), 3)
    assert check_expert_parallel(cfg(), 4) == 2


# ----------------------------------------------------------------------------------------------- router
def _ref_routing(logits, c: MoEConfig, bias=None):
    """Straightforward per-token reference of Megatron's top-k scoring."""
    T, k = logits.shape[0], c.moe_router_topk
    probs, idx = torch.zeros(T, k, dtype=logits.dtype), torch.zeros(T, k, dtype=torch.long)
    for t in range(T):
        l = logits[t]
        if c.moe_router_score_function == "softmax":
            sel_score = l.detach()
            i = sorted(range(E), key=lambda e: -float(sel_score[e]))[:k]
            if c.moe_router_pre_softmax:
                p = torch.exp(l) / torch.exp(l).sum()
                p = p[i]
            else:
                p = torch.exp(l[i]) / torch.exp(l[i]).sum()
        else:
            sc = 1 / (1 + torch.exp(-l))
            sel = sc.detach() + (bias if bias is not None else 0)
            i = sorted(range(E), key=lambda e: -float(sel[e]))[:k]
            p = sc[i] / sc[i].sum() if k > 1 else sc[i]
        probs[t], idx[t] = p, torch.tensor(i)
    return probs, idx


def _ref_aux(logits, c: MoEConfig, s, b):
    """Switch aux loss: E * coeff * sum_e f_e * P_e; seq_aux_loss: the same per sequence, averaged."""
    if c.moe_router_score_function == "softmax":
        sc = torch.softmax(logits, -1)
    else:
        sc = torch.sigmoid(logits)
        sc = sc / sc.sum(-1, keepdim=True)
    k = c.moe_router_topk

    def switch(scores):
        T = scores.shape[0]
        top = scores.topk(k, -1).indices
        f = torch.stack([(top == e).any(-1).sum() for e in range(E)]).to(scores.dtype) / (T * k)
        P = scores.mean(0)
        return E * c.moe_aux_loss_coeff * (f * P).sum()

    if c.moe_router_load_balancing_type == "aux_loss":
        return switch(sc)
    sc = sc.reshape(s, b, E)
    return sum(switch(sc[:, j]) for j in range(b)) / b


@pytest.mark.parametrize("kw", [
    dict(),
    dict(moe_router_pre_softmax=True),
    dict(moe_router_load_balancing_type="seq_aux_loss"),
    dict(moe_router_score_function="sigmoid"),
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=3),
    dict(moe_router_topk=1, moe_router_pre_softmax=True),
])
def test_router_against_reference(kw):
    torch.manual_seed(0)
    c = cfg(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, **kw)
    s, b = 6, 3
    router = TopKRouter(H, c, init_std=0.5, generator=torch.Generator().manual_seed(1)).double()
    if c.moe_router_enable_expert_bias:
        router.expert_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(s, b, H, dtype=torch.float64, requires_grad=True)
    probs, idx = router(x)
    logits = x.detach().reshape(-1, H) @ router.weight.detach().t()
    rp, ri = _ref_routing(logits, c, router.expert_bias)
    torch.testing.assert_close(idx, ri)
    torch.testing.assert_close(probs, rp)

    # aux + z losses: values, and their gradients reach the router through the side channel
    w = torch.randn_like(probs)
    (probs * w).sum().backward()
    g_side = router.weight.grad.clone()
    wr = router.weight.detach().clone().requires_grad_(True)
    lg = x.detach().reshape(-1, H) @ wr.t()
    zl = c.moe_z_loss_coeff * (torch.logsumexp(lg, -1) ** 2).mean()
    aux = _ref_aux(lg, c, s, b)
    torch.testing.assert_close(router.aux_losses["z_loss"], zl.detach())
    torch.testing.assert_close(router.aux_losses[c.moe_router_load_balancing_type], aux.detach())
    rp2, _ = _ref_routing(lg, c, router.expert_bias)
    ((rp2 * w).sum() + aux + zl).backward()
    torch.testing.assert_close(g_side, wr.grad)


def test_aux_loss_scale():
    c = cfg(moe_aux_loss_coeff=0.1)
    router = TopKRouter(H, c, init_std=0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 2, H)
    grads = []
    for scale in (1.0, 0.0):
        set_aux_loss_scale(scale)
        router.weight.grad = None
        router(x)[0].sum().backward()
        grads.append(router.weight.grad.clone())
    set_aux_loss_scale(1.0)
    assert float(get_aux_loss_scale()) == 1.0
    assert not torch.allclose(grads[0], grads[1])
    router.eval()                       # no aux losses outside training
    router(x)
    assert router.aux_losses == {}


def test_expert_bias_update():
    c = cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    r = TopKRouter(H, c)
    r.update_expert_bias(torch.tensor([5., 1., 3., 3., 0., 8., 2., 2.]))   # mean 3
    torch.testing.assert_close(r.expert_bias, torch.tensor([-1., 1., 0., 0., 1., -1., 1., 1.]) * 0.01)
    r(torch.randn(5, 2, H))
    assert float(r.local_tokens_per_expert.sum()) == 5 * 2 * 2
    r.update_expert_bias()
    assert float(r.local_tokens_per_expert.sum()) == 0


# ---------------------------------------------------------------------------------------- capacity drops
def _brute_force_drop(probs, idx, cap, policy):
    T, k = idx.shape
    keep = torch.zeros(T, k, dtype=torch.bool)
    for e in range(E):
        slots = [(t, j) for t in range(T) for j in range(k) if idx[t, j] == e]
        if policy == "probs":
            slots.sort(key=lambda tj: -float(probs[tj]))
        for t, j in slots[:cap]:
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.5])
def test_capacity_drop_policies(policy, cf):
    torch.manual_seed(3)
    T = 24
    c_free = cfg()
    c_cap = cfg(moe_expert_capacity_factor=cf, moe_token_drop_policy=policy)
    gen_w = torch.Generator().manual_seed(5)
    r_free = TopKRouter(H, c_free, init_std=0.5, generator=gen_w)
    r_cap = TopKRouter(H, c_cap)
    r_cap.load_state_dict(r_free.state_dict())
    x = torch.randn(T, 1, H)
    p0, i0 = r_free(x)
    p1, i1 = r_cap(x)
    cap = expert_capacity(T, E, 2, cf)
    assert cap == max(1, min(T, math.ceil(T * 2 / E * cf)))
    keep = _brute_force_drop(p0.detach(), i0, cap, policy)
    assert (~keep).any() or cf >= 1.5
    torch.testing.assert_close(i1, torch.where(keep, i0, -1))
    torch.testing.assert_close(p1, torch.where(keep, p0, 0.0))


# ------------------------------------------------------------------------------------------------ experts
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_vs_loop_experts(swiglu):
    torch.manual_seed(0)
    El, N = 4, 20
    counts = torch.tensor([7, 0, 9, 4])
    fc1 = 2 * F_FFN if swiglu else F_FFN
    w1, w2 = torch.randn(El, H, fc1) * 0.2, torch.randn(El, F_FFN, H) * 0.2
    x = torch.randn(N, H)
    mods = [GroupedMLPExperts(El, H, F_FFN, swiglu, w1, w2, use_grouped_mm=True),
            GroupedMLPExperts(El, H, F_FFN, swiglu, w1, w2, use_grouped_mm=False),
            SequentialMLPExperts(El, H, F_FFN, swiglu, w1, w2)]
    gy = torch.randn(N, H)
    res = []
    for m in mods:
        xi = x.clone().requires_grad_(True)
        y = m(xi, counts)
        (y * gy).sum().backward()
        if isinstance(m, SequentialMLPExperts):
            g1 = torch.stack([p.grad for p in m.fc1]); g2 = torch.stack([p.grad for p in m.fc2])
        else:
            g1, g2 = m.weight1.grad, m.weight2.grad
        res.append((y.detach(), xi.grad, g1, g2))
    if hasattr(torch, "_grouped_mm"):
        assert mods[0].last_used_grouped_mm, "torch._grouped_mm available but not used"
    for other in res[1:]:
        for a, b in zip(res[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # per-token reference
    ref = []
    for t, e in enumerate(torch.repeat_interleave(torch.arange(El), counts).tolist()):
        h = x[t] @ w1[e]
        h = F.silu(h[:F_FFN]) * h[F_FFN:] if swiglu else F.gelu(h)
        ref.append(h @ w2[e])
    torch.testing.assert_close(res[0][0], torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_single_process_layer_matches_dense_reference():
    torch.manual_seed(0)
    c = cfg(moe_shared_expert_intermediate_size=8, moe_grouped_gemm=True)
    layer = MoELayer(H, c, seed=3, init_std=0.3).double()
    x = torch.randn(5, 2, H, dtype=torch.float64)
    y = layer(x)
    probs, idx = layer.router(x)
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    xf = x.reshape(-1, H)
    ref = []
    for t in range(xf.shape[0]):
        acc = layer.shared_experts(xf[t:t + 1])[0]
        for j in range(2):
            e = int(idx[t, j])
            h = xf[t] @ w1[e]
            acc = acc + probs[t, j] * ((F.silu(h[:F_FFN]) * h[F_FFN:]) @ w2[e])
        ref.append(acc)
    torch.testing.assert_close(y.reshape(-1, H), torch.stack(ref))


# -------------------------------------------------------------------------------------- expert parallel
EP_CASES = [
    dict(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    dict(moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="seq_aux_loss",
         moe_aux_loss_coeff=0.01, moe_router_pre_softmax=True, moe_grouped_gemm=True,
         moe_shared_expert_intermediate_size=8),
    dict(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, moe_expert_capacity_factor=1.0,
         moe_token_drop_policy="probs", moe_grouped_gemm=True),
    dict(moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.01, moe_expert_capacity_factor=1.0,
         moe_token_drop_policy="position"),
    dict(moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
         moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_router_topk=3,
         moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_shared_expert_intermediate_size=8),
    dict(moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid",
         moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_grouped_gemm=True),
]


def _expert_grads(layer):
    ex = layer.experts
    if isinstance(ex, SequentialMLPExperts):
        return torch.stack([p.grad for p in ex.fc1]), torch.stack([p.grad for p in ex.fc2])
    return ex.weight1.grad, ex.weight2.grad


def _ep_worker(rank, world):
    from lightning_megatron.parallel.tensor_parallel.mappings import all_gather_dim0
    init_gloo(rank, world)
    torch.manual_seed(0)
    groups = {4: dist.new_group([0, 1, 2, 3])}
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups[2] = g2[rank // 2]
    s, b = 6, 2
    report = []
    for ci, kw in enumerate(EP_CASES):
        c = cfg(**kw)
        for ep in (2, 4):
            grp = groups[ep]
            ep_rank = dist.get_rank(grp)
            bias = torch.randn(E, generator=torch.Generator().manual_seed(ci)) * 0.3
            xs = [torch.randn(s, b, H, generator=torch.Generator().manual_seed(100 * ci + r), dtype=torch.float64)
                  for r in range(ep)]
            gs = [torch.randn(s, b, H, generator=torch.Generator().manual_seed(999 + 100 * ci + r),
                              dtype=torch.float64) for r in range(ep)]
            # reference: one process, all experts, each EP rank's tokens as its own micro-batch
            ref = MoELayer(H, c, seed=7 + ci, init_std=0.3).double()
            par = MoELayer(H, c, ep_group=grp, seed=7 + ci, init_std=0.3).double()
            if c.moe_router_enable_expert_bias:
                ref.router.expert_bias.copy_(bias); par.router.expert_bias.copy_(bias)
            ref_out, ref_xg, dropped = [], [], 0
            for r in range(ep):
                xr = xs[r].clone().requires_grad_(True)
                yr = ref(xr)
                (yr * gs[r]).sum().backward()
                ref_out.append(yr.detach()); ref_xg.append(xr.grad)
                dropped += int((ref.router(xs[r])[1] < 0).sum())
            x = xs[ep_rank].clone().requires_grad_(True)
            y = par(x)
            (y * gs[ep_rank]).sum().backward()
            name = f"case {ci} ep {ep}"
            torch.testing.assert_close(y, ref_out[ep_rank], msg=lambda m: f"{name} output: {m}")
            torch.testing.assert_close(x.grad, ref_xg[ep_rank], msg=lambda m: f"{name} input grad: {m}")
            rg = par.router.weight.grad.clone()
            dist.all_reduce(rg, group=grp)
            torch.testing.assert_close(rg, ref.router.weight.grad, msg=lambda m: f"{name} router grad: {m}")
            if par.shared_experts is not None:
                for p, q in zip(par.shared_experts.parameters(), ref.shared_experts.parameters()):
                    g = p.grad.clone(); dist.all_reduce(g, group=grp)
                    torch.testing.assert_close(g, q.grad, msg=lambda m: f"{name} shared grad: {m}")
            for gp, gr in zip(_expert_grads(par), _expert_grads(ref)):
                torch.testing.assert_close(all_gather_dim0(gp.contiguous(), grp), gr,
                                           msg=lambda m: f"{name} expert grad: {m}")
            if c.moe_expert_capacity_factor is not None:
                assert dropped > 0, f"{name}: capacity factor dropped nothing"
            report.append((ci, ep, dropped))
    return report


def test_expert_parallel_matches_single_process():
    res = run_distributed(_ep_worker, 4, timeout=120)
    assert len(res[0]) == 2 * len(EP_CASES)
