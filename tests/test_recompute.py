"""Activation recompute in one process (:mod:`lightning_megatron.parallel.recompute`).

Every mode must give bit-for-bit the losses and gradients of the same model without recompute, with hidden and
attention dropout on (attention dropout drawn from a tensor-parallel stream, as under tp > 1), and must really
recompute: the functions it covers are counted while backward runs (zero calls without recompute), and the
activations autograd keeps in forward are measured with saved-tensor hooks. A control without the TP-stream
replay shows that the comparison can fail. Validation errors name the numbers. Multi-process parity (tp2+SP, pp2,
cp2, ep2) is in tests/test_parity_recompute.py.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron import GPTConfig, GPTModel, ParallelConfig, TensorParallelRNG
from lightning_megatron.moe.experts import GroupedMLPExperts
from lightning_megatron.moe.router import TopKRouter
from lightning_megatron.parallel.recompute import apply_recompute, recompute_groups
from lightning_megatron.parallelize import parallelize

DENSE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=200, seq_length=16, hidden_dropout=0.1, attention_dropout=0.1)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
           moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_load_balancing_type="aux_loss")


def full(method: str, n: int) -> Dict[str, Any]:
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)


def selective(*modules: str) -> Dict[str, Any]:
    return dict(recompute_granularity="selective", recompute_modules=list(modules) if modules else None)


class BackwardCalls:
    """Counts calls of ``F.<name>`` made while backward runs (recomputation), not in forward."""

    NAMES = ("scaled_dot_product_attention", "rms_norm", "silu")

    def __init__(self) -> None:
        self.in_backward = False
        self.counts: Dict[str, int] = {}

    @contextlib.contextmanager
    def watching(self):
        patches = [mock.patch.object(F, name, self._counting(name, getattr(F, name))) for name in self.NAMES]
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield self

    def _counting(self, name, fn):
        def call(*args, **kwargs):
            if self.in_backward:
                self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call


def saved_bytes_hooks(total: Dict[str, int]):
    """Saved-tensor hooks adding the bytes of every distinct storage autograd keeps in forward to ``total``."""
    seen = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total["bytes"] += t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def run_step(config: Dict[str, Any], recompute: Optional[Dict[str, Any]], tp_stream: bool = True,
             replay_stream: bool = True, split_backward: bool = False, autocast: bool = False) -> Dict[str, Any]:
    """One forward/backward of a freshly initialised GPTModel (dropout on; attention dropout on a
    TensorParallelRNG stream when ``tp_stream``) with ``recompute`` (ParallelConfig fields) applied; ``autocast``:
    the forward under CPU bfloat16 autocast (bf16-mixed)."""
    cfg = GPTConfig(**config)
    model = GPTModel(cfg)
    model.init_weights(seed=5)
    rng = TensorParallelRNG(99, torch.device("cpu")) if tp_stream else None
    if rng is not None:
        model.set_tensor_parallel(None, False, tp_fork=rng.fork)
    if recompute:
        apply_recompute(model, ParallelConfig(**recompute), tp_rng=rng if replay_stream else None)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    torch.manual_seed(17)
    calls, kept = BackwardCalls(), {"bytes": 0}
    with calls.watching():
        with saved_bytes_hooks(kept), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids[:, :-1], None, ids[:, 1:]).mean()
        calls.in_backward = True
        params = [p for p in model.parameters()]
        if split_backward:   # as the zero-bubble pipeline schedules: input gradients, then weight gradients
            torch.autograd.grad(loss, [model.embedding.word_embeddings.weight], retain_graph=True)
            grads = torch.autograd.grad(loss, params)
        else:
            loss.backward()
            grads = [p.grad for p in params]
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    model.eval()
    with torch.no_grad():
        eval_logits = model(ids[:, :-1])
    return {"loss": loss.detach(), "grads": dict(zip([n for n, _ in model.named_parameters()], grads)),
            "calls": calls.counts, "kept": kept["bytes"], "eval": eval_logits, "model": model,
            "router_records": [len(r._aux_history) for r in routers],
            "router_counts": [r.local_tokens_per_expert.clone() for r in routers]}


def assert_identical(got: Dict[str, Any], want: Dict[str, Any]) -> None:
    assert torch.equal(got["loss"], want["loss"]), (got["loss"], want["loss"])
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert torch.equal(got["grads"][name], grad), name
    assert torch.equal(got["eval"], want["eval"])


@pytest.fixture(scope="module")
def dense_reference():
    return run_step(DENSE, None)


L = DENSE["num_layers"]
ALL_LAYERS = {"scaled_dot_product_attention": L, "rms_norm": 2 * L, "silu": L}


@pytest.mark.parametrize("recompute, calls", [
    (selective(), {"scaled_dot_product_attention": L}),                        # default: core_attn
    (selective("mlp"), {"silu": L}),
    (selective("layernorm"), {"rms_norm": 2 * L}),                             # output-discarding
    (selective("core_attn", "mlp", "layernorm"), ALL_LAYERS),
    (full("uniform", 1), ALL_LAYERS),
    (full("uniform", 3), ALL_LAYERS),                                          # groups of 3 and 1
    (full("uniform", 4), ALL_LAYERS),
    (full("block", 1), {"scaled_dot_product_attention": 1, "rms_norm": 2, "silu": 1}),
    (full("block", 3), {"scaled_dot_product_attention": 3, "rms_norm": 6, "silu": 3}),
], ids=["selective", "mlp", "layernorm", "selective-all", "uniform1", "uniform3", "uniform4", "block1", "block3"])
def test_recompute_is_exact_with_dropout_and_really_recomputes(dense_reference, recompute, calls):
    assert dense_reference["calls"] == {}   # nothing runs in backward without recompute
    got = run_step(DENSE, recompute)
    assert_identical(got, dense_reference)
    assert got["calls"] == calls


def test_recompute_keeps_fewer_activations(dense_reference):
    """Bytes autograd keeps in forward (what recompute saves in memory): a checkpointed group keeps only its input,
    so full uniform over all layers keeps nothing of them, block 2 keeps exactly the two other layers' activations,
    and the selective parts keep less than a plain layer."""
    none = dense_reference["kept"]
    per_layer = (none - run_step(dict(DENSE, num_layers=1), None)["kept"]) / (L - 1)
    outside = none - L * per_layer   # embedding, head, loss
    assert abs(run_step(DENSE, full("uniform", L))["kept"] - outside) < 0.05 * per_layer
    assert abs(run_step(DENSE, full("block", 2))["kept"] - (outside + 2 * per_layer)) < 0.1 * per_layer
    for part in ("core_attn", "mlp"):
        assert none - run_step(DENSE, selective(part))["kept"] > 0.1 * L * per_layer, part


def test_the_tensor_parallel_stream_must_be_replayed(dense_reference):
    """Control: recompute without replaying the TP stream draws other attention-dropout masks in the recomputed
    forward, so the gradients differ (the exactness test above can fail)."""
    got = run_step(DENSE, full("uniform", 2), replay_stream=False)
    assert torch.equal(got["loss"], dense_reference["loss"])   # forward unchanged
    assert any(not torch.equal(got["grads"][n], g) for n, g in dense_reference["grads"].items())


def test_split_backward_recomputes_twice_and_stays_exact():
    """The zero-bubble pipeline schedules run backward in two passes (inputs, then weights) over a retained graph:
    every checkpointed part recomputes once per pass, from the same snapshot."""
    want = run_step(DENSE, None, split_backward=True)
    for recompute in (full("uniform", 2), selective("core_attn", "mlp", "layernorm")):
        assert_identical(run_step(DENSE, recompute, split_backward=True), want)


@pytest.fixture(scope="module")
def moe_reference():
    return run_step(MOE, None)


@pytest.mark.parametrize("recompute", [selective("moe"), selective("moe_act"), selective("shared_experts"),
                                       selective("moe", "moe_act", "layernorm", "core_attn"), full("uniform", 2)],
                         ids=["moe", "moe_act", "shared_experts", "moe+all", "uniform2"])
def test_moe_recompute_is_exact_and_routers_count_once(moe_reference, recompute):
    """Routers replayed in backward record nothing: aux-loss records and expert-bias token counts are those of
    the run without recompute."""
    got = run_step(MOE, recompute)
    assert_identical(got, moe_reference)
    assert got["router_records"] == moe_reference["router_records"] == [1] * L
    for a, b in zip(got["router_counts"], moe_reference["router_counts"]):
        assert torch.equal(a, b) and a.sum() > 0
    assert got["calls"].get("silu", 0) > 0   # experts' / shared experts' activations ran again in backward


def test_moe_act_recomputes_every_expert_activation():
    """``moe_act`` replaces the kept output of every expert activation by a recipe: each is recomputed once in
    backward (counted on the experts' ``activation``)."""
    forward, backward = [], []
    original = GroupedMLPExperts.activation

    def counting(self, h):
        (backward if phase["backward"] else forward).append(h.shape[0])
        return original(self, h)

    phase = {"backward": False}
    cfg = GPTConfig(**MOE)
    model = GPTModel(cfg)
    model.init_weights(seed=5)
    with mock.patch.object(GroupedMLPExperts, "activation", counting):
        apply_recompute(model, ParallelConfig(**selective("moe_act")))
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))
        loss = model(ids[:, :-1], None, ids[:, 1:]).mean()
        phase["backward"] = True
        loss.backward()
    assert forward and sorted(backward) == sorted(n for n in forward if n > 0)


@pytest.mark.parametrize("config, recompute, norms", [
    (DENSE, selective("layernorm", "core_attn"), 2 * L),
    (DENSE, full("uniform", 2), 2 * L),
    (MOE, selective("layernorm", "moe_act"), L),
], ids=["dense-layernorm", "dense-uniform2", "moe-layernorm"])
def test_recompute_is_exact_under_autocast(config, recompute, norms):
    """bf16 autocast: a norm's float32 output that feeds one linear is handed on in bfloat16 (what the linear casts
    it to) and recomputed; the pre-MLP norm of an MoE layer (router, dispatcher, shared experts) stays float32, so
    its gradient is still summed in float32: bit-for-bit the run without recompute either way."""
    want = run_step(config, None, autocast=True)
    got = run_step(config, recompute, autocast=True)
    assert_identical(got, want)
    assert got["calls"]["rms_norm"] == norms


def test_recompute_groups():
    keys = [str(i) for i in range(5)]
    assert recompute_groups(keys, "uniform", 2) == [(["0", "1"], True), (["2", "3"], True), (["4"], True)]
    assert recompute_groups(keys, "block", 2) == [(["0"], True), (["1"], True), (["2", "3", "4"], False)]
    assert recompute_groups(keys[:1], "block", 2) == [(["0"], True)]   # a chunk with fewer layers: all of them
    assert recompute_groups(keys, "block", 5) == [([k], True) for k in keys]


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, needle", [
    (dict(recompute_granularity="some"), "recompute_granularity='some' is not None or one of ('selective', 'full')"),
    (dict(recompute_granularity="full"), "recompute_granularity='full' needs recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers=None"),
    (dict(recompute_granularity="full", recompute_method="stripes", recompute_num_layers=1),
     "recompute_method='stripes' is not None or one of ('uniform', 'block')"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0),
     "recompute_num_layers=0 must be a positive integer"),
    (dict(recompute_method="block", recompute_num_layers=2), "need recompute_granularity='full', got "
                                                             "recompute_granularity=None"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "got recompute_granularity='selective'"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
          recompute_modules=["mlp"]), "drop recompute_modules"),
    (dict(recompute_modules=["mlp"]), "recompute_modules=['mlp'] needs recompute_granularity='selective'"),
    (dict(recompute_granularity="selective", recompute_modules=[]), "recompute_modules=[] recomputes nothing"),
    (dict(recompute_granularity="selective", recompute_modules=["attention"]), "['attention'] are not among"),
    (dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]), "no multi-latent attention"),
])
def test_invalid_options_are_refused(kwargs, needle):
    with pytest.raises(ValueError) as e:
        ParallelConfig(**kwargs)
    assert needle in str(e.value)


def test_selective_defaults_to_core_attention():
    assert ParallelConfig(recompute_granularity="selective").recompute_modules == ["core_attn"]
    assert ParallelConfig(recompute_granularity="selective", recompute_modules=("mlp", "mlp")).recompute_modules == [
        "mlp"]


@pytest.mark.parametrize("layout, model, needle", [
    (dict(**full("uniform", 5)), dict(num_layers=4), "recompute_num_layers=5 is larger than the model's num_layers (4)"),
    (dict(pp=2, **full("block", 3)), dict(num_layers=4),
     "the layers of each of the pp*vp = 2 pipeline chunks [2, 2] (2): recompute_method='block' recomputes the first "
     "recompute_num_layers layers of each chunk; use 1 <= recompute_num_layers <= 2"),
    (dict(pp=2, vp=2, **full("uniform", 2)), dict(num_layers=4), "pp*vp = 4 pipeline chunks [1, 1, 1, 1] (1)"),
    (dict(**selective("moe")), dict(num_layers=4), "recompute parts of mixture-of-experts layers, but the model is "
                                                   "dense"),
    (dict(**selective("shared_experts")), dict(num_layers=4, num_moe_experts=4), "the model has none"),
])
def test_impossible_combinations_name_the_numbers(layout, model, needle):
    cfg = GPTConfig(**dict(DENSE, **model))
    with pytest.raises(ValueError) as e:
        ParallelConfig(**layout).validate_model(cfg)
    assert needle in str(e.value)


def test_uneven_stages_allow_up_to_the_largest_chunk():
    """With num_layers_in_first_pipeline_stage=1 the stages hold [1, 3] layers: block 3 recomputes all of the first
    stage and 3 of the second; 4 is refused."""
    cfg = GPTConfig(**DENSE)
    ParallelConfig(pp=2, num_layers_in_first_pipeline_stage=1, **full("block", 3)).validate_model(cfg)
    with pytest.raises(ValueError, match=r"chunks \[1, 3\] \(3\)"):
        ParallelConfig(pp=2, num_layers_in_first_pipeline_stage=1, **full("block", 4)).validate_model(cfg)


def test_apply_recompute_errors():
    model = GPTModel(GPTConfig(**DENSE))
    with pytest.raises(ValueError, match="recompute_num_layers=9 is larger than the model's num_layers"):
        apply_recompute(model, ParallelConfig(**full("uniform", 9)))
    with pytest.raises(ValueError, match="contains 'moe' but GPTModel has no MoE layer"):
        apply_recompute(model, ParallelConfig(**selective("moe")))
    dense_mlp_free = GPTModel(GPTConfig(**MOE))
    with pytest.raises(ValueError, match="contains 'mlp' but GPTModel has no dense MLP layer"):
        apply_recompute(dense_mlp_free, ParallelConfig(**selective("mlp")))
    apply_recompute(model, ParallelConfig(**selective()))
    with pytest.raises(RuntimeError, match="applied to this model twice"):
        apply_recompute(model, ParallelConfig(**selective()))
    with pytest.raises(ValueError, match="contains no model implementing lightning_megatron.contract.RecomputeModel"):
        apply_recompute(torch.nn.Linear(2, 2), ParallelConfig(**selective()))
    assert apply_recompute(torch.nn.Linear(2, 2), ParallelConfig()) == []   # off: nothing to find


def test_parallelize_needs_the_stream_to_replay():
    with pytest.raises(ValueError, match="pass tp_rng="):
        parallelize(GPTModel(GPTConfig(**DENSE)), None, ParallelConfig(**selective()), device=torch.device("cpu"),
                    seed=0, tp_fork=contextlib.nullcontext)


@pytest.mark.parametrize("recompute", [full("uniform", 2), selective("core_attn", "mlp")],
                         ids=["uniform2", "selective"])
def test_recompute_composes_with_compiled_layers(recompute):
    """``compile=True`` compiles each transformer layer: full recompute checkpoints around the compiled layers;
    the selective parts run eagerly inside them (a graph break). Same numerics as eager, fewer kept bytes than
    the compiled layers without recompute."""
    cfg = GPTConfig(**dict(DENSE, hidden_dropout=0.0, attention_dropout=0.0))
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))

    def step(rc, compiled):
        model = GPTModel(cfg)
        model.init_weights(seed=5)
        if rc:
            apply_recompute(model, ParallelConfig(**rc))
        if compiled:
            for layer in model.decoder.layers.values():
                layer.compile(backend="aot_eager")
        kept = {"bytes": 0}
        with saved_bytes_hooks(kept):
            loss = model(ids[:, :-1], None, ids[:, 1:]).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()], kept["bytes"]

    eager_loss, eager_grads, _ = step(None, False)
    plain_kept = step(None, True)[2]
    loss, grads, kept = step(recompute, True)
    assert kept < plain_kept
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
