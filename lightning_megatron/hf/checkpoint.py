"""Hugging Face checkpoint directories: safetensors files (one, or sharded with ``model.safetensors.index.json``)
read tensor by tensor and slice by slice, and written with a ``config.json``."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from lightning_megatron.hf._require import require_safetensors

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpoint:
    """The safetensors tensors of checkpoint directory ``path``: :attr:`names`, and :meth:`get_slice` (a lazy
    handle whose ``[box]`` reads only that part). Files are opened on first use only."""

    def __init__(self, path: str) -> None:
        require_safetensors()
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.files: Dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(self.path, SINGLE)):
            from safetensors import safe_open

            with safe_open(os.path.join(self.path, SINGLE), framework="pt") as f:
                self.files = {name: SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path} holds neither {INDEX} nor {SINGLE}: pass a Hugging Face checkpoint "
                                    "directory saved in safetensors (save_pretrained's default)")
        self.names = set(self.files)
        self._open: Dict[str, Any] = {}

    def get_slice(self, name: str) -> Any:
        """A lazy view of tensor ``name`` (``get_shape()``, ``[slices]`` reads those elements only)."""
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self._open[file].get_slice(name)


def save_hf_checkpoint(path: str, tensors: Dict[str, Tensor], config: Dict[str, Any],
                       max_shard_bytes: Optional[int] = 5 * 2**30) -> None:
    """Write ``tensors`` as safetensors in ``path`` (split into files of at most ``max_shard_bytes`` with a
    ``model.safetensors.index.json`` when larger; one ``model.safetensors`` otherwise) and ``config`` as
    ``config.json``."""
    require_safetensors()
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and max_shard_bytes is not None and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
