"""Keys and values of earlier positions for incremental decoding (generation), one entry per transformer layer.

Plain tensors, no parallelism: under tensor parallelism each rank's cache holds its own query groups' keys and
values, under pipeline parallelism only its stages' layers.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor


class LayerKVCache:
    """One attention layer's cached keys and values ``[b, g, length, d]`` (``g``: this rank's query groups)."""

    def __init__(self) -> None:
        self.keys: Optional[Tensor] = None
        self.values: Optional[Tensor] = None

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Add the keys and values ``[b, g, s, d]`` of ``s`` new positions; returns all ``[b, g, length, d]``."""
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values


class KVCache:
    """The per-layer caches of a model (or of this rank's pipeline stages), keyed by global layer index."""

    def __init__(self) -> None:
        self.layers: Dict[str, LayerKVCache] = {}

    def layer(self, key: str) -> LayerKVCache:
        """The cache of layer ``key`` (created empty on first use)."""
        if key not in self.layers:
            self.layers[key] = LayerKVCache()
        return self.layers[key]
