"""Contiguous parameter and gradient buffers (Megatron's ``ParamAndGradBuffer``) and the work that runs over their flat
spans: :mod:`lightning_megatron.utils.tensors` (which tensors are adjacent views), :class:`MainParams`' bucketed
buffers, :class:`PrecisionAwareAdamW` over flat runs (region-wise weight decay, step counts, loaded states), the global
norm and clip, the non-finite check and the data-parallel reduction over the buffers (gloo, 2 processes).

Every test compares against the same work done tensor by tensor on separate tensors, bit for bit, and checks that
the flat path was the one taken (how many tensors the work saw), so a layout planted wrong (a gap, a wrong region, a
count mixed up) fails here.
"""
from __future__ import annotations

import copy
from typing import List, Optional

import pytest
import torch
from torch import nn

from lightning_megatron import PrecisionAwareAdamW
from lightning_megatron.optimizer import precision_aware_adamw as paa
from lightning_megatron.parallel import grad_sync
from lightning_megatron.parallel.grad_norm import clip_grad_norm_, global_grad_norm
from lightning_megatron.parallel.param_buffer.buffer import MainParams, bucket_layout
from lightning_megatron.parallel.nonfinite import local_max_abs
from lightning_megatron.utils.tensors import adjacent_runs, coalesce, contiguous_spans, flat_run, storage_order
from tests._dist import init_gloo, run_distributed


# ---------------------------------------------------------------------------------------------- adjacent views
def test_spans_merge_exactly_the_adjacent_views():
    buf = torch.arange(20.0)
    a, b, c = buf[0:6].view(2, 3), buf[6:8], buf[8:12]
    gap = buf[13:15]                       # one element after c: not adjacent
    other = torch.zeros(3)                 # another storage
    half = torch.arange(4.0).to(torch.float16)
    spans = contiguous_spans([a, b, c, gap, other, half])
    assert [(s.start, s.stop) for s in spans] == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert spans[0].sizes == (6, 2, 4) and spans[0].flat.data_ptr() == a.data_ptr()
    assert torch.equal(spans[0].flat, buf[:12])
    # out of order: no span in list order, one in storage order
    assert len(contiguous_spans([c, a, b])) == 2
    assert [t.numel() for t in coalesce([c, a, b, other])] == [12, 3]
    # a non-contiguous view is a span of its own, kept in its shape
    t = buf[:12].view(3, 4).t()
    assert [(s.start, s.stop) for s in contiguous_spans([a, t])] == [(0, 1), (1, 2)]
    assert contiguous_spans([t])[0].flat.shape == (4, 3)


def test_adjacent_runs_cut_where_any_column_or_cut_breaks():
    p, g = torch.zeros(10), torch.zeros(10)
    ps = [p[0:2], p[2:5], p[5:10]]
    gs = [g[0:2], torch.zeros(3), g[5:10]]   # the middle gradient is a separate allocation
    assert adjacent_runs([ps, ps]) == [(0, 3)]
    assert adjacent_runs([ps, gs]) == [(0, 1), (1, 2), (2, 3)]
    assert adjacent_runs([ps, ps], cuts=[2]) == [(0, 2), (2, 3)]
    assert flat_run(ps, 1, 3).data_ptr() == p[2:].data_ptr() and flat_run(ps, 1, 3).numel() == 8


def test_storage_order_depends_on_layout_not_addresses():
    """Collectives run in this order on every rank: it must come from the list and the offsets only."""
    for _ in range(3):
        first, second = torch.zeros(8), torch.zeros(8)   # any addresses
        tensors = [second[4:8], first[0:4], second[0:4], first[4:8]]
        assert storage_order(tensors) == [2, 0, 1, 3]


# ---------------------------------------------------------------------------------------------- MainParams buffers
class Block(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.unused = nn.Linear(width, width, bias=False)   # no gradient ever

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = norm(torch.tanh(layer(x)))
        return x


def test_bucket_layout_puts_matrices_in_size_bounded_buckets_and_vectors_last():
    m = Block(width=8, depth=3)
    params = list(m.parameters())
    buckets = bucket_layout(params, bucket_size=130)   # two 8x8 weights (128 elements) per bucket
    sizes = [[p.numel() for p in b] for b in buckets]
    assert sizes == [[64, 64], [64, 64], [8] * 9]
    assert all(p.dim() < 2 for p in buckets[-1]) and all(p.dim() == 2 for b in buckets[:-1] for p in b)
    # order is kept inside each kind (the module's order)
    flat = [p for b in buckets for p in b]
    assert [id(p) for p in flat if p.dim() == 2] == [id(p) for p in params if p.dim() == 2]
    assert bucket_layout([torch.nn.Parameter(torch.zeros(10, 10))], bucket_size=5)[0][0].numel() == 100


def test_main_params_are_views_of_bucket_buffers_and_gradients_fill_per_bucket():
    torch.manual_seed(0)
    m = Block()
    main = MainParams(m, bucket_size=130)
    assert len(main.buckets) == 3
    for bucket in main.buckets:
        members = [p for p in main.params if main.buckets[main._where[id(p)][0]] is bucket]
        assert contiguous_spans([main.main_param(p) for p in members])[0].flat.data_ptr() == bucket.main.data_ptr()
        assert len(contiguous_spans([p.data for p in members])) == 1   # compute copies: one span per bucket
        assert bucket.grad is None
    m(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    assert [b.grad is not None for b in main.buckets] == [True, True, True]
    main.to_main()
    assert m.unused.weight.grad is None   # no gradient: not a zero one (the optimizer leaves it alone)
    grads = [p.grad for p in main.params if p.grad is not None]
    # buckets [layer 0, layer 1], [layer 2, unused], [9 vectors]: one span each (bucket 1's ends before the unused slot)
    spans = coalesce(grads)
    assert sorted(t.numel() for t in spans) == [64, 72, 128]
    main.to_compute()
    assert [b.grad for b in main.buckets] == [None, None, None]   # freed between steps


def test_main_gradient_equals_the_sum_of_micro_batch_gradients():
    torch.manual_seed(0)
    ref, m = Block(), Block()
    m.load_state_dict(ref.state_dict())
    main = MainParams(m, bucket_size=100)
    ref_bf16 = Block()
    ref_bf16.load_state_dict(ref.state_dict())
    ref_bf16.to(torch.bfloat16)
    xs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    want = {}
    for x in xs:
        ref_bf16.zero_grad()
        ref_bf16(x).sum().backward()
        for (n, p) in ref_bf16.named_parameters():
            if p.grad is not None:
                want[n] = want.get(n, 0) + p.grad.float()
    for x in xs:
        m(x).sum().backward()
    main.to_main()
    for n, p in m.named_parameters():
        assert (p.grad is None) == (n not in want), n
        if p.grad is not None:
            assert torch.equal(p.grad, want[n]), n


# ---------------------------------------------------------------------------------------------- optimizer runs
def _flat_problem(decays=(0.1, 0.0)):
    """Parameters that are adjacent views of one buffer, interleaved between two groups of different weight decay,
    and the same values as separate tensors."""
    torch.manual_seed(0)
    shapes = [(6, 4), (4,), (5, 3), (3,), (2, 2)]
    buf = torch.randn(sum(torch.Size(s).numel() for s in shapes))
    flat_params, offset = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        flat_params.append(nn.Parameter(buf[offset:offset + n].view(s)))
        offset += n
    separate = [nn.Parameter(p.detach().clone()) for p in flat_params]

    def groups(ps):
        return [{"params": [ps[0], ps[2], ps[4]], "weight_decay": decays[0]},
                {"params": [ps[1], ps[3]], "weight_decay": decays[1]}]
    return buf, flat_params, separate, groups


def _set_grads(params: List[nn.Parameter], grads: List[torch.Tensor], buffer: bool) -> None:
    if buffer:   # gradients as adjacent views of one buffer, as MainParams' main gradients
        g = torch.cat([x.reshape(-1) for x in grads])
        offset = 0
        for p, x in zip(params, grads):
            p.grad = g[offset:offset + x.numel()].view(x.shape)
            offset += x.numel()
    else:
        for p, x in zip(params, grads):
            p.grad = x.clone()


def _spy_lengths(monkeypatch, owner, name: str, dtype: Optional[torch.dtype] = None) -> List[int]:
    """Replace ``owner.name`` (a function taking a list of tensors first) by a spy that records each call's list
    length (only of the calls whose first list holds ``dtype`` tensors, when given); returns that record."""
    seen: List[int] = []
    original = getattr(owner, name)

    def spy(tensors, *args, **kwargs):
        if dtype is None or (tensors and tensors[0].dtype == dtype):
            seen.append(len(tensors))
        return original(tensors, *args, **kwargs)
    monkeypatch.setattr(owner, name, spy)
    return seen


def test_first_gradients_are_copied_per_bucket_and_accumulate_in_fp32(monkeypatch):
    """A step's first bf16 gradients reach the fp32 main gradients in one multi-tensor copy per bucket, once the
    bucket's gradients are all there; a bucket with a parameter that never gets one (``unused``) is copied when its
    other parameter's second micro-batch arrives, and reading a main gradient mid-step copies its bucket first. The
    main gradients equal the fp32 sums of each micro-batch's bf16 gradients exactly."""
    torch.manual_seed(0)
    m = Block(depth=3)
    main = MainParams(m, bucket_size=130)      # buckets: [l0.w, l1.w], [l2.w, unused.w], the 9 vectors
    ref = Block(depth=3).to(torch.bfloat16)
    ref.load_state_dict(m.state_dict())
    xs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    expected = {}
    for x in xs:
        ref.zero_grad(set_to_none=True)
        ref(x).square().sum().backward()
        for (name, q) in ref.named_parameters():
            if q.grad is not None:
                expected[name] = q.grad.float() if name not in expected else expected[name] + q.grad.float()
    copies = _spy_lengths(monkeypatch, torch, "_foreach_copy_", torch.float32)
    for x in xs:
        m(x).square().sum().backward()
    assert sorted(copies) == [1, 2, 9]
    params = dict(m.named_parameters())
    assert main.main_grad(params["unused.weight"]) is None
    for name, value in expected.items():
        assert torch.equal(main.main_grad(params[name]), value), name
    main.to_main()
    main.to_compute()
    copies.clear()                             # one micro-batch, then a mid-step read of the waiting bucket
    m(xs[0]).square().sum().backward()
    assert sorted(copies) == [2, 9]
    ref.zero_grad(set_to_none=True)
    ref(xs[0]).square().sum().backward()
    assert torch.equal(main.main_grad(params["layers.2.weight"]), ref.layers[2].weight.grad.float())
    assert sorted(copies) == [1, 2, 9]
    main.to_main()
    assert torch.equal(params["layers.2.weight"].grad, ref.layers[2].weight.grad.float())


def _spy_update(monkeypatch) -> List[int]:
    return _spy_lengths(monkeypatch, paa, "adamw_multi_update_")


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_update_over_flat_runs_equals_per_parameter_update(monkeypatch, moments):
    """Two groups interleaved in one buffer (weight decay per region), several steps, a parameter without gradient
    in one step (its count falls behind: it must not share a bias correction with its neighbours afterwards)."""
    buf, flat_params, separate, groups = _flat_problem()
    seen = _spy_update(monkeypatch)
    kw = dict(lr=1e-2, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    flat_opt, ref_opt = PrecisionAwareAdamW(groups(flat_params), **kw), PrecisionAwareAdamW(groups(separate), **kw)
    torch.manual_seed(1)
    for step in range(5):
        grads = [torch.randn(p.shape) for p in flat_params]
        skip = 2 if step == 1 else None   # parameter 2 (group 0) has no gradient in step 1
        for ps, buffer in ((flat_params, True), (separate, False)):
            _set_grads(ps, grads, buffer)
            if skip is not None:
                ps[skip].grad = None
        flat_opt.step()
        ref_opt.step()
        for a, b in zip(flat_params, separate):
            assert torch.equal(a.detach(), b.detach()), step
    # interleaved groups: no two members of a group are adjacent, so each parameter is a run of its own (the
    # buffers' layout keeps the groups apart: matrices and vectors in separate buckets)
    assert seen[:2] == [3, 2]
    for a in flat_params:
        assert float(flat_opt.state[a]["step"]) == (4 if a is flat_params[2] else 5)


def test_a_group_of_adjacent_parameters_is_one_run(monkeypatch):
    """One group whose parameters lie end to end: one tensor per update, whatever the number of parameters; after
    a parameter missed a step its run is cut in two (different bias corrections), and results stay exact."""
    torch.manual_seed(0)
    buf = torch.randn(40)
    flat_params = [nn.Parameter(buf[i * 8:(i + 1) * 8].view(2, 4)) for i in range(5)]
    separate = [nn.Parameter(p.detach().clone()) for p in flat_params]
    seen = _spy_update(monkeypatch)
    flat_opt = PrecisionAwareAdamW(flat_params, lr=1e-2, weight_decay=0.1, exp_avg_dtype="bf16")
    ref_opt = PrecisionAwareAdamW(separate, lr=1e-2, weight_decay=0.1, exp_avg_dtype="bf16")
    for step in range(4):
        grads = [torch.randn(2, 4) for _ in flat_params]
        for ps, buffer in ((flat_params, True), (separate, False)):
            _set_grads(ps, grads, buffer)
            if step == 1:
                ps[4].grad = None
        flat_opt.step()
        ref_opt.step()
        for a, b in zip(flat_params, separate):
            assert torch.equal(a.detach(), b.detach()), step
    assert seen[::2] == [1, 1, 2, 2]   # the flat optimizer's updates (the reference's in between)
    for key in ("exp_avg", "exp_avg_sq"):   # the moments are views of one buffer
        assert len(contiguous_spans([flat_opt.state[p][key] for p in flat_params])) == 1


def test_update_plan_is_kept_while_its_layout_holds_and_rebuilt_when_it_changes(monkeypatch):
    """The update lists are planned once and used again while nothing they were built from changed; any change (a
    different set of parameters with gradients, of the same size too; gradients no longer adjacent, or adjacent
    again; loaded states; a parameter's data swapped) plans again, and every step equals the per-parameter update."""
    torch.manual_seed(0)
    buf = torch.randn(40)
    flat_params = [nn.Parameter(buf[i * 8:(i + 1) * 8].view(2, 4)) for i in range(5)]
    separate = [nn.Parameter(p.detach().clone()) for p in flat_params]
    kw = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype="bf16")
    flat_opt, ref_opt = PrecisionAwareAdamW(flat_params, **kw), PrecisionAwareAdamW(separate, **kw)
    plans: List[int] = []
    original = PrecisionAwareAdamW._plan

    def spy(self, *args, **kwargs):
        if self is flat_opt:
            plans.append(len(args[0]))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(PrecisionAwareAdamW, "_plan", spy)
    seen = _spy_update(monkeypatch)
    # per step: (parameter without gradient, gradients as one buffer, swap a parameter's data first)
    schedule = [(None, True, False), (None, True, False), (4, True, False), (3, True, False), (None, True, False),
                (None, True, False), (None, False, False), (None, False, False), (None, True, False),
                (None, True, True), (None, True, False)]
    expected_plans = [5, 4, 4, 5, 5, 5, 5]   # steps 0, 2, 3, 4, 6, 8, 9 plan; 1, 5, 7, 10 reuse
    for step, (skip, buffer, swap) in enumerate(schedule):
        if swap:   # the first parameter moves out of the buffer (its values kept): no longer adjacent
            flat_params[0].data = flat_params[0].data.clone()
        grads = [torch.randn(2, 4) for _ in flat_params]
        for ps, opt in ((flat_params, flat_opt), (separate, ref_opt)):
            _set_grads(ps, grads, buffer)
            if skip is not None:
                ps[skip].grad = None
            opt.step()
        for a, b in zip(flat_params, separate):
            assert torch.equal(a.detach(), b.detach()), step
    assert plans == expected_plans
    # runs: one while all counts agree; then parameter 4 and parameter 3 fell behind, one step each (a run of 3 and one
    # of 2); separate gradients: runs of one; after the swap parameter 0 is a run of its own
    assert seen[::2] == [1, 1, 1, 2, 2, 2, 5, 5, 2, 3, 3]
    flat_opt.load_state_dict(copy.deepcopy(flat_opt.state_dict()))
    _set_grads(flat_params, [torch.randn(2, 4) for _ in flat_params], True)
    flat_opt.step()
    assert len(plans) == len(expected_plans) + 1


def test_loaded_state_moves_into_the_flat_layout_and_resumes_exactly(monkeypatch):
    torch.manual_seed(0)
    buf = torch.randn(24)
    params = [nn.Parameter(buf[i * 8:(i + 1) * 8]) for i in range(3)]
    opt = PrecisionAwareAdamW(params, lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    grads = [[torch.randn(8) for _ in params] for _ in range(4)]
    for gs in grads[:2]:
        _set_grads(params, gs, True)
        opt.step()
    state = copy.deepcopy(opt.state_dict())   # as through a file (torch's loading keeps ``step`` tensors as given)
    buf2 = buf.clone()
    params2 = [nn.Parameter(buf2[i * 8:(i + 1) * 8]) for i in range(3)]
    opt2 = PrecisionAwareAdamW(params2, lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    opt2.load_state_dict(state)
    assert len(contiguous_spans([opt2.state[p]["exp_avg"] for p in params2])) == 3   # loaded: separate tensors
    seen = _spy_update(monkeypatch)
    for gs in grads[2:]:
        for ps, o in ((params, opt), (params2, opt2)):
            _set_grads(ps, gs, True)
            o.step()
    assert torch.equal(buf, buf2)
    assert seen == [1, 1, 1, 1]
    assert len(contiguous_spans([opt2.state[p]["exp_avg"] for p in params2])) == 1


@pytest.mark.parametrize("fused_copy", [True, False])
def test_optimizer_on_main_params_sees_one_tensor_per_bucket(monkeypatch, fused_copy):
    """The whole path: MainParams buffers, two parameter groups (matrices decay, vectors not), one run per bucket; the
    bf16 copies are written by the update itself (``attach``), with no copy over the buckets after it, and equal
    the stepped fp32 main parameters rounded, as after the copy."""
    torch.manual_seed(0)
    m = Block(depth=4)
    del m.unused
    main = MainParams(m, bucket_size=130)
    decay = [p for p in m.parameters() if p.dim() == 2]
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    opt = PrecisionAwareAdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-2, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    if fused_copy:
        main.attach(opt)
    else:
        opt.register_step_post_hook(main.optimizer_hook)
    seen = _spy_update(monkeypatch)
    copies = _spy_lengths(monkeypatch, torch, "_foreach_copy_", torch.bfloat16)
    for _ in range(3):
        m(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
        main.to_main()
        opt.step()
        assert not main.in_main_view and all(p.dtype == torch.bfloat16 for p in m.parameters())
        for p in m.parameters():
            assert torch.equal(p.detach(), main.main_param(p).to(torch.bfloat16))
    assert seen == [2, 1] * 3   # 4 matrices in 2 buckets of 2; 12 vectors in 1 bucket
    assert copies == ([] if fused_copy else [3] * 3)   # no copy over the 3 buckets when the update wrote them


# ---------------------------------------------------------------------------------------------- norm, clip, finite
def test_norm_clip_and_finiteness_run_over_the_buffer(monkeypatch):
    torch.manual_seed(0)
    buf = torch.randn(30, dtype=torch.float64)
    params = [nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (10, 5, 15)]
    offset = 0
    for p in params:
        p.grad = buf[offset:offset + p.numel()]
        offset += p.numel()
    separate = [nn.Parameter(torch.zeros_like(p)) for p in params]
    for p, q in zip(separate, params):
        p.grad = q.grad.clone()
    seen = _spy_lengths(monkeypatch, torch, "_foreach_norm")
    norm = global_grad_norm(params, set(), None)
    assert seen == [1]
    assert torch.equal(norm, global_grad_norm(separate, set(), None))
    assert torch.allclose(norm, buf.norm(), rtol=1e-15, atol=0)
    seen.clear()
    assert float(local_max_abs([p.grad for p in params])) == float(buf.abs().max().float()) and seen == [1]
    params[1].grad[2] = float("nan")
    assert not torch.isfinite(local_max_abs([p.grad for p in params]))
    params[1].grad[2] = 0.0
    separate[1].grad[2] = 0.0
    clip_grad_norm_(params, 0.5, set(), None)
    clip_grad_norm_(separate, 0.5, set(), None)
    for p, q in zip(params, separate):
        assert torch.equal(p.grad, q.grad)
    assert abs(float(buf.norm()) - 0.5) < 1e-6
    received: list = []                         # a check that does not use per-parameter norms gets none computed
    seen.clear()
    clip_grad_norm_(params, 0.5, set(), None, check=lambda n, local: received.append(local), check_local_norms=False)
    assert received == [None] and seen == [1]
    seen.clear()
    clip_grad_norm_(params, 0.5, set(), None, check=lambda n, local: received.append(local))
    assert [p for p, _ in received[1]] == params and seen == [3]
    assert torch.allclose(torch.stack([n for _, n in received[1]]), torch.stack([p.grad.norm() for p in params]))


# ---------------------------------------------------------------------------------------------- reduction
def _reduce_run(rank: int, world: int):
    init_gloo(rank, world)
    torch.manual_seed(rank)
    buf = torch.randn(30)
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 5, 15)]
    offset = 0
    for p in params:
        p.grad = buf[offset:offset + p.numel()]
        offset += p.numel()
    separate = [nn.Parameter(torch.zeros(n)) for n in (10, 5, 15)]
    for p, q in zip(separate, params):
        p.grad = q.grad.clone()
    flattened = []
    original = grad_sync._flatten_dense_tensors
    grad_sync._flatten_dense_tensors = lambda ts: (flattened.append(len(ts)), original(ts))[1]
    try:
        grad_sync.allreduce_data_parallel_grads(params, torch.distributed.group.WORLD)
        grad_sync.allreduce_data_parallel_grads(separate, torch.distributed.group.WORLD)
    finally:
        grad_sync._flatten_dense_tensors = original
    return dict(flat=buf.clone(), separate=torch.cat([p.grad for p in separate]), flattened=flattened,
                views=all(p.grad.data_ptr() == buf.data_ptr() + 4 * o for p, o in zip(params, (0, 10, 15))))


def test_data_parallel_average_reduces_the_buffer_in_place():
    results = run_distributed(_reduce_run, world_size=2)
    values = []
    for r in range(2):
        torch.manual_seed(r)
        values.append(torch.randn(30))
    want = (values[0] + values[1]) / 2
    for r in results:
        assert torch.equal(r["flat"], r["separate"]) and torch.allclose(r["flat"], want, rtol=0, atol=1e-6)
        assert r["flattened"] == [3]   # only the separate tensors were copied into a flat buffer
        assert r["views"]              # the gradients are still views of the buffer
