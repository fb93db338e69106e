"""``SampleContinuation``: at the end of training, print how the model continues a prompt (greedy, a few tokens)."""
from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch


class SampleContinuation(pl.Callback):
    """At the end of ``fit`` (still on the training device and layout), continue ``prompt`` by ``max_new_tokens``
    tokens with :meth:`lightning_megatron.ParallelGPTModule.generate` (greedy unless ``temperature > 0``; every rank
    takes part) and print it on global rank 0 as ``sample: '<prompt and continuation>'``. The last result is kept
    in :attr:`text`.

    Args:
        prompt: text, encoded with ``tokenizer``.
        tokenizer: anything with ``encode(str) -> list[int]`` and ``decode(list[int]) -> str``.
        max_new_tokens: how many tokens to add (keep it small: one forward of the model per token).
    """

    def __init__(self, prompt: str, tokenizer: Any, max_new_tokens: int = 16, temperature: float = 0.0) -> None:
        self.prompt, self.tokenizer = prompt, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.text: Optional[str] = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ids = torch.tensor([self.tokenizer.encode(self.prompt)], dtype=torch.long)
        out = pl_module.generate(ids, self.max_new_tokens, temperature=self.temperature)
        self.text = self.tokenizer.decode(out[0].tolist())
        if trainer.is_global_zero:
            print(f"sample: {self.text!r}", flush=True)
