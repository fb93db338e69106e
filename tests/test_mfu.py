"""MFUMonitor and the analytic FLOPs count.

The FLOPs tests compare against hand counts written GEMM by GEMM (``2*M*N*K`` each, times 3 for forward,
input gradient and weight gradient), independent of the implementation. The monitor runs under real
MegatronStrategy layouts on CPU/gloo with a user-given peak; adding a layout is one ``LAYOUTS`` entry.
"""
import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronStrategy
from lightning_megatron.callbacks import (
    MFUMonitor,
    device_peak_flops,
    flops_per_token,
    num_floating_point_operations,
    peak_memory_gib,
    peak_memory_reserved_gib,
    precision_kind,
)
from tests._dist import run_distributed
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for


def gemm(m, n, k):
    """Forward + backward FLOPs of one [m, k] x [k, n] GEMM: forward, input gradient, weight gradient."""
    return 3 * 2 * m * n * k


def hand_count(B, s, L, h, n, g, d, V, causal, mlp_gemms_per_layer):
    """Attention, logits and the given per-layer MLP GEMMs (list of lists of (m, n, k), one list per layer)."""
    M = B * s  # tokens
    total = 0
    for layer in range(L):
        total += gemm(M, n * d, h)                 # Q
        total += gemm(M, g * d, h)                 # K
        total += gemm(M, g * d, h)                 # V
        scores = B * n * gemm(s, s, d)             # Q K^T per sequence and head: [s, d] x [d, s]
        context = B * n * gemm(s, d, s)            # P V per sequence and head: [s, s] x [s, d]
        total += (scores + context) // (2 if causal else 1)
        total += gemm(M, h, n * d)                 # output projection
        total += sum(gemm(*mnk) for mnk in mlp_gemms_per_layer[layer])
    total += gemm(M, V, h)                         # logits
    return total


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("swiglu", [True, False])
def test_dense_flops_match_hand_count(causal, swiglu):
    # GQA (6 heads, 2 groups), kv_channels != hidden/heads, vocab 300 padded to 384
    cfg = GPTConfig(num_layers=3, hidden_size=48, num_attention_heads=6, num_query_groups=2, kv_channels=12,
                    ffn_hidden_size=80, vocab_size=300, seq_length=20, swiglu=swiglu)
    B, s, h, f = 3, 20, 48, 80
    M = B * s
    if swiglu:
        mlp = [(M, f, h), (M, f, h), (M, h, f)]   # gate, up, down
    else:
        mlp = [(M, f, h), (M, h, f)]              # fc1, fc2
    want = hand_count(B, s, L=3, h=h, n=6, g=2, d=12, V=384, causal=causal, mlp_gemms_per_layer=[mlp] * 3)
    assert num_floating_point_operations(cfg, B, causal=causal) == want
    # another sequence length than the config's
    want_s10 = hand_count(B, 10, L=3, h=h, n=6, g=2, d=12, V=384, causal=causal,
                          mlp_gemms_per_layer=[[(B * 10, *mnk[1:]) for mnk in mlp]] * 3)
    assert num_floating_point_operations(cfg, B, seq_length=10, causal=causal) == want_s10
    assert flops_per_token(cfg, causal) == want / M


MOE_FIELDS = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                  ffn_hidden_size=64, vocab_size=256, make_vocab_size_divisible_by=128, seq_length=16, swiglu=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("freq, pattern", [(1, [1, 1, 1, 1]), (2, [1, 0, 1, 0]), ([0, 1, 1, 0], [0, 1, 1, 0])])
@pytest.mark.parametrize("shared", [None, 40])
def test_moe_flops_match_hand_count(causal, freq, pattern, shared):
    cfg = SimpleNamespace(**MOE_FIELDS, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24,
                          moe_layer_freq=freq, moe_shared_expert_intermediate_size=shared)
    B, s, h, f, f_moe, k = 2, 16, 32, 64, 24, 2
    M = B * s
    mlp = []
    for is_moe in pattern:
        if is_moe:
            gemms = []
            for _ in range(k):                   # each token goes through k routed experts
                gemms += [(M, f_moe, h), (M, f_moe, h), (M, h, f_moe)]
            if shared:
                gemms += [(M, shared, h), (M, shared, h), (M, h, shared)]
        else:
            gemms = [(M, f, h), (M, f, h), (M, h, f)]
        mlp.append(gemms)
    want = hand_count(B, s, L=4, h=h, n=4, g=2, d=8, V=256, causal=causal, mlp_gemms_per_layer=mlp)
    assert num_floating_point_operations(cfg, B, causal=causal) == want


def test_missing_moe_fields_mean_dense():
    plain = SimpleNamespace(**MOE_FIELDS)
    as_config = GPTConfig(**{k: v for k, v in MOE_FIELDS.items()})
    assert num_floating_point_operations(plain, 2) == num_floating_point_operations(as_config, 2)
    with pytest.raises(ValueError, match="moe_layer_freq"):
        num_floating_point_operations(SimpleNamespace(**MOE_FIELDS, num_moe_experts=4, moe_layer_freq=[1, 0]), 1)


def test_peers_number_for_the_benchmark_model():
    cfg = GPTConfig.llama_1b_bench()
    L, h, f, s, V = 24, 2048, 5632, 2048, 32000
    kv = cfg.kv_channels * cfg.num_query_groups
    peers = 3 * (L * (2 * (2 * h**2 + 2 * h * kv) + 6 * h * f + 4 * s * h) + 2 * h * V)
    assert flops_per_token(cfg, causal=False) == peers
    assert round(peers / 1e9, 3) == 8.396
    # causal halves the s^2 attention term: 3 * 2 * s * h per layer less
    assert flops_per_token(cfg, causal=True) == peers - L * 3 * 2 * s * h


@pytest.mark.parametrize("name, bf16", [
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA H100 NVL", 835.5e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
])
def test_peak_table(name, bf16):
    assert device_peak_flops(name) == bf16
    assert device_peak_flops(name, "fp16") == bf16
    fp8 = device_peak_flops(name, "fp8")
    assert fp8 == (None if "A100" in name else 2 * bf16)
    assert device_peak_flops(name, "tf32") == pytest.approx(bf16 / 2, rel=1e-3)  # datasheet rounding


def test_peak_table_unknown():
    assert device_peak_flops("NVIDIA GeForce RTX 4090") is None
    assert device_peak_flops(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="precision"):
        device_peak_flops("NVIDIA H200", "int4")


def test_precision_kind():
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    assert precision_kind(MixedPrecision("bf16-mixed", "cpu")) == "bf16"
    assert precision_kind(MixedPrecision("16-mixed", "cpu")) == "bf16"
    assert precision_kind(HalfPrecision("bf16-true")) == "bf16"
    assert precision_kind(DoublePrecision()) == "fp64"
    assert precision_kind(SimpleNamespace(precision="transformer-engine")) == "fp8"
    assert precision_kind(SimpleNamespace(precision="bf16-mixed", fp8=True)) == "fp8"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert precision_kind(Precision()) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert precision_kind(Precision()) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fp8_gemms_count_mfu_against_bf16_and_also_fp8():
    """MegatronPrecision(fp8=...) keeps ``mfu`` against the bf16 peak; ``mfu_fp8`` uses the FP8 peak."""
    from lightning_megatron import MegatronPrecision
    from lightning_megatron.callbacks.mfu import fp8_mfu_peak

    fp8 = MegatronPrecision("bf16-mixed", fp8="hybrid")
    assert precision_kind(fp8) == "bf16"
    assert fp8_mfu_peak(fp8, "NVIDIA H200") == device_peak_flops("NVIDIA H200", "fp8") == 1978e12
    assert fp8_mfu_peak(MegatronPrecision("bf16-mixed"), "NVIDIA H200") is None
    assert fp8_mfu_peak(fp8, "NVIDIA H200", precision="fp8") is None    # mfu already counts against fp8
    assert fp8_mfu_peak(fp8, "NVIDIA A100-SXM4-80GB") is None           # no fp8 tensor cores


# ------------------------------------------------------------------------------------------ the monitor
MICRO_BATCH, ACCUMULATE, STEPS, EVERY = 2, 2, 4, 2
PEAK = 1e11


class Clock(pl.Callback):
    """Wall-clock at the first batch start and at the end of each optimizer step's last batch.

    Placed just before the monitor in the callback list, so it reads the clock at the same points as the
    monitor (before the monitor's all-reduce), over the same intervals."""

    def __init__(self) -> None:
        self.t_start, self.t_step = None, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.t_start is None:
            self.t_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.t_step.setdefault(trainer.global_step, time.perf_counter())


class Logged(pl.Callback):
    """What the monitor logged (``trainer.callback_metrics``) at each logging step; placed after the monitor."""

    def __init__(self) -> None:
        self.logged = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % EVERY == 0 and step not in self.logged and "mfu" in trainer.callback_metrics:
            self.logged[step] = {k: float(trainer.callback_metrics[k]) for k in MFUMonitor.KEYS}


def monitored_run(rank, world, cfg, samples, strategy_kwargs):
    pl.seed_everything(SEED, verbose=False)
    clock, monitor, logged = Clock(), MFUMonitor(peak_flops=PEAK, log_every_n_steps=EVERY), Logged()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), STEPS, callbacks=[clock, monitor, logged],
                          accumulate_grad_batches=ACCUMULATE)
    trainer.fit(new_module(cfg, STEPS), DataLoader(ListDataset(samples), batch_size=MICRO_BATCH))
    return {"logged": logged.logged, "t_start": clock.t_start, "t_step": clock.t_step,
            "last": monitor.last_metrics, "dp": monitor._dp}


# (world size, MegatronStrategy kwargs); dp = world / (tp * pp * cp)
LAYOUTS = {
    "tp2": (2, dict(tp=2)),   # one replica on two ranks: its tokens counted once
    "dp2": (2, dict(tp=1)),   # two replicas: tokens counted twice
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_monitor_under_layout(layout):
    world, kwargs = LAYOUTS[layout]
    dp = world // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))
    cfg = tiny_config()
    samples = make_samples(cfg, MICRO_BATCH * ACCUMULATE * dp * STEPS)
    results = run_distributed(monitored_run, world, cfg, samples, kwargs)

    step_tokens = MICRO_BATCH * cfg.seq_length * ACCUMULATE * dp  # each replica once (not x tp)
    step_flops = num_floating_point_operations(cfg, MICRO_BATCH, cfg.seq_length) * ACCUMULATE * dp
    log_steps = list(range(EVERY, STEPS + 1, EVERY))
    for r in results:
        assert r["dp"] == dp
        assert sorted(r["logged"]) == log_steps
        # every rank logs the same values
        assert r["logged"] == results[0]["logged"]
        last = r["last"]
        assert last["mfu"] == last["tflops_per_gpu"] * 1e12 / PEAK
        for step in log_steps:
            got = r["logged"][step]
            assert got["tokens_per_sec"] * got["step_time"] == pytest.approx(step_tokens, rel=1e-5)
            assert got["tokens_per_sec_per_gpu"] == pytest.approx(got["tokens_per_sec"] / world, rel=1e-6)
            assert got["tflops_per_gpu"] * 1e12 * got["step_time"] == pytest.approx(step_flops / world, rel=1e-5)
            assert got["mfu"] == pytest.approx(got["tflops_per_gpu"] * 1e12 / PEAK, rel=1e-6)
        assert last["tokens_per_sec"] == pytest.approx(r["logged"][log_steps[-1]]["tokens_per_sec"], rel=1e-6)
    # tokens/s = tokens of the interval / its time on an independent clock (the slowest rank's, as the monitor)
    for step in log_steps:
        measured = max(r["t_step"][step] - (r["t_start"] if step == EVERY else r["t_step"][step - EVERY])
                       for r in results)
        got = results[0]["logged"][step]
        assert got["tokens_per_sec"] == pytest.approx(step_tokens * EVERY / measured, rel=0.1), (step, got, measured)


def test_single_process_without_peak_logs_all_but_mfu():
    cfg = tiny_config()
    samples = make_samples(cfg, MICRO_BATCH * ACCUMULATE * 2)
    monitor = MFUMonitor(log_every_n_steps=1, causal=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACCUMULATE,
                         callbacks=[monitor])
    with pytest.warns(UserWarning, match="no peak FLOP/s known"):
        trainer.fit(new_module(cfg, 2), DataLoader(ListDataset(samples), batch_size=MICRO_BATCH))
    metrics = trainer.callback_metrics
    assert "mfu" not in metrics and "mfu" not in monitor.last_metrics
    for key in MFUMonitor.MEMORY_KEYS:  # CUDA only
        assert key not in metrics and key not in monitor.last_metrics
    assert monitor.peak_flops is None
    last = monitor.last_metrics
    step_tokens = MICRO_BATCH * cfg.seq_length * ACCUMULATE
    assert last["tokens_per_sec"] * last["step_time"] == pytest.approx(step_tokens, rel=1e-9)
    assert last["tokens_per_sec_per_gpu"] == last["tokens_per_sec"]
    want_flops = num_floating_point_operations(cfg, MICRO_BATCH, causal=False) * ACCUMULATE
    assert last["tflops_per_gpu"] * 1e12 * last["step_time"] == pytest.approx(want_flops, rel=1e-9)
    for key in ("step_time", "tokens_per_sec", "tokens_per_sec_per_gpu", "tflops_per_gpu"):
        assert float(metrics[key]) == pytest.approx(last[key], rel=1e-6)


@pytest.mark.parametrize("attention_flops", ["sequence", "documents"])
def test_packed_batches_count_the_whole_sequence_or_each_document(attention_flops):
    """``attention_flops="sequence"``: a packed batch counts like an unpacked one (Megatron's convention);
    ``"documents"``: its attention counts each document's own square, by the hand count."""
    cfg = tiny_config()
    samples = make_samples(cfg, MICRO_BATCH * ACCUMULATE * 2)
    lengths = (3, 5, 8)   # seq_length 16
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    for sample in samples:
        sample["document_ids"] = docs
    monitor = MFUMonitor(log_every_n_steps=1, peak_flops=1e12, attention_flops=attention_flops)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACCUMULATE,
                         callbacks=[monitor])
    trainer.fit(new_module(cfg, 2), DataLoader(ListDataset(samples), batch_size=MICRO_BATCH))
    last = monitor.last_metrics
    want = num_floating_point_operations(cfg, MICRO_BATCH) * ACCUMULATE
    if attention_flops == "documents":
        n, d, L, s = cfg.num_attention_heads, cfg.kv_channels, cfg.num_layers, cfg.seq_length

        def causal_attention(m):   # QK^T and PV over an m x m causal square, every head
            return n * (gemm(m, m, d) + gemm(m, d, m)) // 2

        per_row = sum(causal_attention(m) for m in lengths) - causal_attention(s)
        want += per_row * L * MICRO_BATCH * ACCUMULATE
    assert last["tflops_per_gpu"] * 1e12 * last["step_time"] == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="attention_flops='whole' is not one of"):
        MFUMonitor(attention_flops="whole")


def test_monitor_needs_a_config():
    monitor = MFUMonitor(peak_flops=1.0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])

    class NoConfig(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="config"):
        trainer.fit(NoConfig(), DataLoader(torch.randn(4, 2), batch_size=2))


def test_peak_memory_is_cuda_max_allocated_in_gib(monkeypatch):
    """``peak_memory_gib``: ``torch.cuda.max_memory_allocated`` of the device in GiB; None off CUDA (the logged
    value on a GPU run is checked in tests/gpu/test_recompute_memory.py)."""
    asked = []

    def fake_max_allocated(device):
        asked.append(device)
        return 3 * 2**30 + 2**29

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake_max_allocated)
    assert peak_memory_gib(torch.device("cuda", 1)) == 3.5
    assert asked == [torch.device("cuda", 1)]
    assert peak_memory_gib("cpu") is None and peak_memory_gib(torch.device("meta")) is None
    assert len(asked) == 1


def test_peak_memory_reserved_is_cuda_max_reserved_in_gib(monkeypatch):
    """``peak_memory_reserved_gib``: ``torch.cuda.max_memory_reserved`` of the device in GiB (the figure that counts
    CUDA graph pools); None off CUDA."""
    asked = []

    def fake_max_reserved(device):
        asked.append(device)
        return 5 * 2**30 + 2**28

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", fake_max_reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 0)
    assert peak_memory_reserved_gib(torch.device("cuda", 0)) == 5.25
    assert peak_memory_gib(torch.device("cuda", 0)) == 0.0
    assert asked == [torch.device("cuda", 0)]
    assert peak_memory_reserved_gib("cpu") is None and peak_memory_reserved_gib(torch.device("meta")) is None
    assert len(asked) == 1
