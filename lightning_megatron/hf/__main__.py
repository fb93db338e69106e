"""``python -m lightning_megatron.hf import|export``: Hugging Face checkpoint directories to and from our checkpoints.

* ``import HF_DIR OUT.ckpt``: a Llama / Mistral / Mixtral directory -> a weights checkpoint in the layout-independent
  form of our training checkpoints (``state_dict`` with ``model.`` names at tp=1, ``hyper_parameters.config``).
* ``export CKPT HF_DIR``: one of our checkpoints (a training checkpoint of ``--save``, or an imported one) -> a
  directory ``transformers`` loads.

Errors are reported in one line (exit code 2), never as a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch

from lightning_megatron.hf.checkpoint import DTYPES
from lightning_megatron.hf.config import config_from_hf
from lightning_megatron.hf.convert import load_hf_weights, write_hf
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.gpt import GPTModel


def import_checkpoint(src: str, out: str, dtype: str = "float32", **overrides) -> GPTConfig:
    """Convert the HF directory ``src`` into our checkpoint file ``out``; returns the config."""
    config = config_from_hf(src, **overrides)
    with torch.device("meta"):
        model = GPTModel(config)
    model.to_empty(device="cpu").to(DTYPES[dtype])
    for router in model._routers():
        router.reset_buffers()   # the routers' statistics buffers (not in the HF checkpoint)
    load_hf_weights(model, src)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"config": config.to_dict()}}, out)
    return config


def export_checkpoint(ckpt: str, out: str, architecture: Optional[str] = None, dtype: str = "float32") -> GPTConfig:
    """Convert our checkpoint file ``ckpt`` (``state_dict`` + ``hyper_parameters.config``) into the HF directory
    ``out``; returns the config."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    try:
        config = GPTConfig(**checkpoint["hyper_parameters"]["config"])
        state = checkpoint["state_dict"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{ckpt} is not a lightning-megatron checkpoint (no state_dict / hyper_parameters.config: "
                         f"{e})") from e
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    write_hf(state, config, out, architecture, dtype)
    return config


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face checkpoint directory -> our checkpoint file")
    imp.add_argument("src", help="directory with config.json and safetensors")
    imp.add_argument("out", help="checkpoint file to write")
    imp.add_argument("--seq-length", type=int, default=None)
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    exp = sub.add_parser("export", help="our checkpoint file -> a Hugging Face checkpoint directory")
    exp.add_argument("ckpt", help="checkpoint file (from --save, or from import)")
    exp.add_argument("out", help="directory to write")
    exp.add_argument("--architecture", default=None,
                     choices=["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"])
    for p in (imp, exp):
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            overrides = {k: v for k, v in (("seq_length", args.seq_length),
                                           ("make_vocab_size_divisible_by", args.make_vocab_size_divisible_by))
                         if v is not None}
            config = import_checkpoint(args.src, args.out, args.dtype, **overrides)
        else:
            config = export_checkpoint(args.ckpt, args.out, args.architecture, args.dtype)
    except (ValueError, KeyError, FileNotFoundError, ModuleNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.command}ed {config.num_parameters:,} parameters -> {args.out}")
    print(f"GPTConfig({', '.join(f'{k}={v!r}' for k, v in config.to_dict().items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
