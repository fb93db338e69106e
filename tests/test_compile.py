"""``MegatronStrategy(compile=True)``: every transformer layer is compiled (``apply_compile``) and training matches
the single-process eager run, under tp=2 + SP and pp=2 (CPU, inductor)."""
import lightning.pytorch as pl
import pytest

from lightning_megatron import MegatronStrategy
from tests.parity import check_layout_matches_single_process, tiny_config


class CompiledLayers(pl.Callback):
    """Fails the run unless every transformer layer this rank holds runs compiled."""

    def on_train_start(self, trainer, pl_module) -> None:
        layers = list(pl_module.model.decoder.layers.values())
        assert layers and all(layer._compiled_call_impl is not None for layer in layers), "layers not compiled"


@pytest.mark.parametrize("world,kwargs,accumulate", [(2, dict(tp=2, sequence_parallel=True), 1),
                                                     (2, dict(pp=2), 2)], ids=["tp2-sp", "pp2"])
def test_compiled_layers_match_single_process_eager(world, kwargs, accumulate, monkeypatch):
    """Loss per step and final weights within 1e-5 of the eager single process (measured: inductor's CPU kernels
    reorder float32 sums, ~1e-7)."""
    check_layout_matches_single_process(world, dict(kwargs, compile=True), tiny_config(num_layers=2), accumulate,
                                        clip=None, steps=2, callbacks=[CompiledLayers()])


def test_compile_needs_a_gpt_layout_model():
    from torch import nn

    from lightning_megatron import ParallelConfig
    from lightning_megatron.parallel.compile import apply_compile

    with pytest.raises(ValueError, match="compile=True compiles the transformer layers of GPT-layout models"):
        apply_compile([nn.Linear(2, 2)], ParallelConfig(compile=True))
    assert apply_compile([nn.Linear(2, 2)], ParallelConfig()) == 0
    with pytest.raises(ValueError, match="compile='yes' must be True or False"):
        MegatronStrategy(compile="yes")


def test_model_layers_hold_plain_ints():
    """A model built from a config with derived sizes (kv_channels, ffn_hidden_size... filled in by GPTConfig) holds
    them as plain ``int``: the config's marker type is an int subclass that torch.compile guards on as a user
    object in every layer call (measured 5% of a compiled step on one GPU)."""
    from lightning_megatron import GPTConfig
    from lightning_megatron.models.gpt import GPTModel

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
    assert config.is_derived("kv_channels") and type(config.kv_channels) is not int
    model = GPTModel(config)
    leaked = [(name, key) for name, module in model.named_modules() for key, value in vars(module).items()
              if isinstance(value, int) and type(value) not in (int, bool)]
    assert not leaked, leaked
    assert all(type(getattr(model.config, f)) is int for f in ("kv_channels", "ffn_hidden_size", "num_query_groups"))
    assert config.is_derived("kv_channels"), "the user's config keeps its derived markers"



@pytest.mark.parametrize("kwargs,rule", [
    (dict(enable_cuda_graph=True), "set compile=True"),
    (dict(compile=True, enable_cuda_graph=True, pp=2), "pp=2: a pipeline schedule keeps several micro-batches"),
    (dict(compile=True, enable_cuda_graph=True, data_parallel_sharding_strategy="optim_grads"),
     "FSDP gathers and frees parameters"),
    (dict(compile=True, enable_cuda_graph=True, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), "recompute_granularity='full'"),
    (dict(compile=True, enable_cuda_graph="yes"), "enable_cuda_graph='yes' must be True or False"),
], ids=["no-compile", "pp2", "fsdp", "recompute", "not-bool"])
def test_enable_cuda_graph_refuses_layouts_whose_replays_would_overwrite_live_memory(kwargs, rule):
    from lightning_megatron import ParallelConfig

    with pytest.raises(ValueError, match=rule):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=rule):
        MegatronStrategy(**kwargs)


def test_enable_cuda_graph_refuses_runs_the_graphs_cannot_serve():
    """The run's checks: a CUDA device, a module the step path runs (it starts a graph generation per micro-batch),
    gradient accumulation only with bf16 parameters; and a CPU Trainer stops before training with the first."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader

    from lightning_megatron.parallel.compile import check_cuda_graph_run
    from tests.parity import ListDataset, make_samples, new_module

    cfg = tiny_config(num_layers=2)
    module = new_module(cfg, 2)
    cuda = torch.device("cuda", 0)
    check_cuda_graph_run(module, cuda, None)
    with pytest.raises(ValueError, match="needs a CUDA device .* this run is on cpu"):
        check_cuda_graph_run(module, torch.device("cpu"), None)
    with pytest.raises(ValueError, match="Linear does not implement lightning_megatron.contract.ParallelLightningModule"):
        check_cuda_graph_run(torch.nn.Linear(2, 2), cuda, None)
    module._trainer = SimpleNamespace(accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2: .*params_dtype=torch\.bfloat16\)"):
        check_cuda_graph_run(module, cuda, torch.float32)
    check_cuda_graph_run(module, cuda, torch.bfloat16)
    module._trainer = None
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=MegatronStrategy(compile=True, enable_cuda_graph=True))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        trainer.fit(module, DataLoader(ListDataset(make_samples(cfg, 4)), batch_size=2))


@pytest.mark.parametrize("graphs", [False, True], ids=["compile", "cuda-graph"])
def test_enable_cuda_graph_compiles_the_layers_in_reduce_overhead_mode(graphs, monkeypatch):
    """Each transformer layer is compiled with the library's Inductor options (``LAYER_COMPILE_OPTIONS``: the norm
    backward's weight-gradient split) and with Inductor's CUDA graphs (``triton.cudagraphs``, what
    ``mode="reduce-overhead"`` sets) exactly when asked; the head and the loss never are (the step keeps their
    outputs) and take Inductor's defaults."""
    import torch
    from torch import nn

    from lightning_megatron import ParallelConfig
    from lightning_megatron.models.gpt import GPTModel
    from lightning_megatron.parallel.compile import LAYER_COMPILE_OPTIONS, apply_compile

    assert torch._inductor.list_mode_options("reduce-overhead") == {"triton.cudagraphs": True}
    assert LAYER_COMPILE_OPTIONS == {"triton.mix_order_reduction_split_size": 32}
    layer_calls = []
    plain_compile = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **kw: (layer_calls.append(kw),
                                                                      plain_compile(self, *a, **kw))[1])
    calls = []
    plain_torch_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **kw: (calls.append(kw),
                                                                plain_torch_compile(fn, *a, **kw))[1])
    model = GPTModel(tiny_config(num_layers=3))
    assert apply_compile([model], ParallelConfig(compile=True, enable_cuda_graph=graphs)) == 3
    layer_options = dict(LAYER_COMPILE_OPTIONS, **({"triton.cudagraphs": True} if graphs else {}))
    assert layer_calls == [{"options": layer_options}] * 3
    # torch.compile calls: the three layers' (through nn.Module.compile), then the head's and the loss's
    assert calls == [{"options": layer_options}] * 3 + [{}, {}]


def test_layer_options_unknown_to_the_installed_inductor_are_left_out(monkeypatch):
    """An option the installed Inductor lacks (a newer torch's: torch 2.9 has no mix-order reduction) is left out of
    the layers' options, so ``compile=True`` still compiles and trains; known ones are kept."""
    import torch

    from lightning_megatron import ParallelConfig
    from lightning_megatron.models.gpt import GPTModel
    from lightning_megatron.parallel import compile as layer_compile
    from lightning_megatron.parallel.compile import known_inductor_options

    assert known_inductor_options({"triton.cudagraphs": True, "triton.mix_order_reduction_split_size": 32}) == {
        "triton.cudagraphs": True, "triton.mix_order_reduction_split_size": 32}
    assert known_inductor_options({"triton.not_an_option_of_any_torch": 1, "triton.cudagraphs": False}) == {
        "triton.cudagraphs": False}
    monkeypatch.setitem(layer_compile.LAYER_COMPILE_OPTIONS, "triton.not_an_option_of_any_torch", 1)
    with pytest.raises(RuntimeError, match="not_an_option_of_any_torch"):   # what torch.compile does with it
        torch.compile(lambda x: x + 1, options=dict(layer_compile.LAYER_COMPILE_OPTIONS))(torch.ones(2))
    torch.manual_seed(0)
    model = GPTModel(tiny_config(num_layers=2))
    assert layer_compile.apply_compile([model], ParallelConfig(compile=True)) == 2
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(ids, labels=ids).float().mean().backward()
    assert all(p.grad is not None for p in model.decoder.layers["0"].parameters())


def test_cuda_graph_step_path_starts_a_generation_before_every_forward(monkeypatch):
    """The step path starts a new graph generation before every micro-batch's forward and every validation batch's,
    and the layers compiled in CUDA-graph mode train as the plain compiled ones. On the CPU Inductor runs the
    ``reduce-overhead`` layers without graphs, so only the CUDA-device check is lifted here (a real Trainer run
    otherwise); tests/gpu/test_cuda_graph.py runs the graphs themselves."""
    import torch
    from torch.utils.data import DataLoader

    import lightning_megatron.strategy.step_path as step_path
    import lightning_megatron.strategy.megatron_strategy as strategy_module
    from lightning_megatron import MegatronPrecision
    from tests.parity import ListDataset, StepLossRecorder, make_samples, new_module

    cfg = tiny_config(num_layers=2)
    steps, accumulate, val_batches = 3, 2, 2

    def fit(graphs: bool):
        import torch._dynamo

        torch._dynamo.reset()
        marks = []
        monkeypatch.setattr(step_path, "mark_step", lambda: marks.append(1))
        monkeypatch.setattr(strategy_module, "check_cuda_graph_run", lambda *args: None)
        pl.seed_everything(7, verbose=False)
        recorder = StepLossRecorder(accumulate)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                             val_check_interval=2 * accumulate, limit_val_batches=val_batches, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[recorder],
                             plugins=[MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16)],
                             strategy=MegatronStrategy(compile=True, enable_cuda_graph=graphs))
        train = DataLoader(ListDataset(make_samples(cfg, 2 * steps * accumulate)), batch_size=2)
        val = DataLoader(ListDataset(make_samples(cfg, 2 * val_batches, seed=8)), batch_size=2)
        trainer.fit(new_module(cfg, steps), train, val)
        return recorder.losses, len(marks)

    plain, plain_marks = fit(False)
    graphed, graphed_marks = fit(True)
    assert plain_marks == 0
    # every micro-batch of the 3 steps, and the 2 validation batches after the second step
    assert graphed_marks == steps * accumulate + val_batches, graphed_marks
    assert len(graphed) == steps and graphed == pytest.approx(plain, rel=1e-6)


def _fit_dp2(rank, world, samples, compiled):
    """dp2 (gloo), plain SGD, 2 steps: ``trainer.fit(torch.compile(module))`` (``compiled``) or the uncompiled module
    under ``MegatronStrategy(compile=True)``; the final weights, what the strategy made of it, the warnings."""
    import warnings

    import torch
    from torch.utils.data import DataLoader

    from tests.parity import SEED, ListDataset, new_module, trainer_for

    pl.seed_everything(SEED, verbose=False)
    module = new_module(tiny_config(num_layers=2), 2, "sgd")
    strategy = MegatronStrategy(compile=not compiled)
    trainer = trainer_for(world, strategy, 2, callbacks=[CompiledLayers()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(torch.compile(module) if compiled else module,
                    DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "compile": strategy.parallel_config.compile, "uncompiled": module._compiler_ctx is None,
            "warned": [str(w.message) for w in caught if "passed through torch.compile" in str(w.message)]}


def test_a_module_passed_through_torch_compile_trains_with_its_layers_compiled():
    """``trainer.fit(torch.compile(module))`` under MegatronStrategy (dp2, plain SGD): Lightning would hand over the
    module with its whole steps compiled (dynamo then traces the step path and fails); the strategy takes it back
    uncompiled, compiles its layers instead (``compile=True``, said in a warning), and ends with the final weights of
    the same run under ``MegatronStrategy(compile=True)``, bit for bit."""
    import torch

    from tests._dist import run_distributed
    from tests.parity import make_samples

    samples = make_samples(tiny_config(num_layers=2), 8)
    via_torch = run_distributed(_fit_dp2, 2, samples, True)
    via_flag = run_distributed(_fit_dp2, 2, samples, False)
    for rank in range(2):
        assert via_torch[rank]["compile"] and via_torch[rank]["uncompiled"]
        assert via_flag[rank]["warned"] == []
        for name, value in via_flag[rank]["weights"].items():
            assert torch.equal(via_torch[rank]["weights"][name], value), name
    assert len(via_torch[0]["warned"]) == 1 and "compile=True" in via_torch[0]["warned"][0]
