"""Token sampling and the incremental-decoding loop behind :meth:`ParallelGPTModule.generate`.

The loop knows nothing of parallelism: it is given ``next_logits`` (the full-vocabulary logits of the last
position for new tokens, ``None`` on ranks that do not compute them) and ``share`` (hands the chosen tokens to
every rank that takes part), which :mod:`lightning_megatron.models.module` builds for the layout.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

NextLogits = Callable[[Tensor, Tensor], Optional[Tensor]]


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], max_new_tokens: int) -> None:
    """Raise ValueError naming the first bad sampling argument."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None or an integer >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be None or in (0, 1]")


def sample_next_token(logits: Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                      top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """The next token of each row of ``logits`` ``[b, V]`` (the real vocabulary only): ``[b]`` int64.

    ``temperature == 0``: the arg-max (greedy). Otherwise a draw from ``softmax(logits / temperature)`` restricted
    to the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p`` (nucleus),
    using ``generator``.
    """
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p   # tokens after the set reached top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate_tokens(next_logits: NextLogits, share: Callable[[Optional[Tensor]], Tensor], prompt: Tensor,
                    max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """Extend ``prompt`` ``[b, s]`` by ``max_new_tokens`` tokens: ``[b, s + max_new_tokens]``.

    ``next_logits(tokens [b, n], position_ids [b, n])`` runs the new tokens (the prompt first, then one token at
    a time; the model keeps the earlier ones in its KV cache) and returns the last position's logits ``[b, V]``
    over the real vocabulary, or None where this rank does not compute them; ``share(tokens or None)`` returns
    the chosen tokens ``[b]`` on every rank.
    """
    b, s = prompt.shape
    out = [prompt]
    tokens = prompt
    positions = torch.arange(s, device=prompt.device).unsqueeze(0).expand(b, s)
    for step in range(max_new_tokens):
        logits = next_logits(tokens, positions)
        chosen = sample_next_token(logits, temperature, top_k, top_p, generator) if logits is not None else None
        tokens = share(chosen).view(b, 1).to(prompt.device)
        out.append(tokens)
        positions = torch.full((b, 1), s + step, device=prompt.device, dtype=torch.long)
    return torch.cat(out, dim=1)
