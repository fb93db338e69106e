"""An optimizer's parameter groups as the distributed optimizers rebuild and index them. No communication."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence

from torch.optim import Optimizer

__all__ = ["constructor_kwargs", "indexed_param_groups"]


def constructor_kwargs(optimizer: Optimizer) -> Dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW records ``decoupled_weight_decay`` in its
    defaults but does not take it)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def indexed_param_groups(groups: Sequence[Dict[str, Any]], sizes: Optional[Sequence[int]] = None
                         ) -> List[Dict[str, Any]]:
    """``groups``' hyper-parameters with their parameters as consecutive indices (``torch.optim.Optimizer.
    state_dict()``'s form): group ``i`` takes ``sizes[i]`` indices (default: its own parameter count)."""
    out, start = [], 0
    for i, g in enumerate(groups):
        n = len(g["params"]) if sizes is None else sizes[i]
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    return out
