"""Unknown keywords fail at construction, before any process starts, naming the closest valid keyword; every DDP
keyword still reaches torch DDP; every keyword the README documents is accepted."""
import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import GPTConfig, MegatronStrategy
from tests._dist import run_distributed
from tests.parity import ListDataset, make_samples, new_module, tiny_config, trainer_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict()], ids=["tp-only", "pp2", "dp"])
def test_misspelt_strategy_keyword_names_the_right_one(layout):
    with pytest.raises(TypeError, match=r"unexpected keyword argument `sequence_paralel`; did you mean `sequence_parallel`"):
        MegatronStrategy(**layout, sequence_paralel=True)
    with pytest.raises(TypeError, match="`tp_comm_overlapp`; did you mean `tp_comm_overlap`"):
        MegatronStrategy(**layout, tp_comm_overlapp=True)


def test_misspelt_config_keyword_names_the_right_one():
    with pytest.raises(TypeError, match=r"GPTConfig got an unexpected keyword argument `hiden_size`; did you mean `hidden_size`"):
        GPTConfig(hiden_size=64)
    with pytest.raises(TypeError, match=r"GPTConfig.replace got .* `num_layer`; did you mean `num_layers`"):
        GPTConfig.tiny().replace(num_layer=3)
    with pytest.raises(TypeError, match="did you mean `num_attention_heads`"):
        GPTConfig.tiny(num_atention_heads=4)
    assert GPTConfig.tiny().replace(num_layers=3).num_layers == 3


def test_ddp_keywords_are_refused_naming_what_replaces_them():
    """torch DDP wraps no model of the strategy (the parameters' buffer reduces the gradients): its keywords would do
    nothing, so each is a ValueError naming the replacement; a misspelt one stays a TypeError."""
    cases = {"bucket_cap_mb": (1, "Give bucket_size= instead"),
             "find_unused_parameters": (True, "not needed: a parameter without a gradient joins"),
             "gradient_as_bucket_view": (False, "always views of the buffer"),
             "broadcast_buffers": (False, "no counterpart"),
             "ddp_comm_hook": (lambda state, bucket: None, "grad_reduce_in_bf16=True")}
    for name, (value, replacement) in cases.items():
        with pytest.raises(ValueError, match=rf"MegatronStrategy\({name}=.*DistributedDataParallel.*{replacement}"):
            MegatronStrategy(**{name: value})
    with pytest.raises(TypeError, match="did you mean `bucket_cap_mb`"):
        MegatronStrategy(bucket_cap_mbb=1)


def test_every_documented_strategy_keyword_is_accepted():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `MegatronStrategy("))
    documented = re.findall(r"[`(, ](\w+)=", row)
    assert len(documented) >= 15, documented
    from lightning_megatron.strategy import LAYOUT_OPTIONS

    accepted = set(inspect.signature(MegatronStrategy.__init__).parameters) | set(LAYOUT_OPTIONS)
    missing = [name for name in documented if name not in accepted]
    assert not missing, f"README documents MegatronStrategy keywords it does not accept: {missing}"
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for call in re.findall(r"MegatronStrategy\(([^()]*)\)", doc.read_text()):
            for name in re.findall(r"(\w+)=", call):
                assert name in accepted, (doc.name, name)


def test_misspelt_precision_keyword_names_the_right_one():
    from lightning_megatron import MegatronPrecision

    with pytest.raises(TypeError, match=r"MegatronPrecision got an unexpected keyword argument `fp8_recipie`; did you mean `fp8_recipe`"):
        MegatronPrecision("bf16-mixed", fp8_recipie="delayed")
