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
    from lightning_megatron.parallelize import apply_compile

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

