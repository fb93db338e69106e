"""MegatronPrecision: every argument validated; the plugin works with MegatronStrategy through the Trainer, and
Lightning's precision strings with MegatronStrategy mean the MegatronPrecision of the same name; fp16's
dynamic loss scaling under tp2 and pp2 skips the same step on every rank when only one rank's gradients overflow
(the found-inf flag is reduced over all ranks) and halves the loss scale everywhere; the MoE aux-loss gradient
gets the loss scale too."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronPrecision, MegatronStrategy
from tests._dist import run_distributed
from tests.parity import SEED, ListDataset, collate, make_samples, new_module, tiny_config, trainer_for


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, needle", [
    (dict(precision="bf16-true"), "precision must be one of 'bf16-mixed', '16-mixed', '32-true'"),
    (dict(precision="bf16-true"), "fp32 main parameters behind bf16 ones: MegatronPrecision('bf16-mixed', "
                                  "params_dtype=torch.bfloat16)"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(fp8="e5m2"), "fp8='e5m2'): fp8 must be None, 'e4m3' or 'hybrid'"),
    (dict(fp8="hybrid", fp8_recipe="bogus"), "fp8_recipe='bogus'): must be one of 'delayed', 'tensorwise', 'rowwise'"),
    (dict(fp8="hybrid", fp8_recipe="blockwise"), "fp8_recipe='blockwise' (1x128 / 128x128 blocks) is not supported"),
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), "fp8_recipe='mxfp8' needs fp8_backend='te'"),
    (dict(fp8="hybrid", fp8_recipe="mxfp8", fp8_backend="torch"), "compute capability >= 10.0"),
    (dict(fp8="hybrid", fp8_recipe="rowwise", fp8_backend="te"), "'rowwise' is the torch backend's"),
    (dict(fp8="hybrid", fp8_backend="cuda"), "fp8_backend='cuda'): must be one of 'auto', 'te', 'torch'"),
    (dict(fp8="hybrid", fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo='mean'): must be one of"),
    (dict(fp8="hybrid", fp8_amax_history_len=0), "fp8_amax_history_len=0 must be >= 1"),
    (dict(fp8="hybrid", fp8_amax_history_len=2.5), "fp8_amax_history_len=2.5 must be an int"),
    (dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_amax_history_len=16),
     "fp8_amax_history_len=16 applies to fp8_recipe='delayed' only"),
    (dict(fp8="hybrid", fp8_margin=-1), "fp8_margin=-1 must be >= 0"),
    (dict(fp8="hybrid", first_last_layers_bf16=True), "first_last_layers_bf16=True does not work with "
                                                      "fp8_recipe='delayed'"),
    (dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_end_in_bf16=-1),
     "num_layers_at_end_in_bf16=-1 must be >= 0"),
    (dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=1), "first_last_layers_bf16=1 must be True"),
    (dict(fp8_recipe="tensorwise"), "MegatronPrecision(fp8_recipe='tensorwise') sets FP8 options without fp8"),
    (dict(first_last_layers_bf16=True), "sets FP8 options without fp8: pass fp8='hybrid'"),
    (dict(precision="16-mixed", initial_loss_scale=0), "initial_loss_scale=0) must be a number > 0"),
    (dict(precision="16-mixed", loss_scale_window=0), "loss_scale_window=0) must be an int >= 1"),
    (dict(initial_loss_scale=128.0), "apply to precision='16-mixed' only"),
])
def test_every_argument_is_validated(kwargs, needle):
    with pytest.raises(ValueError) as exc:
        MegatronPrecision(**kwargs)
    assert needle in str(exc.value), str(exc.value)


def test_unknown_keyword_names_the_closest():
    with pytest.raises(TypeError, match=r"MegatronPrecision got an unexpected keyword argument `fp8_recpie`; did you "
                                        r"mean `fp8_recipe`"):
        MegatronPrecision(fp8="hybrid", fp8_recpie="tensorwise")
    with pytest.raises(TypeError, match="`fp8_amax_history`; did you mean `fp8_amax_history_len`"):
        MegatronPrecision(fp8="hybrid", fp8_amax_history=16)


def test_defaults_are_megatrons():
    plugin = MegatronPrecision(fp8="hybrid")
    c = plugin.fp8_config
    assert plugin.precision == "bf16-mixed" and plugin.scaler is None
    assert (c.fp8_format, c.recipe, c.margin, c.amax_history_len, c.amax_compute_algo) == (
        "hybrid", "delayed", 0, 1, "most_recent")
    assert (c.first_last_layers_bf16, c.num_layers_at_start_in_bf16, c.num_layers_at_end_in_bf16) == (False, 1, 1)
    assert c.forward_dtype == torch.float8_e4m3fn and c.grad_dtype == torch.float8_e5m2
    assert MegatronPrecision(fp8="e4m3").fp8_config.grad_dtype == torch.float8_e4m3fn
    assert MegatronPrecision("32-true").fp8_config is None


def test_the_trainer_takes_it_with_the_strategy():
    """``Trainer(strategy=MegatronStrategy(), plugins=[MegatronPrecision(...)])``: the strategy uses the plugin (its
    autocast runs, the loss is scaled in fp16) and binds it to its device."""
    cfg = tiny_config()
    samples = make_samples(cfg, 4)

    class Seen(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            self.loss_dtype, self.scale = loss.dtype, trainer.precision_plugin.loss_scale

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.plugin = trainer.strategy.precision_plugin

    for precision, scale in (("16-mixed", 256.0), ("bf16-mixed", 1.0)):
        seen = Seen()
        plugin = MegatronPrecision(precision, **(dict(initial_loss_scale=256.0) if scale != 1.0 else {}))
        trainer = trainer_for(1, MegatronStrategy(), 1, callbacks=[seen], plugins=[plugin])
        trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(samples), batch_size=2, collate_fn=collate))
        assert seen.plugin is plugin and plugin.device == "cpu"
        assert seen.scale == scale and (plugin.scaler is not None) == (precision == "16-mixed")
    with pytest.raises(Exception, match="Received both `precision="):
        pl.Trainer(strategy=MegatronStrategy(), precision="bf16-mixed", plugins=[MegatronPrecision()])


def test_lightning_precision_strings_mean_megatron_precision():
    """``Trainer(precision="bf16-mixed" | "16-mixed")`` (Lightning's ``MixedPrecision``, also passed as a plugin) with
    ``MegatronStrategy`` runs as ``MegatronPrecision`` of the same name, with its defaults; on CPU Lightning itself
    turns ``"16-mixed"`` into bf16 before the strategy sees it. ``"bf16-true"`` / ``"16-true"`` (half-precision weights
    without fp32 main parameters) are refused before anything starts, naming the ``MegatronPrecision`` to use, and so
    is a ``GradScaler`` with settings of its own. Other precisions and other plugins stay as given; other strategies
    keep Lightning's plugins."""
    from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision

    def plugin_of(**kwargs):
        return pl.Trainer(accelerator="cpu", devices=2, strategy=MegatronStrategy(), logger=False, **kwargs) \
            .precision_plugin

    for precision, want in (("bf16-mixed", "bf16-mixed"), ("16-mixed", "bf16-mixed")):
        plugin = plugin_of(precision=precision)
        assert isinstance(plugin, MegatronPrecision) and plugin.precision == want, plugin
    for precision in ("16-mixed", "bf16-mixed"):
        plugin = plugin_of(plugins=[MixedPrecision(precision, "cpu")])
        assert isinstance(plugin, MegatronPrecision) and plugin.precision == precision, plugin
        assert (plugin.initial_loss_scale, plugin.loss_scale_window) == (2.0 ** 16, 1000)   # Megatron's defaults
    assert pl.Trainer(accelerator="cpu", devices=2, strategy="megatron", precision="bf16-mixed",
                      logger=False).precision_plugin.__class__ is MegatronPrecision
    own = MegatronPrecision("16-mixed", initial_loss_scale=128.0)
    assert plugin_of(plugins=[own]) is own
    assert type(plugin_of(precision="32-true")).__name__ == "Precision"
    assert isinstance(plugin_of(precision="64-true"), DoublePrecision)
    assert type(pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", precision="bf16-mixed",
                           logger=False).precision_plugin) is MixedPrecision
    for precision, use in (("bf16-true", "MegatronPrecision('bf16-mixed', params_dtype=torch.bfloat16)"),
                           ("16-true", "MegatronPrecision('16-mixed')")):
        with pytest.raises(ValueError, match=rf"Trainer\(precision='{precision}'\) with MegatronStrategy: "
                                             r"Lightning's HalfPrecision") as exc:
            plugin_of(precision=precision)
        assert use in str(exc.value), str(exc.value)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    with pytest.raises(ValueError, match=r"the scaler's own settings \(init_scale=1024.0, growth_interval=100\) "
                                         r"would be lost.*MegatronPrecision\('16-mixed', initial_loss_scale="):
        plugin_of(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])


# ---------------------------------------------------------------------------------------------- fp16 overflow
class OverflowOnOneRank(pl.Callback):
    """At optimizer step ``step``, rank ``rank`` alone gets an infinite gradient in parameter ``name`` (a tensor
    hook, so it works under pipeline schedules too). Records, per step and on every rank, whether the local
    weights changed and the loss scale after the step."""

    def __init__(self, rank: int, step: int, name: str) -> None:
        self.rank, self.step, self.name = rank, step, name
        self.changed: List[bool] = []
        self.scales: List[float] = []
        self.hooked = False

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        param = dict(pl_module.named_parameters())[self.name]
        param.register_hook(lambda g: torch.full_like(g, math.inf) if trainer.global_step == self.step else g)
        self.hooked = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.changed.append(any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())))
        self.scales.append(trainer.precision_plugin.loss_scale)


def _overflow_run(rank: int, world: int, strategy_kwargs: Dict[str, Any], name: str, accumulate: int,
                  adamw: Optional[str] = None):
    cfg = tiny_config()
    pl.seed_everything(SEED, verbose=False)
    probe = OverflowOnOneRank(rank=1, step=1, name=name)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 3, callbacks=[probe], gradient_clip_val=1.0,
                          accumulate_grad_batches=accumulate,
                          plugins=[MegatronPrecision("16-mixed", initial_loss_scale=1024.0)])
    trainer.fit(new_module(cfg, 3, adamw), DataLoader(ListDataset(make_samples(cfg, 3 * accumulate * 2)),
                                                      batch_size=2))
    steps = accumulate - 1  # the last micro-batch of each step
    return {"hooked": probe.hooked, "changed": probe.changed[steps::accumulate],
            "scales": probe.scales[steps::accumulate]}


@pytest.mark.parametrize("strategy_kwargs, name, accumulate, adamw", [
    (dict(tp=2, sequence_parallel=True), "model.decoder.layers.0.self_attention.linear_qkv.weight", 1, None),
    (dict(pp=2), "model.decoder.layers.1.mlp.linear_fc2.weight", 2, None),
    (dict(tp=2, sequence_parallel=True), "model.decoder.layers.0.self_attention.linear_qkv.weight", 1, "bf16_moments"),
], ids=["tp2-sp", "pp2", "tp2-sp-bf16-moments"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(strategy_kwargs, name, accumulate, adamw):
    """Rank 1 alone overflows at step 1 (a tensor-parallel shard / a layer of its pipeline stage, which no other rank
    holds): every rank skips that step and halves the loss scale (1024 -> 512); the other steps run. Without the
    found-inf reduction rank 0 would step and keep 1024. The precision-aware AdamW (bf16 moments) reads the scaler's
    ``found_inf`` itself and skips the same way."""
    results = run_distributed(_overflow_run, 2, strategy_kwargs, name, accumulate, adamw)
    assert [r["hooked"] for r in results] == [False, True]
    for rank, r in enumerate(results):
        assert r["changed"] == [True, False, True], (rank, r)
        assert r["scales"] == [1024.0, 512.0, 512.0], (rank, r)


# ---------------------------------------------------------------------------------------------- MoE aux loss
def _router_grads(precision: str, aux_coeff: float) -> Dict[str, torch.Tensor]:
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                    vocab_size=200, seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                    moe_aux_loss_coeff=aux_coeff)

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after fp16's unscale
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if "router" in n}

    grads = Grads()
    pl.seed_everything(SEED, verbose=False)
    plugin = MegatronPrecision(precision, **(dict(initial_loss_scale=1024.0) if precision == "16-mixed" else {}))
    trainer = trainer_for(1, MegatronStrategy(), 1, callbacks=[grads], plugins=[plugin], accumulate_grad_batches=2)
    trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(make_samples(cfg, 4)), batch_size=2, collate_fn=collate))
    return grads.grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fp16_scales_the_moe_aux_loss_gradient():
    """With a large aux-loss coefficient the routers' gradients are mostly the aux loss's; under fp16 they must
    match fp32's after unscaling (measured 4e-4; an aux loss left unscaled gives about 1, i.e. the 1/1024 part)."""
    fp32 = _router_grads("32-true", 10.0)
    without_aux = _router_grads("32-true", 0.0)
    fp16 = _router_grads("16-mixed", 10.0)
    for name, want in fp32.items():
        assert _rel(without_aux[name], want) > 0.5, name  # the aux loss dominates these gradients
        assert _rel(fp16[name], want) < 1e-2, (name, _rel(fp16[name], want))


def test_param_precision_is_read_in_one_typed_place():
    """``params_dtype`` / ``store_param_remainders`` reach the strategy as one frozen :class:`ParamPrecision`,
    resolved against the layout: as given (remainders on by default with bf16 parameters), the parameters' own dtype
    under FSDP's sharding levels (an explicit ``store_param_remainders=True`` there refused), the default for
    Lightning's own plugins."""
    import dataclasses

    from lightning.pytorch.plugins.precision import Precision

    from lightning_megatron import ParallelConfig, ParamPrecision
    from lightning_megatron.precision.plugin import param_precision_for

    bf16 = MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16)
    assert bf16.param_precision(ParallelConfig()) == ParamPrecision(torch.bfloat16, True)
    assert MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16, store_param_remainders=False
                             ).param_precision(ParallelConfig()) == ParamPrecision(torch.bfloat16, False)
    assert MegatronPrecision("bf16-mixed").param_precision(ParallelConfig()) == ParamPrecision(None, False)
    fsdp = ParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    assert bf16.param_precision(fsdp) == ParamPrecision(None, False)
    with pytest.raises(ValueError, match="store_param_remainders=True.*FSDP2 holds the fp32 main parameters"):
        MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16, store_param_remainders=True).param_precision(fsdp)
    assert param_precision_for(Precision(), ParallelConfig()) == ParamPrecision()
    assert param_precision_for(bf16, ParallelConfig()) == bf16.param_precision(ParallelConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        bf16.param_precision().params_dtype = None


def test_attach_fp8_layers_is_a_deprecated_alias_of_the_step_handing_its_handle_over():
    """``attach_fp8_layers`` (the strategy used to hand the FP8 layers back) still makes them the plugin's handle,
    with a DeprecationWarning naming what replaces it."""
    from lightning_megatron.precision.fp8 import Float8Config, Float8Layers

    plugin = MegatronPrecision(fp8="hybrid")
    layers = Float8Layers(config=Float8Config(backend="torch"))
    with pytest.warns(DeprecationWarning, match="parallelize_step"):
        plugin.attach_fp8_layers(layers)
    assert plugin.fp8_layers is layers
    assert plugin.parallelize_step(torch.device("cpu")).layers is None   # a new step: nothing converted yet
