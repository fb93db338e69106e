"""Context-parallel attention against full causal SDPA (cp=2 and cp=4, every comm type, GQA).

One spawned gloo run of 4 real processes computes every case: cp=2 uses the groups [0, 1] and [2, 3], cp=4 the
whole world; ``a2a+p2p`` at cp=4 uses inner (a2a) groups [0, 1], [2, 3] and outer (ring) groups [0, 2], [1, 3].
Every rank builds the same global q, k, v and upstream gradient, runs ``F.scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)`` on the full sequence, and the CP attention on its zigzag shard (chunks r and
2cp-1-r, cut here with index arithmetic independent of the library). The worker returns the max abs error of
the output and of dq, dk, dv per case; the tests compare in the main process.
"""
from __future__ import annotations

import shutil
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests._dist import init_gloo, run_distributed

WORLD = 4
B, S, D = 2, 16, 8  # S divisible by 2 * 4

# (name, cp, comm_type, n_q, n_kv, hierarchical sizes (inner, outer) or None, causal, dtype)
CASES = [
    ("cp2-p2p", 2, "p2p", 4, 2, None, True, torch.float64),
    ("cp2-all_gather", 2, "all_gather", 4, 2, None, True, torch.float64),
    ("cp2-a2a", 2, "a2a", 4, 2, None, True, torch.float64),
    ("cp2-a2a+p2p-1x2", 2, "a2a+p2p", 4, 2, (1, 2), True, torch.float64),
    ("cp2-a2a+p2p-2x1", 2, "a2a+p2p", 4, 2, (2, 1), True, torch.float64),
    ("cp4-p2p", 4, "p2p", 4, 2, None, True, torch.float64),
    ("cp4-p2p-mha", 4, "p2p", 4, 4, None, True, torch.float64),
    ("cp4-p2p-fp32", 4, "p2p", 4, 2, None, True, torch.float32),
    ("cp4-p2p-noncausal", 4, "p2p", 4, 2, None, False, torch.float64),
    ("cp4-all_gather", 4, "all_gather", 4, 2, None, True, torch.float64),
    ("cp4-all_gather-noncausal", 4, "all_gather", 4, 2, None, False, torch.float64),
    ("cp4-a2a", 4, "a2a", 8, 4, None, True, torch.float64),
    ("cp4-a2a+p2p-2x2", 4, "a2a+p2p", 4, 2, (2, 2), True, torch.float64),
    ("cp4-a2a-mha-fp32", 4, "a2a", 8, 8, None, True, torch.float32),
]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
#: packed sequences: documents of 3, 6, 5 and 2 tokens (borders at 3, 9, 14 cross the cp=2 chunks of 4 and the cp=4
#: chunks of 2); every float64 causal case also runs with these document ids
DOC_LENGTHS = (3, 6, 5, 2)
DOC_CASES = [c for c in CASES if c[-1] == torch.float64 and c[6]]


def _split(t: torch.Tensor, cp: int, r: int, dim: int) -> torch.Tensor:
    c = t.size(dim) // (2 * cp)
    idx = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
    return t.index_select(dim, idx)


def _groups(world: int, size: int, strided: bool = False) -> List[List[int]]:
    if strided:  # groups {j, j + size_inner, ...} for the outer ring
        step = world // size
        return [[j + i * step for i in range(size)] for j in range(step)]
    return [list(range(i, i + size)) for i in range(0, world, size)]


def _new_groups(ranks_list: List[List[int]], rank: int):
    mine = None
    for ranks in ranks_list:  # every rank creates every group
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = (g, ranks)
    return mine


def _worker(rank: int, world: int) -> Dict[str, object]:
    from lightning_megatron.parallel.context_parallel import context_parallel_attention

    init_gloo(rank, world)
    cp_groups = {2: _new_groups(_groups(world, 2), rank), 4: _new_groups(_groups(world, 4), rank)}
    # hierarchical groups: for cp=2 blocks [0,1],[2,3]; within them inner/outer of sizes (1,2) or (2,1)
    singles = _new_groups([[i] for i in range(world)], rank)
    # cp=4 with (2, 2): inner [0,1],[2,3] (= the cp=2 groups), outer [0,2],[1,3]
    outer_4 = _new_groups(_groups(world, 2, strided=True), rank)
    hier = {(2, (1, 2)): (singles, cp_groups[2]), (2, (2, 1)): (cp_groups[2], singles),
            (4, (2, 2)): (cp_groups[2], outer_4)}

    results: Dict[str, object] = {}
    # records every grouped exchange (the real one still runs): elements sent to, and received from, each peer
    exchanges: List[Dict[str, int]] = []
    real_batch = dist.batch_isend_irecv

    def recording_batch(ops):
        sent = sum(op.tensor.numel() for op in ops if op.op is dist.isend)
        received = sum(op.tensor.numel() for op in ops if op.op is dist.irecv)
        exchanges.append({"sent": sent, "received": received})
        return real_batch(ops)

    dist.batch_isend_irecv = recording_batch
    for i, (name, cp, comm, nq, nkv, sizes, causal, dtype) in enumerate(CASES):
        group, ranks = cp_groups[cp]
        r = ranks.index(rank)
        gen = torch.Generator().manual_seed(1000 + i)  # same on every rank
        q = torch.randn(B, nq, S, D, generator=gen, dtype=dtype)
        k = torch.randn(B, nkv, S, D, generator=gen, dtype=dtype)
        v = torch.randn(B, nkv, S, D, generator=gen, dtype=dtype)
        dout = torch.randn(B, nq, S, D, generator=gen, dtype=dtype)
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True)
        ref.backward(dout)
        ql, kl, vl = (_split(t, cp, r, 2).requires_grad_() for t in (q, k, v))
        kw = {}
        if sizes is not None:
            inner, outer = hier[(cp, sizes)]
            kw = dict(inner_group=inner[0], outer_group=outer[0])
        before = len(exchanges)
        out = context_parallel_attention(ql, kl, vl, group, comm_type=comm, causal=causal, **kw)
        out.backward(_split(dout, cp, r, 2))
        results.setdefault("exchanges", {})[name] = exchanges[before:]
        results.setdefault("numel", {})[name] = [t.numel() for t in (ql, kl, vl)]
        results[name] = {
            "out": (out - _split(ref.detach(), cp, r, 2)).abs().max().item(),
            "dq": (ql.grad - _split(qf.grad, cp, r, 2)).abs().max().item(),
            "dk": (kl.grad - _split(kf.grad, cp, r, 2)).abs().max().item(),
            "dv": (vl.grad - _split(vf.grad, cp, r, 2)).abs().max().item(),
        }

    # packed sequences: document ids cut like the sequence; reference: SDPA with the same-document causal mask
    docs = torch.repeat_interleave(torch.arange(len(DOC_LENGTHS)), torch.tensor(DOC_LENGTHS)).expand(B, S)
    visible = (docs[:, :, None] == docs[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    for i, (name, cp, comm, nq, nkv, sizes, causal, dtype) in enumerate(DOC_CASES):
        group, ranks = cp_groups[cp]
        r = ranks.index(rank)
        gen = torch.Generator().manual_seed(2000 + i)
        q = torch.randn(B, nq, S, D, generator=gen, dtype=dtype)
        k = torch.randn(B, nkv, S, D, generator=gen, dtype=dtype)
        v = torch.randn(B, nkv, S, D, generator=gen, dtype=dtype)
        dout = torch.randn(B, nq, S, D, generator=gen, dtype=dtype)
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=visible.unsqueeze(1), enable_gqa=True)
        ref.backward(dout)
        kw = {}
        if sizes is not None:
            inner, outer = hier[(cp, sizes)]
            kw = dict(inner_group=inner[0], outer_group=outer[0])
        local_docs = _split(docs, cp, r, 1)
        ql, kl, vl = (_split(t, cp, r, 2).requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, group, comm_type=comm, document_ids=local_docs, **kw)
        out.backward(_split(dout, cp, r, 2))
        # another second document (its values changed) leaves every other document's rows exactly as they were
        v2 = v.clone()
        v2[:, :, docs[0] == 1] += 1.0
        with torch.no_grad():
            out2 = context_parallel_attention(_split(q, cp, r, 2), _split(k, cp, r, 2), _split(v2, cp, r, 2), group,
                                              comm_type=comm, document_ids=local_docs, **kw)
        others = local_docs[0] != 1
        results["docs-" + name] = {
            "out": (out - _split(ref.detach(), cp, r, 2)).abs().max().item(),
            "dq": (ql.grad - _split(qf.grad, cp, r, 2)).abs().max().item(),
            "dk": (kl.grad - _split(kf.grad, cp, r, 2)).abs().max().item(),
            "dv": (vl.grad - _split(vf.grad, cp, r, 2)).abs().max().item(),
            "others_exact": torch.equal(out2[:, :, others], out.detach()[:, :, others]),
            "changed": None if others.all() else not torch.equal(out2[:, :, ~others], out.detach()[:, :, ~others]),
        }

    # errors (raised before any communication, identically on every rank)
    g4 = cp_groups[4][0]
    errors = {}

    def _err(key, fn):
        try:
            fn()
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)

    x = torch.randn(1, 4, 3, D)  # s_local = 3: global 12 not divisible by 8
    _err("seq", lambda: context_parallel_attention(x, x, x, g4))
    y = torch.randn(1, 4, 4, D)
    y2 = torch.randn(1, 2, 4, D)
    _err("a2a_heads", lambda: context_parallel_attention(y, y2, y2, g4, comm_type="a2a"))  # n_kv=2 vs cp=4
    _err("hier_sizes", lambda: context_parallel_attention(y, y, y, g4, comm_type="a2a+p2p",
                                                          inner_group=cp_groups[2][0], outer_group=singles[0]))
    _err("hier_missing", lambda: context_parallel_attention(y, y, y, g4, comm_type="a2a+p2p"))
    _err("bad_comm", lambda: context_parallel_attention(y, y, y, g4, comm_type="ring"))
    _err("gqa", lambda: context_parallel_attention(torch.randn(1, 3, 4, D), y2, y2, g4))
    results["errors"] = errors

    from lightning_megatron.parallel.context_parallel import zigzag_gather, zigzag_split
    t = torch.arange(3 * 16 * 2).reshape(3, 16, 2).float()
    results["gather"] = [torch.equal(zigzag_gather(zigzag_split(t, len(ranks), ranks.index(rank), 1), g, dim=1), t)
                         for g, ranks in (cp_groups[2], cp_groups[4])]
    # cp=1 (no group): plain causal attention on the local sequence
    ql = torch.randn(1, 4, 6, D, dtype=torch.float64)
    kl = torch.randn(1, 2, 6, D, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(ql, kl, kl, is_causal=True, enable_gqa=True)
    results["cp1"] = (context_parallel_attention(ql, kl, kl, None) - ref).abs().max().item()
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_full_attention(results, case):
    name, dtype = case[0], case[-1]
    for rank, res in enumerate(results):
        errs = res[name]
        for key, err in errs.items():
            assert err < TOL[dtype], f"{name} rank {rank}: {key} max abs error {err}"


@pytest.mark.parametrize("case", DOC_CASES, ids=[c[0] for c in DOC_CASES])
def test_document_masked_matches_full_attention_and_is_exact(results, case):
    """Packed sequences: documents crossing the chunk borders, every comm type; another document's values never
    reach a row (bit for bit)."""
    name = "docs-" + case[0]
    changed = [res[name]["changed"] for res in results if res[name]["changed"] is not None]
    assert changed and all(changed), (name, changed)   # the ranks holding the changed document see it
    for rank, res in enumerate(results):
        errs = dict(res[name])
        errs.pop("changed")
        assert errs.pop("others_exact"), f"{name} rank {rank}"
        for key, err in errs.items():
            assert err < TOL[torch.float64], f"{name} rank {rank}: {key} max abs error {err}"


@pytest.mark.parametrize("key,needle", [
    ("seq", "2 * 4 = 8"),
    ("a2a_heads", "key/value heads (2)"),
    ("hier_sizes", "2 (inner, a2a) x 1 (outer, p2p) = 2 must equal the context-parallel size 4"),
    ("hier_missing", "inner_group"),
    ("bad_comm", "comm_type"),
    ("gqa", "multiple of key/value heads"),
])
def test_errors(results, key, needle):
    msg = results[0]["errors"][key]
    assert msg is not None, f"{key}: no ValueError raised"
    assert needle in msg, msg


@pytest.mark.parametrize("name", ["cp2-a2a", "cp4-a2a", "cp4-a2a-mha-fp32"])
def test_a2a_exchanges_qkv_together_and_keeps_own_share(results, name):
    """One grouped exchange each way for q, k and v together (forward: q/k/v in, out back; backward: dout in,
    dq/dk/dv back), and only the peers' share travels: (cp-1)/cp of every tensor, the own share stays local."""
    for res in results:
        ex = res["exchanges"][name]
        assert len(ex) == 4, ex
        cp = 2 if name.startswith("cp2") else 4
        nq, nk, nv = res["numel"][name]
        peers = lambda n: n * (cp - 1) // cp  # noqa: E731
        assert [e["sent"] for e in ex] == [peers(nq + nk + nv), peers(nq), peers(nq), peers(nq + nk + nv)], ex
        assert [e["received"] for e in ex] == [e["sent"] for e in ex], ex


def test_zigzag_gather_inverts_split(results):
    assert all(all(r["gather"]) for r in results)


def test_no_group_is_local_attention(results):
    assert results[0]["cp1"] < 1e-12


def test_zigzag_split_positions_and_error():
    from lightning_megatron.parallel.context_parallel import zigzag_positions, zigzag_split

    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    t = torch.arange(24).reshape(2, 12)
    assert torch.equal(zigzag_split(t, 3, 2, dim=1), _split(t, 3, 2, 1))
    assert torch.equal(zigzag_split(t, 1, 0, dim=1), t)
    with pytest.raises(ValueError, match=r"\(12\) must be divisible by .*2 \* 4 = 8"):
        zigzag_split(t, 4, 0, dim=1)



def _merge_reference(o, l, blk, blk_l):
    """The log-sum-exp merge in float64."""
    o, l, blk, blk_l = (t.double() for t in (o, l, blk, blk_l))
    new = torch.logaddexp(l, blk_l)
    return o * torch.exp(l - new).unsqueeze(-1) + blk * torch.exp(blk_l - new).unsqueeze(-1), new


def _merge_inputs():
    """A bf16 output held as the model's ``[s, b, n, d]`` activations viewed as ``[b, n, s, d]`` (strided), its
    float32 lse, and a bf16 block with its lse for the second half of the rows."""
    g = torch.Generator().manual_seed(3)
    out = torch.randn(8, 1, 4, 16, generator=g).bfloat16().permute(1, 2, 0, 3)
    lse = torch.randn(1, 4, 8, generator=g)
    blk = torch.randn(1, 4, 4, 16, generator=g).bfloat16()
    blk_lse = torch.randn(1, 4, 4, generator=g)
    return out, lse, blk, blk_lse


def test_merge_into_half_type_output_rounds_once():
    """At cp=2 the ring keeps its output in the kernels' bf16 (``_accumulator_dtype``): the one merge computes in
    float32 and rounds once, so it equals the float64 merge rounded to bf16 (up to float32 round-off) and leaves
    the other rows alone."""
    from lightning_megatron.parallel.context_parallel.ring import _accumulator_dtype, _merge

    out, lse, blk, blk_lse = _merge_inputs()
    before = out.clone()
    want_o, want_l = _merge_reference(out[:, :, 4:], lse[:, :, 4:], blk, blk_lse)
    _merge(out, lse, slice(4, None), blk, blk_lse, compile_merge=True)  # CPU: eager whatever the option
    assert torch.equal(out[:, :, :4], before[:, :, :4])
    assert (out[:, :, 4:].double() - want_o.bfloat16().double()).abs().max() <= 2 ** -8 * want_o.abs().max()
    assert (lse[:, :, 4:].double() - want_l).abs().max() < 1e-6
    q = torch.empty(1, dtype=torch.bfloat16)
    assert _accumulator_dtype(q, 2, fused=True) == torch.bfloat16  # one merge: exact in bf16
    assert _accumulator_dtype(q, 4, fused=True) == torch.float32  # several: float32 accumulators
    assert _accumulator_dtype(q, 2, fused=False) == torch.float32  # the math path returns float32 blocks


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler for inductor")
def test_compiled_merge_writes_strided_views_like_eager():
    """The fused kernel the ring uses on CUDA is ``torch.compile(_merge_rows)``; compiled here on CPU it must write
    into a strided row slice exactly as the eager ops do."""
    from lightning_megatron.parallel.context_parallel.ring import _merge_rows

    out, lse, blk, blk_lse = _merge_inputs()
    eager_o, eager_l = out.clone(), lse.clone()
    _merge_rows(eager_o[:, :, 4:], eager_l[:, :, 4:], blk, blk_lse)
    compiled = torch.compile(_merge_rows, dynamic=False, fullgraph=True)
    comp_o, comp_l = out.permute(2, 0, 1, 3).clone().permute(1, 2, 0, 3), lse.clone()  # same strided layout
    compiled(comp_o[:, :, 4:], comp_l[:, :, 4:], blk, blk_lse)
    assert torch.equal(comp_o[:, :, :4], out[:, :, :4])
    assert (comp_o.float() - eager_o.float()).abs().max() <= 2 ** -8 * eager_o.float().abs().max()
    assert (comp_l - eager_l).abs().max() < 1e-6


def _odd_ring_worker(rank: int, world: int) -> Dict[str, float]:
    """cp=3 (an odd ring: the backward's K/V shifts and accumulator hand-offs differ from cp=2 and cp=4), causal
    and not, GQA, float64: local outputs and q/k/v grads against full attention."""
    from lightning_megatron.parallel.context_parallel import context_parallel_attention

    init_gloo(rank, world)
    errs: Dict[str, float] = {}
    for causal in (True, False):
        gen = torch.Generator().manual_seed(77)
        q, k, v = (torch.randn(B, n, 12, D, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
        dout = torch.randn(B, 4, 12, D, generator=gen, dtype=torch.float64)
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True).backward(dout)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ql, kl, vl = (_split(t, world, rank, 2).requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, dist.group.WORLD, causal=causal)
        out.backward(_split(dout, world, rank, 2))
        for name, got, want in (("out", out, ref), ("dq", ql.grad, qf.grad), ("dk", kl.grad, kf.grad),
                                ("dv", vl.grad, vf.grad)):
            errs[f"{name}-causal={causal}"] = (got - _split(want.detach(), world, rank, 2)).abs().max().item()
    return errs


def test_odd_ring_cp3_matches_full_attention():
    for rank, errs in enumerate(run_distributed(_odd_ring_worker, 3, timeout=120)):
        for key, err in errs.items():
            assert err < 1e-10, f"cp3 rank {rank}: {key} max abs error {err}"


@pytest.mark.parametrize("dtype,last", [(torch.bfloat16, 8), (torch.float32, 6), (torch.bfloat16, 6), (torch.float64, 4)])
def test_a2a_word_copy_is_bit_exact_on_strided_views(dtype, last):
    """The a2a's head gather/scatter copies strided views as 8-byte words where the layout allows (bf16 with a
    last dim divisible by 4, fp32 by 2) and falls back to the plain copy otherwise; the bits are the same."""
    from lightning_megatron.parallel.context_parallel.ulysses import _copy, _word_view

    src = torch.randn(6, 2, 4, last).to(dtype)
    src.view(-1)[::7] = float("nan")  # NaN payloads must survive too
    dst = torch.zeros(6, 2, 8, last, dtype=dtype)
    _copy(dst[:, :, 2:6], src)
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    assert torch.equal(dst[:, :, 2:6].contiguous().view(as_int), src.view(as_int))
    assert dst[:, :, :2].abs().sum() == 0 and dst[:, :, 6:].abs().sum() == 0
    if src.element_size() < 8:  # 8-byte elements are words already
        assert _word_view(dst[:, :, 2:6], 8 // src.element_size()) == (last % (8 // src.element_size()) == 0)
