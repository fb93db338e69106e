"""The delayed recipe's per-step update over all GEMMs at once: the step's amaxes (their records), reduced over
the amax groups, rolled into the histories, and every GEMM's scales recomputed from them (a fixed number of
operations for any number of GEMMs; no host read once every GEMM has a history)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel.tensor_parallel.mappings import group_size
from lightning_megatron.precision.fp8.gemm import (_GRAD, _NO_RING, Float8Gemm, _forget_uses, _ring_last_amax,
                                                   scale_from_amax)

def _end_step(gemms: Sequence["Float8Gemm"], groups: Sequence[Any], num_microbatches: Optional[int]) -> None:
    """The step's amaxes ``[len(gemms), 3]`` of ``gemms`` (their records; the last ``num_microbatches`` uses when
    given), one all-reduce (max) per group, rolled into their histories: a fixed number of kernels for all GEMMs,
    none of them a host read once every GEMM has a history. A GEMM without uses this step contributes -1 (it must
    still join: every rank of a group calls with the same GEMMs) and leaves its history as it is."""
    if not gemms:
        return
    recorded = [g for g in gemms if g.running is not None]
    if not recorded and not any(group_size(g) > 1 for g in groups):
        return
    if recorded:
        device = recorded[0].running.device
    else:
        default = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = next((g.history.device for g in gemms if g.history is not None), default)
    none = torch.full((3,), -1.0, device=device)
    if num_microbatches is None:
        amax = torch.stack([g.running if g.running is not None else none for g in gemms])          # [n, 3]
    else:
        amax = _last_uses_amax(gemms, num_microbatches, none)
    used = (amax >= 0).any(dim=1, keepdim=True)           # a kind without uses beside used ones counts 0
    amax = torch.where(used, amax.clamp(min=0.0), -1.0)
    for g in recorded:
        if num_microbatches is not None and g.uses is not None and num_microbatches > g.uses.shape[1]:
            # room for every micro-batch next time, marked as before
            g.allocate(device, ring=True, capacity=2 * num_microbatches, static=g.static)
    _forget_uses(recorded)
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    _roll_histories(gemms, amax)
    _refresh_scales(gemms)


def _last_uses_amax(gemms: Sequence["Float8Gemm"], last: int, none: Tensor) -> Tensor:
    """``[n, 3]``: per GEMM and kind the largest amax of its last ``last`` recorded uses (``none`` for a GEMM that
    never recorded): rings of one capacity are read all at once, others one by one."""
    recorded = [g for g in gemms if g.running is not None]
    if any(g.uses is None for g in recorded):
        raise RuntimeError(_NO_RING)
    if len({g.uses.shape for g in recorded}) > 1:
        return torch.stack([g.last_uses_amax(last) if g.running is not None else none for g in gemms])
    mine = _ring_last_amax(torch.stack([g.uses for g in recorded]),                 # [k, 3, capacity]
                           torch.stack([g.use_count for g in recorded]), last).unbind(0)
    picked = iter(mine)
    return torch.stack([next(picked) if g.running is not None else none for g in gemms])


def _roll_histories(gemms: Sequence["Float8Gemm"], amax: Tensor) -> None:
    """Roll row ``i`` of ``amax`` ``[n, 3]`` into the history ``[3, L]`` of ``gemms[i]`` in place, unless it holds
    -1 (no use on any rank). The histories that exist are updated in one pass on the device; a GEMM without one (first
    steps) starts it when its row is valid, which is read on the host once for all of them."""
    rows = amax.unbind(0)     # views: picking rows by a host-side list launches no index copy to the device
    have = [i for i, g in enumerate(gemms) if g.history is not None]
    if have:
        histories = [gemms[i].history for i in have]
        old = torch.stack(histories)                                               # [k, 3, L]
        mine = torch.stack([rows[i] for i in have]) if len(have) < len(gemms) else amax
        rolled = torch.cat([mine.unsqueeze(2), old[:, :, :-1]], dim=2)
        valid = (mine >= 0).all(dim=1).view(-1, 1, 1)
        torch._foreach_copy_(histories, list(torch.where(valid, rolled, old).unbind(0)))
    new = [i for i, g in enumerate(gemms) if g.history is None]
    if new:
        starts = (torch.stack([rows[i] for i in new]) >= 0).all(dim=1).tolist()
        for i, start in zip(new, starts):
            if start:
                history = torch.zeros(3, gemms[i].config.amax_history_len, device=amax.device)
                history[:, 0] = rows[i]
                gemms[i].history = history


def _refresh_scales(gemms: Sequence["Float8Gemm"]) -> None:
    """Each history's scales and their reciprocals (``Float8Gemm.scales``, six 0-d tensors), for all GEMMs with a history
    at once: per kind the scale of the history's amax (its newest entry, or its largest with ``amax_compute_algo=
    "max"``) in the kind's format (the forward format for inputs and weights, the gradient format for output
    gradients), updated in place (a fixed number of operations for any number of GEMMs) so compiled layers and their
    CUDA graphs keep reading the same tensors. A GEMM's first scales are new tensors, marked as its records are
    (``static``)."""
    by_scaling: Dict[Tuple[Any, ...], List["Float8Gemm"]] = {}
    for g in gemms:
        if g.history is not None:
            c = g.config
            by_scaling.setdefault((c.forward_dtype, c.grad_dtype, c.margin, c.amax_compute_algo,
                                   g.history.device), []).append(g)
    for (fwd, bwd, margin, algo, _), group in by_scaling.items():
        histories = torch.stack([g.history for g in group])                                # [n, 3, L]
        amax = histories[:, :, 0] if algo == "most_recent" else histories.amax(dim=2)       # [n, 3]
        scale = torch.cat([scale_from_amax(amax[:, :_GRAD], fwd, margin),
                           scale_from_amax(amax[:, _GRAD:], bwd, margin)], dim=1)
        values = torch.cat([scale, scale.reciprocal()], dim=1).reshape(-1).unbind(0)          # 6n 0-d views
        have = [i for i, g in enumerate(group) if g.scales is not None]
        if have:
            torch._foreach_copy_([t for i in have for t in group[i].scales],
                                 [values[6 * i + j] for i in have for j in range(6)])
        for i, g in enumerate(group):
            if g.scales is None:
                g.scales = tuple(v.clone() for v in values[6 * i:6 * i + 6])   # six tensors of their own
                if g.static:
                    from torch._dynamo import mark_static_address

                    for t in g.scales:
                        mark_static_address(t, guard=False)
