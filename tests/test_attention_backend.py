"""``GPTConfig.attention_backend`` (Megatron's ``--attention-backend``) on the CPU: every backend computes the causal
grouped-query attention of an fp64 reference (``fused``, a GPU kernel, leaves the CPU to torch's choice), and the
option reaches the model from the config and the command line. The cuDNN path itself is checked on a GPU
(``tests/gpu/test_attention_cuda.py``)."""
from __future__ import annotations

import pytest
import torch

from lightning_megatron import GPTConfig
from lightning_megatron.cli.flags import build_parser
from lightning_megatron.cli.plan import plan_from_args
from lightning_megatron.models.attention import ATTENTION_BACKENDS, causal_attention, cudnn_attention_accepts
from lightning_megatron.models.gpt import GPTModel


def _reference(q, k, v):
    """Causal GQA attention written out: each query head attends with its group's key and value head."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = q.shape[2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    # the model's [s, b, n, d] activations viewed as [b, n, s, d] (strided, as SelfAttention hands them over)
    q = torch.randn(12, 2, 4, 16, generator=g, dtype=dtype).permute(1, 2, 0, 3)
    k, v = (torch.randn(12, 2, 2, 16, generator=g, dtype=dtype).permute(1, 2, 0, 3) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_every_backend_computes_causal_gqa_attention_on_the_cpu(backend):
    q, k, v = (t.detach().requires_grad_() for t in _inputs())
    out = causal_attention(q, k, v, 0.0, backend)
    out.square().sum().backward()
    rq, rk, rv = (t.detach().requires_grad_() for t in _inputs())
    ref = _reference(rq, rk, rv)
    ref.square().sum().backward()
    assert out.shape == (2, 4, 12, 16)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-11)


def test_cudnn_is_not_chosen_off_cuda():
    q, k, v = _inputs(torch.bfloat16)
    assert not cudnn_attention_accepts(q, k, 0.0)
    torch.testing.assert_close(causal_attention(q, k, v, 0.0, "fused"), causal_attention(q, k, v, 0.0, "auto"),
                               rtol=0, atol=0)


def test_the_option_is_validated_and_reaches_the_kernel_choice(monkeypatch):
    import lightning_megatron.models.gpt as gpt

    with pytest.raises(ValueError, match=r"attention_backend='cudnn' is not one of \('auto', 'fused'"):
        GPTConfig(attention_backend="cudnn")
    torch.manual_seed(0)
    cfg = GPTConfig(num_query_groups=2, attention_backend="unfused")
    model = GPTModel(cfg).double()
    seen = []

    def spy(q, k, v, dropout_p=0.0, backend="auto"):
        seen.append(backend)
        return causal_attention(q, k, v, dropout_p, backend)

    monkeypatch.setattr(gpt, "causal_attention", spy)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    unfused = model(ids)
    assert seen == ["unfused"] * cfg.num_layers, seen
    for layer in model.decoder.layers.values():
        layer.self_attention.attention_backend = "auto"
    torch.testing.assert_close(model(ids), unfused, rtol=1e-10, atol=1e-10)
    assert seen[cfg.num_layers:] == ["auto"] * cfg.num_layers, seen


@pytest.mark.parametrize("value", ["flash", "fused", "unfused", "local", "auto"])
def test_megatron_flag_sets_the_config_field(value):
    plan = plan_from_args(build_parser().parse_args(["--attention-backend", value]))
    assert plan.config.attention_backend == value
    assert plan_from_args(build_parser().parse_args([])).config.attention_backend == "auto"
