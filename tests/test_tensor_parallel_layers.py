"""Tensor-parallel layers against plain modules holding the same global weights (tp=2 and tp=4, +/- SP).

One spawned gloo run of 4 real processes computes every case: tp=2 uses the two TP groups [0, 1] and
[2, 3] of a ``ParallelMesh(ParallelConfig(tp=2))``, tp=4 the whole world. Every rank builds the same global
weights, input and upstream gradient, runs the plain reference (``F.linear`` / ``F.embedding`` /
``F.cross_entropy``) on the full tensors and the parallel layer on its shard (the sequence-parallel input is
the full ``[s, b, h]`` input split along dim 0), and returns (parallel, reference) pairs: outputs and the
gradients of inputs, weights and biases. The reference shards are cut with index arithmetic written here,
independently of the library's ``shard_tensor``. The tests then compare them in the main process.

``apply_tp`` with a user plan is checked the same way on a model that is not a GPT: a stack of residual MLP
blocks whose ``up`` / ``down`` linears are named to ``ColumnParallelStyle`` / ``RowParallelStyle`` by pattern.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from tests._dist import init_gloo, run_distributed

WORLD = 4
S, B, H, OUT = 8, 2, 32, 48  # OUT is divisible by 2 * 4 (stride 2 at tp=4)
VOCAB = 50  # padded to 64 at tp=2 and tp=4 (multiple of 8 * tp): the last rank holds padding rows
DIVISIBLE_BY = 8
TPS = (2, 4)
FP32 = dict(rtol=1e-5, atol=1e-5)

COLUMN_VARIANTS = {
    "bias": dict(bias=True, stride=1, gather_output=False),
    "stride2": dict(bias=True, stride=2, gather_output=False),
    "gather_output": dict(bias=False, stride=1, gather_output=True),
    # Megatron's memory-saving backward: keep the local input shard and all-gather it again in backward
    "regather": dict(bias=True, stride=1, gather_output=False, recompute_input_gather=True),
}


def _ids(prefix: str, variants) -> List[str]:
    return [f"{prefix}-tp{tp}-{'sp' if sp else 'nosp'}" + (f"-{v}" if v else "")
            for tp in TPS for sp in (False, True) for v in variants]


COLUMN_CASES = _ids("column", COLUMN_VARIANTS)
COLUMN_BF16_CASES = _ids("column_bf16", [""])
ROW_CASES = _ids("row", ["bias", "nobias"])
PLAN_CASES = _ids("plan", [""])
EMBEDDING_CASES = _ids("embedding", [""])
CE_CASES = [f"ce-tp{tp}" for tp in TPS] + [f"ce-tp{tp}-bf16" for tp in TPS]
CE_FP64_CASES = [f"ce-tp{tp}-fp64" for tp in TPS]


def _cols(n: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """Indices of rank's slice of a dim of size n cut into ``stride`` blocks, each split in tp pieces."""
    block, per = n // stride, n // stride // tp
    return torch.cat([torch.arange(j * block + rank * per, j * block + (rank + 1) * per) for j in range(stride)])


def _rows(n: int, tp: int, rank: int) -> slice:
    per = n // tp
    return slice(rank * per, (rank + 1) * per)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _column_cases(group, tp: int, rank: int, out: Dict[str, Dict[str, Tuple]]) -> None:
    from lightning_megatron.parallel.tensor_parallel import ColumnParallelLinear

    for sp in (False, True):
        for i, (vname, v) in enumerate(COLUMN_VARIANTS.items()):
            case = f"column-tp{tp}-{'sp' if sp else 'nosp'}-{vname}"
            g = torch.Generator().manual_seed(100 * i + 10 * tp + sp)
            w, b = torch.randn(OUT, H, generator=g), torch.randn(OUT, generator=g)
            x, up = torch.randn(S, B, H, generator=g), torch.randn(S, B, OUT, generator=g)
            # reference
            w_ref, b_ref, x_ref = _leaf(w), _leaf(b), _leaf(x)
            y_ref = F.linear(x_ref, w_ref, b_ref if v["bias"] else None)
            (y_ref * up).sum().backward()
            # parallel
            cols = _cols(OUT, tp, rank, v["stride"])
            layer = ColumnParallelLinear(H, OUT, group, bias=v["bias"], sequence_parallel=sp,
                                         gather_output=v["gather_output"], stride=v["stride"])
            layer.recompute_input_gather = v.get("recompute_input_gather", False)
            with torch.no_grad():
                layer.weight.copy_(w[cols])
                if v["bias"]:
                    layer.bias.copy_(b[cols])
            x_par = _leaf(x[_rows(S, tp, rank)] if sp else x)
            y = layer(x_par)
            up_par = up if v["gather_output"] else up[..., cols]
            (y * up_par).sum().backward()
            res = {
                "output": (y, y_ref if v["gather_output"] else y_ref[..., cols]),
                "input_grad": (x_par.grad, x_ref.grad[_rows(S, tp, rank)] if sp else x_ref.grad),
                "weight_grad": (layer.weight.grad, w_ref.grad[cols]),
                "weight_grad_gathered": (layer.gather_global("weight", layer.weight.grad), w_ref.grad),
                "weight_gathered": (layer.gather_global("weight", layer.weight.detach()), w),
            }
            if v["bias"]:
                res["bias_grad"] = (layer.bias.grad, b_ref.grad[cols])
                lin = torch.nn.Linear(H, OUT)
                with torch.no_grad():
                    lin.weight.copy_(w)
                    lin.bias.copy_(b)
                built = ColumnParallelLinear.from_linear(lin, group, sp, stride=v["stride"])
                res["from_linear_weight"] = (built.weight.detach(), w[cols])
                res["from_linear_bias"] = (built.bias.detach(), b[cols])
            out[case] = res


def _column_bf16_cases(group, tp: int, rank: int, out: Dict[str, Dict[str, Tuple]]) -> None:
    from lightning_megatron.parallel.tensor_parallel import ColumnParallelLinear

    for sp in (False, True):
        case = f"column_bf16-tp{tp}-{'sp' if sp else 'nosp'}"
        g = torch.Generator().manual_seed(77 + tp + sp)
        w, b = torch.randn(OUT, H, generator=g), torch.randn(OUT, generator=g)
        x, up = torch.randn(S, B, H, generator=g), torch.randn(S, B, OUT, generator=g)
        w_ref, b_ref, x_ref = _leaf(w), _leaf(b), _leaf(x)  # fp32 reference, no autocast
        y_ref = F.linear(x_ref, w_ref, b_ref)
        (y_ref * up).sum().backward()
        cols = _cols(OUT, tp, rank)
        layer = ColumnParallelLinear(H, OUT, group, bias=True, sequence_parallel=sp)
        with torch.no_grad():
            layer.weight.copy_(w[cols])
            layer.bias.copy_(b[cols])
        x_par = _leaf(x[_rows(S, tp, rank)] if sp else x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x_par)
            (y.float() * up[..., cols]).sum().backward()
        out[case] = {
            "output": (y, y_ref[..., cols]),
            "input_grad": (x_par.grad, x_ref.grad[_rows(S, tp, rank)] if sp else x_ref.grad),
            "weight_grad": (layer.weight.grad, w_ref.grad[cols]),
            "bias_grad": (layer.bias.grad, b_ref.grad[cols]),
        }


def _row_cases(group, tp: int, rank: int, out: Dict[str, Dict[str, Tuple]]) -> None:
    from lightning_megatron.parallel.tensor_parallel import RowParallelLinear

    for sp in (False, True):
        for bias in (True, False):
            case = f"row-tp{tp}-{'sp' if sp else 'nosp'}-{'bias' if bias else 'nobias'}"
            g = torch.Generator().manual_seed(300 + 10 * tp + 2 * sp + bias)
            w, b = torch.randn(H, OUT, generator=g), torch.randn(H, generator=g)  # OUT -> H projection
            x, up = torch.randn(S, B, OUT, generator=g), torch.randn(S, B, H, generator=g)
            w_ref, b_ref, x_ref = _leaf(w), _leaf(b), _leaf(x)
            y_ref = F.linear(x_ref, w_ref, b_ref if bias else None)
            (y_ref * up).sum().backward()
            cols = _cols(OUT, tp, rank)
            layer = RowParallelLinear(OUT, H, group, bias=bias, sequence_parallel=sp)
            with torch.no_grad():
                layer.weight.copy_(w[:, cols])
                if bias:
                    layer.bias.copy_(b)
            x_par = _leaf(x[..., cols])
            y = layer(x_par)
            seq = _rows(S, tp, rank) if sp else slice(None)
            (y * up[seq]).sum().backward()
            res = {
                "output": (y, y_ref[seq]),
                "input_grad": (x_par.grad, x_ref.grad[..., cols]),
                "weight_grad": (layer.weight.grad, w_ref.grad[:, cols]),
                "weight_grad_gathered": (layer.gather_global("weight", layer.weight.grad), w_ref.grad),
            }
            if bias:
                res["bias_grad"] = (layer.bias.grad, b_ref.grad)
            out[case] = res


class _Block(torch.nn.Module):
    """``x + down(gelu(up(x)))`` on ``[s, b, H]``: a residual MLP block, not a GPT layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(H, OUT)
        self.down = torch.nn.Linear(OUT, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _MLPStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(H, 4)  # left out of the plan: stays a plain, replicated nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _plan_cases(group, tp: int, rank: int, out: Dict[str, Dict[str, Tuple]]) -> None:
    """``apply_tp(model, group, sp, plan={"blocks.*.up": ColumnParallelStyle(), "blocks.*.down": RowParallelStyle()})``
    on a copy of a plain model holding the same weights: outputs and every gradient against the plain model."""
    import copy

    from lightning_megatron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, apply_tp
    from lightning_megatron.parallel.tensor_parallel.plan import ColumnParallelStyle, RowParallelStyle

    for sp in (False, True):
        case = f"plan-tp{tp}-{'sp' if sp else 'nosp'}"
        torch.manual_seed(900 + tp + sp)
        ref = _MLPStack()
        x, up = torch.randn(S, B, H), torch.randn(S, B, 4)
        x_ref = _leaf(x)
        (ref(x_ref) * up).sum().backward()
        model = apply_tp(copy.deepcopy(ref), group, sp,
                         plan={"blocks.*.up": ColumnParallelStyle(), "blocks.*.down": RowParallelStyle()})
        seq = _rows(S, tp, rank) if sp else slice(None)
        x_par = _leaf(x[seq])
        model.zero_grad()
        y = model(x_par)
        (y * up[seq]).sum().backward()
        cols = _cols(OUT, tp, rank)
        head_grad = model.head.weight.grad.clone()
        if sp:  # outside the plan, the head saw this rank's part of the sequence: the TP sum is its gradient
            torch.distributed.all_reduce(head_grad, group=group)
        res = {
            "layer_types": ([type(m).__name__ for b in model.blocks for m in (b.up, b.down)]
                            + [type(model.head).__name__],
                            [ColumnParallelLinear.__name__, RowParallelLinear.__name__] * 2 + ["Linear"]),
            "output": (y, ref(x)[seq].detach()),
            "input_grad": (x_par.grad, x_ref.grad[seq]),
            "head_weight_grad": (head_grad, ref.head.weight.grad),
        }
        for i, (block, block_ref) in enumerate(zip(model.blocks, ref.blocks)):
            res[f"up{i}_weight_grad"] = (block.up.weight.grad, block_ref.up.weight.grad[cols])
            res[f"up{i}_bias_grad"] = (block.up.bias.grad, block_ref.up.bias.grad[cols])
            res[f"down{i}_weight_grad"] = (block.down.weight.grad, block_ref.down.weight.grad[:, cols])
            res[f"down{i}_bias_grad"] = (block.down.bias.grad, block_ref.down.bias.grad)
        out[case] = res


def _embedding_cases(group, tp: int, rank: int, out: Dict[str, Dict[str, Tuple]]) -> None:
    from lightning_megatron.parallel.tensor_parallel import VocabParallelEmbedding, pad_vocab_size

    padded = pad_vocab_size(VOCAB, tp, DIVISIBLE_BY)
    assert padded == 64, padded
    per = padded // tp
    for sp in (False, True):
        case = f"embedding-tp{tp}-{'sp' if sp else 'nosp'}"
        g = torch.Generator().manual_seed(500 + tp + sp)
        emb, up = torch.randn(VOCAB, H, generator=g), torch.randn(S, B, H, generator=g)
        ids = torch.randint(0, VOCAB, (S, B), generator=g)
        # ids at both edges of every rank's range (and the last real id), so every shard is looked up
        edges = sorted({i for r in range(tp) for i in (r * per, min(r * per + per - 1, VOCAB - 1))} | {VOCAB - 1})
        ids.view(-1)[: len(edges)] = torch.tensor(edges)
        ids.view(-1)[len(edges): 2 * len(edges)] = torch.tensor(edges)  # repeated ids accumulate grads
        emb_ref = _leaf(emb)
        y_ref = F.embedding(ids, emb_ref)
        (y_ref * up).sum().backward()
        layer = VocabParallelEmbedding(padded, H, group, vocab_size=VOCAB, reduce_scatter=sp)
        emb_padded = torch.cat([emb, torch.full((padded - VOCAB, H), 7.0)])  # padding rows must never be read
        with torch.no_grad():
            layer.weight.copy_(emb_padded[rank * per:(rank + 1) * per])
        y = layer(ids)
        seq = _rows(S, tp, rank) if sp else slice(None)
        (y * up[seq]).sum().backward()
        grad_ref_padded = torch.cat([emb_ref.grad, torch.zeros(padded - VOCAB, H)])
        out[case] = {
            "output": (y, y_ref[seq]),
            "weight_grad": (layer.weight.grad, grad_ref_padded[rank * per:(rank + 1) * per]),
            "weight_grad_gathered": (layer.gather_global("weight", layer.weight.grad), emb_ref.grad),
        }


def _ce_cases(group, tp: int, rank: int, out: Dict[str, Dict[str, Tuple]]) -> None:
    from lightning_megatron.parallel.tensor_parallel import pad_vocab_size, vocab_parallel_cross_entropy

    padded = pad_vocab_size(VOCAB, tp, DIVISIBLE_BY)
    per = padded // tp
    for suffix, dtype in (("", torch.float32), ("-bf16", torch.bfloat16), ("-fp64", torch.float64)):
        case = f"ce-tp{tp}{suffix}"
        g = torch.Generator().manual_seed(700 + tp + (dtype == torch.bfloat16))
        logits = 3 * torch.randn(S, B, padded, generator=g)
        logits[..., VOCAB:] = 50.0  # would dominate the softmax if the padded columns were not excluded
        logits = logits.to(dtype)
        ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the loss's compute dtype
        target = torch.randint(0, VOCAB, (S, B), generator=g)
        edges = [r * per for r in range(tp)] + [min(r * per + per - 1, VOCAB - 1) for r in range(tp)]
        target.view(-1)[: len(edges)] = torch.tensor(edges)
        weights = torch.rand(S, B, generator=g, dtype=ref_dtype)  # upstream gradient of the per-token loss
        ref_in = _leaf(logits[..., :VOCAB].to(ref_dtype))
        loss_ref = F.cross_entropy(ref_in.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(S, B)
        (loss_ref * weights).sum().backward()
        local = _leaf(logits[..., rank * per:(rank + 1) * per])
        loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=VOCAB)
        (loss * weights).sum().backward()
        grad_ref_padded = torch.cat([ref_in.grad, torch.zeros(S, B, padded - VOCAB, dtype=ref_dtype)], dim=-1)
        real = max(0, min(per, VOCAB - rank * per))  # this rank's columns that are real vocabulary
        out[case] = {
            "loss": (loss, loss_ref),
            "logits_grad": (local.grad[..., :real].to(ref_dtype), ref_in.grad[..., rank * per:rank * per + real]),
            "padded_grad": (local.grad[..., real:].to(ref_dtype),
                            grad_ref_padded[..., rank * per + real:(rank + 1) * per]),
            "grad_dtype": (local.grad.dtype, logits.dtype),
            "loss_dtype": (loss.dtype, ref_dtype),
        }


def _worker(rank: int, world: int) -> Dict[str, Dict[str, Tuple]]:
    import torch.distributed as dist

    from lightning_megatron.parallel import ParallelConfig, ParallelMesh

    init_gloo(rank, world)
    out: Dict[str, Dict[str, Tuple]] = {}
    for tp in TPS:
        mesh = ParallelMesh(ParallelConfig(tp=tp))
        group = mesh.group("tp")
        assert mesh.ranks("tp") == list(range(rank // tp * tp, rank // tp * tp + tp))
        tp_rank = dist.get_rank(group)
        for build in (_column_cases, _column_bf16_cases, _row_cases, _embedding_cases, _ce_cases, _plan_cases):
            build(group, tp, tp_rank, out)
    return {case: {k: tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in pair)
                   for k, pair in res.items()} for case, res in out.items()}


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Dict[str, Tuple]]]:
    return run_distributed(_worker, WORLD)


def _check(results, case: str, loose: Tuple[str, ...] = (), **tol) -> None:
    """Every (parallel, reference) pair of ``case`` on every rank; names in ``loose`` at bf16 tolerance."""
    for rank, per_rank in enumerate(results):
        assert case in per_rank, sorted(per_rank)
        for name, (got, want) in per_rank[case].items():
            if not isinstance(got, torch.Tensor):
                assert got == want, f"rank {rank} {case} {name}: {got} != {want}"
                continue
            assert got.shape == want.shape, f"rank {rank} {case} {name}: shape {got.shape} != {want.shape}"
            t = dict(rtol=1e-2, atol=1e-2) if name in loose else tol
            torch.testing.assert_close(got.float(), want.float(), **t, msg=lambda m: f"rank {rank} {case} {name}: {m}")


@pytest.mark.parametrize("case", COLUMN_CASES)
def test_column_parallel_linear(results, case):
    _check(results, case, **FP32)


@pytest.mark.parametrize("case", COLUMN_BF16_CASES)
def test_column_parallel_linear_bf16_autocast(results, case):
    for rank, per_rank in enumerate(results):
        res = per_rank[case]
        assert res["output"][0].dtype == torch.bfloat16, (rank, res["output"][0].dtype)
        for name in ("input_grad", "weight_grad", "bias_grad"):
            assert res[name][0].dtype == torch.float32, (rank, name, res[name][0].dtype)  # the leaf's dtype
    # bf16 GEMMs against the fp32 reference: ~3 significant digits
    _check(results, case, rtol=3e-2, atol=6e-2)


@pytest.mark.parametrize("case", ROW_CASES)
def test_row_parallel_linear(results, case):
    _check(results, case, **FP32)


@pytest.mark.parametrize("case", PLAN_CASES)
def test_apply_tp_with_user_plan(results, case):
    _check(results, case, **FP32)


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_vocab_parallel_embedding(results, case):
    _check(results, case, **FP32)


@pytest.mark.parametrize("case", CE_CASES)
def test_vocab_parallel_cross_entropy(results, case):
    for rank, per_rank in enumerate(results):
        padded_grad = per_rank[case]["padded_grad"][0]
        tp = int(case.split("-")[1][2:])
        has_padding = (rank % tp) == tp - 1
        assert padded_grad.numel() > 0 if has_padding else padded_grad.numel() == 0, (rank, padded_grad.shape)
        assert torch.equal(padded_grad, torch.zeros_like(padded_grad)), f"rank {rank}: padded columns got gradient"
    # the loss is fp32 from the same (bf16) logits in both; a bf16 gradient is rounded to bf16
    _check(results, case, loose=("logits_grad",) if case.endswith("bf16") else (), **FP32)


@pytest.mark.parametrize("case", CE_FP64_CASES)
def test_vocab_parallel_cross_entropy_keeps_float64(results, case):
    """float64 logits: loss and gradient in float64 (never through float32), to float64 rounding of the
    single-process ``F.cross_entropy`` (measured <= 2e-16 relative; float32 would give ~1e-7)."""
    for rank, per_rank in enumerate(results):
        res = per_rank[case]
        assert res["loss_dtype"] == (torch.float64, torch.float64), (rank, res["loss_dtype"])
        assert res["grad_dtype"] == (torch.float64, torch.float64), (rank, res["grad_dtype"])
        for name in ("loss", "logits_grad", "padded_grad"):
            got, want = res[name]
            assert got.dtype == want.dtype == torch.float64, (rank, name, got.dtype, want.dtype)
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("dtype,expected", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32)])
def test_single_rank_cross_entropy_dtype(dtype, expected):
    """One rank (the fused ``F.cross_entropy`` path, padded columns sliced off): computed in at least float32,
    float64 kept."""
    from lightning_megatron.parallel.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(S, B, 64, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target, None, vocab_size=VOCAB)
    assert loss.dtype == expected
    want = F.cross_entropy(logits[..., :VOCAB].to(expected).reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    assert torch.equal(loss.reshape(-1), want)


def test_the_plan_styles_earlier_names_import_with_a_deprecation_warning():
    """``ColwiseParallel`` / ``RowwiseParallel`` / ``VocabParallel`` / ``SequenceParallelNorm`` (the styles' earlier
    names, the first two torch's DTensor style names) still import from the package and from ``plan``: the same
    class, with a DeprecationWarning naming the new name. Unknown names still raise AttributeError."""
    import importlib

    from lightning_megatron.parallel.tensor_parallel import plan

    package = importlib.import_module("lightning_megatron.parallel.tensor_parallel")
    renamed = {"ColwiseParallel": "ColumnParallelStyle", "RowwiseParallel": "RowParallelStyle",
               "VocabParallel": "VocabParallelStyle", "SequenceParallelNorm": "SequenceParallelNormStyle"}
    for old, new in renamed.items():
        for module in (package, plan):
            with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use {new},"):
                assert getattr(module, old) is getattr(plan, new), (module, old)
        assert old not in package.__all__ and new in package.__all__
    with pytest.raises(AttributeError, match="has no attribute 'ColwiseParallelX'"):
        getattr(package, "ColwiseParallelX")
