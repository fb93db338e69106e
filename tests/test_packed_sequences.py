"""Packed sequences (Megatron's ``--reset-attention-mask`` / ``--reset-position-ids``): a row of several documents,
``document_ids`` in the batch, attention that stays inside each document.

Single process, float64: one row holding documents of 5, 11 and 16 tokens gives per-token losses and parameter
gradients equal (1e-10) to running each document alone; changing one document leaves the other documents' logits
exactly unchanged; Hugging Face Llama run on each document alone gives our packed row's logits. Under the layouts
(one spawn of 2 gloo processes, ``run_each``): tp2 + SP with selective recompute, tp2 + SP with compiled layers
(``compile=True``, inductor on the CPU), pp2 (document ids travel with each micro-batch) with full recompute, cp2
with every ``cp_comm_type`` (documents cross the CP chunk borders), ep2: loss of every step (logged in float32:
2e-7) and final weights (float64: 1e-9) equal to the single-process run of the same packed data. The attention-level CP checks (every comm type at cp 2 and 4, gradients, exactness) are in
``tests/test_context_parallel_attention.py``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import pytest
import torch

from lightning_megatron import GPTConfig, GPTModel
from lightning_megatron.data import positions_in_documents

DOCS = (5, 11, 16)
S = sum(DOCS)


def config(**overrides: Any) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=200, seq_length=S)
    base.update(overrides)
    return GPTConfig(**base)


def document_ids_of(lengths: Sequence[int]) -> torch.Tensor:
    """``[1, sum(lengths)]``: document ``i`` for each of its tokens."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)


def bounds(lengths: Sequence[int]) -> List[tuple]:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [(end - n, end) for n, end in zip(lengths, ends)]


def float64_model(cfg: GPTConfig) -> GPTModel:
    model = GPTModel(cfg)
    model.init_weights(seed=5)
    return model.double()


def row(cfg: GPTConfig, seed: int = 3) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
    docs = document_ids_of(DOCS)
    return {"tokens": tokens, "labels": labels, "document_ids": docs, "position_ids": positions_in_documents(docs)}


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
def test_packed_row_equals_each_document_alone(position_embedding_type):
    cfg = config(position_embedding_type=position_embedding_type)
    model = float64_model(cfg)
    batch = row(cfg)
    packed = model(batch["tokens"], batch["position_ids"], batch["labels"], document_ids=batch["document_ids"])
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = []
    for begin, end in bounds(DOCS):
        loss = model(batch["tokens"][:, begin:end], labels=batch["labels"][:, begin:end])
        loss.sum().backward()   # gradients add up over the documents
        alone.append(loss.detach())
    alone = torch.cat(alone, dim=1)
    assert packed.dtype == torch.float64
    assert (packed.detach() - alone).abs().max().item() < 1e-10
    for name, p in model.named_parameters():
        err = (packed_grads[name] - p.grad).abs().max().item()
        assert err < 1e-10 * max(1.0, p.grad.abs().max().item()), (name, err)
    # the mask matters: plain causal attention over the row gives the later documents other losses
    with torch.no_grad():
        causal = model(batch["tokens"], batch["position_ids"], batch["labels"])
    assert (causal[:, DOCS[0]:] - alone[:, DOCS[0]:]).abs().max().item() > 1e-3


def test_changing_one_document_leaves_the_others_exactly():
    cfg = config()
    model = float64_model(cfg).eval()
    batch = row(cfg)
    changed = batch["tokens"].clone()
    (b1, e1) = bounds(DOCS)[1]
    changed[:, b1:e1] = (changed[:, b1:e1] + 17) % cfg.vocab_size
    with torch.no_grad():
        before = model.logits(batch["tokens"], batch["position_ids"], document_ids=batch["document_ids"])
        after = model.logits(changed, batch["position_ids"], document_ids=batch["document_ids"])
    others = torch.ones(S, dtype=torch.bool)
    others[b1:e1] = False
    assert torch.equal(before[others], after[others])      # exactly: a masked key's weight is exactly 0
    assert not torch.equal(before[~others], after[~others])


def test_document_ids_are_refused_with_a_kv_cache_and_wrong_shapes():
    from lightning_megatron.models.attention import document_attention
    from lightning_megatron.models.kv_cache import KVCache

    cfg = config()
    model = float64_model(cfg).eval()
    batch = row(cfg)
    with pytest.raises(ValueError, match="KV cache"):
        model.logits(batch["tokens"], kv_cache=KVCache(), document_ids=batch["document_ids"])
    q = torch.zeros(1, 4, S, 8)
    with pytest.raises(ValueError, match=r"expected \[b, s\] = \[1, 32\]"):
        document_attention(q, q, q, torch.zeros(1, S - 1, dtype=torch.long))


def test_flex_block_mask_is_the_boolean_mask():
    """The CUDA path's FlexAttention block mask (run here by flex_attention's eager CPU implementation) computes what
    the exact boolean-mask path does; documents of 100, 56 and 100 tokens cross the 128-token blocks."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from lightning_megatron.models.attention import document_block_mask, document_causal_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 256, 16, generator=g), *torch.randn(2, 1, 2, 256, 16, generator=g)
    docs = document_ids_of((100, 56, 100))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # eager flex_attention warns that it is meant to be compiled
        flex = flex_attention(q, k, v, block_mask=document_block_mask(docs), enable_gqa=True)
    exact = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(docs, docs), enable_gqa=True)
    assert (flex - exact).abs().max().item() < 1e-5
    # the eager CUDA path builds the mask once per ids tensor (every layer of a forward gets the same one) and again
    # after an in-place change
    from lightning_megatron.models.attention import _block_mask_of

    first = _block_mask_of(docs)
    assert _block_mask_of(docs) is first and _block_mask_of(docs.clone()) is not first
    again = _block_mask_of(docs)
    docs[0, 0] = 7
    assert _block_mask_of(docs) is not again


def test_packed_row_matches_hugging_face_llama_per_document(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_megatron import ParallelGPTModule
    from lightning_megatron.hf import config_from_hf, load_hf_weights

    shape = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    with torch.no_grad():   # logits of order one (see tests/test_hf.py)
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else torch.randn_like(p) / math.sqrt(p.shape[-1]))
    hf.save_pretrained(tmp_path)
    module = ParallelGPTModule(config_from_hf(str(tmp_path), seq_length=S))
    module.configure_model()
    load_hf_weights(module, tmp_path)
    module.double().eval()
    hf.double().eval()
    tokens = torch.randint(0, 100, (1, S), generator=torch.Generator().manual_seed(4))
    docs = document_ids_of(DOCS)
    with torch.no_grad():
        ours = module(tokens, positions_in_documents(docs), document_ids=docs)[..., :100]
        theirs = torch.cat([hf(tokens[:, b:e], attention_mask=torch.ones(1, e - b, dtype=torch.long)).logits
                            for b, e in bounds(DOCS)], dim=1)
        ours_alone = torch.cat([module(tokens[:, b:e])[..., :100] for b, e in bounds(DOCS)], dim=1)
    # HF computes its RoPE angles in float32 even in a float64 model: each document alone already differs from ours
    # by that much (~1e-6); the packed row may differ by no more than that
    baseline = (ours_alone - theirs).abs()
    assert baseline.max().item() < 1e-5
    assert ((ours - theirs).abs() - baseline).max().item() < 1e-10


# ------------------------------------------------------------------------------------------------ layouts
STEPS, MICRO = 2, 2
#: (world, strategy kwargs, config overrides, micro-batches per step, data-parallel size)
LAYOUTS: Dict[str, tuple] = {
    "tp2-sp-recompute-core_attn": (dict(tp=2, sequence_parallel=True, recompute_granularity="selective"), {}, 1, 1),
    "pp2-recompute-full": (dict(pp=2, recompute_granularity="full", recompute_method="uniform",
                                recompute_num_layers=1), {}, 2, 1),
    "cp2-p2p": (dict(cp=2, cp_comm_type="p2p"), {}, 1, 1),
    "cp2-all_gather": (dict(cp=2, cp_comm_type="all_gather"), {}, 1, 1),
    "cp2-a2a": (dict(cp=2, cp_comm_type="a2a"), {}, 1, 1),
    "cp2-a2a+p2p": (dict(cp=2, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[1, 2]), {}, 1, 1),
    "tp2-sp-compile": (dict(tp=2, sequence_parallel=True, compile=True), {}, 1, 1),
    "ep2": (dict(ep=2), dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, num_query_groups=4), 1,
            2),
}


def packed_samples(cfg: GPTConfig, n: int, seed: int = 11) -> List[Dict[str, torch.Tensor]]:
    """``n`` packed rows of random documents (lengths 1..14, so they cross the cp2 chunk borders at 8, 16, 24),
    with reset positions and a loss mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths, left = [], cfg.seq_length
        while left > 0:
            lengths.append(min(left, int(torch.randint(1, 15, (), generator=g))))
            left -= lengths[-1]
        ids = torch.randint(0, cfg.vocab_size, (cfg.seq_length + 1,), generator=g)
        docs = document_ids_of(lengths)[0]
        out.append({"tokens": ids[:-1], "labels": ids[1:],
                    "loss_mask": (torch.rand(cfg.seq_length, generator=g) > 0.2).double(),
                    "position_ids": positions_in_documents(docs), "document_ids": docs})
    return out


def _layout_cases(rank: int, world: int, cases) -> Dict[str, Any]:
    from tests._dist import run_each
    from tests.parity import layout_run

    return run_each(rank, world, layout_run, cases)


@pytest.fixture(scope="module")
def layout_results():
    from tests._dist import run_distributed

    from tests.test_compile import CompiledLayers

    cases, expected = [], {}
    for name, (kwargs, overrides, accumulate, dp) in LAYOUTS.items():
        cfg = config(**overrides)
        samples = packed_samples(cfg, STEPS * accumulate * MICRO * dp)
        callbacks = [CompiledLayers()] if kwargs.get("compile") else []   # fails the run unless layers compiled
        cases.append((name, (cfg, kwargs, samples, MICRO, accumulate, None, STEPS, "cpu", callbacks)))
        expected[name] = (cfg, samples, accumulate, dp)
    return run_distributed(_layout_cases, 2, cases, timeout=600), expected


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(layout_results, name):
    from tests.parity import assert_state_close, reference_loop

    results, expected = layout_results
    cfg, samples, accumulate, dp = expected[name]
    ref = reference_loop(cfg, samples, STEPS, MICRO * dp, accumulate=accumulate)
    want = [sum(ref["losses"][i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(STEPS)]
    for rank, result in enumerate(results):
        got = result[name]
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        for a, b in zip(got["losses"], want):   # the logged loss is a float32 number
            assert abs(a - b) <= 2e-7 * abs(b), (name, got["losses"], want)
    assert_state_close(results[0][name]["state"], ref["state"], rtol=1e-9)
