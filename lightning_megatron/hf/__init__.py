"""Hugging Face interop: Llama / Mistral / Mixtral checkpoints in and out (``pip install 'lightning-megatron[hf]'``).

* :func:`config_from_hf` / :func:`config_to_hf`: ``GPTConfig`` <-> ``config.json``.
* :func:`load_hf_weights`: a checkpoint directory into a model of any layout (each rank reads its shard only);
  :class:`HFCheckpointLoader`: the same as a Lightning callback, once the strategy has set the model up.
* :func:`export_hf`: a model of any layout to a directory ``transformers`` loads.
* :func:`to_hf` / :func:`qkv_rows`: the weight mapping itself.
* ``python -m lightning_megatron.hf import|export``: the same from the command line.

See docs/hf.md.
"""
from lightning_megatron.hf.config import config_from_hf, config_to_hf, read_hf_config
from lightning_megatron.hf.convert import HFCheckpointLoader, export_hf, load_hf_weights, write_hf
from lightning_megatron.hf.mapping import qkv_rows, to_hf

__all__ = ["config_from_hf", "config_to_hf", "read_hf_config", "load_hf_weights", "export_hf", "HFCheckpointLoader",
           "write_hf", "to_hf", "qkv_rows"]
