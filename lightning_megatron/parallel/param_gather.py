"""``overlap_param_gather``: the distributed optimizer's parameter broadcast overlapped with the next forward.

The distributed optimizer (:mod:`lightning_megatron.parallel.distributed_optimizer`, torch's
``ZeroRedundancyOptimizer``) steps each rank's shard of the parameters and then broadcasts every shard from its
owner over the data-parallel group, waiting for all of it before the step returns. With this option the step
starts the same broadcasts (asynchronously, in the same order) and returns; a forward pre-hook on every module
that holds parameters waits for that module's own parameters just before it runs, so the broadcasts of later
layers proceed under the forward of earlier ones. :meth:`OverlappedParamGather.wait_all` waits for what is still
in flight wherever whole weights are needed outside a forward (before the next optimizer step, checkpoints, the
end of training). The values are the broadcast values: the result is identical to the blocking path.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["OverlappedParamGather", "zero_optimizers"]


def zero_optimizers(optimizers: Iterable[Any]) -> List[ZeroRedundancyOptimizer]:
    """The ``ZeroRedundancyOptimizer`` s behind ``optimizers`` (unwrapping a ``LightningOptimizer`` and the parts of
    an :class:`~lightning_megatron.parallel.distributed_optimizer.ExpertShardedOptimizer`)."""
    from lightning_megatron.parallel.distributed_optimizer import ExpertShardedOptimizer

    found: List[ZeroRedundancyOptimizer] = []
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        if isinstance(opt, ZeroRedundancyOptimizer):
            found.append(opt)
        elif isinstance(opt, ExpertShardedOptimizer):
            found += [zero for zero, _ in opt.parts]
    return found


class OverlappedParamGather:
    """Start the parameter broadcasts of ``optimizers`` (ZeRO, over their data-parallel group) after their step
    without waiting, and wait for each module's own parameters in a forward pre-hook of ``module``'s submodules.

    Args:
        optimizers: the distributed optimizers (their ``_sync_params`` is replaced on these instances).
        module: the model; every submodule with parameters of its own gets a pre-hook.
        also_waits: extra parameters a module reads besides its own, e.g. ``{output_layer: [word embedding
            weight]}`` for a tied LM head on a pipeline stage whose embedding does not run.
        after_wait: called with ``(parameter, the tensor broadcast into)`` once a broadcast is complete: bf16
            parameters (:meth:`~lightning_megatron.parallel.param_buffer.buffer.MainParams.adopt_broadcast`) take their bf16
            copies (and remainders) from the fp32 main values the optimizer's owner rank sent.
    """

    def __init__(self, optimizers: Sequence[ZeroRedundancyOptimizer], module: nn.Module,
                 also_waits: Optional[Dict[nn.Module, List[nn.Parameter]]] = None,
                 after_wait: Optional[Callable[[nn.Parameter, Tensor], None]] = None) -> None:
        #: ``id(p)`` -> (the broadcast's work, p, the tensor it writes)
        self.pending: Dict[int, Tuple[Any, nn.Parameter, Tensor]] = {}
        self.after_wait = after_wait
        #: broadcasts waited for by a forward pre-hook, over all steps (the rest by :meth:`wait_all`)
        self.waited_in_forward = 0
        self.optimizers = list(optimizers)
        for zero in self.optimizers:
            if zero.parameters_as_bucket_view:
                raise ValueError("overlap_param_gather needs ZeroRedundancyOptimizer(parameters_as_bucket_view=False) "
                                 "(the per-parameter broadcasts a layer waits for)")
            zero._sync_params = self._launcher(zero)   # type: ignore[method-assign]
        extra = also_waits or {}
        self._hooks = []
        for m in module.modules():
            own = list(m.parameters(recurse=False)) + list(extra.get(m, []))
            if own:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(own)))

    def _launcher(self, zero: ZeroRedundancyOptimizer):
        def launch() -> None:
            """Broadcast every rank's shard from it, as ``ZeroRedundancyOptimizer._sync_params``, without waiting."""
            group = zero.process_group
            partitions = zero._partition_parameters()
            for rank in range(zero.world_size):
                src = dist.get_global_rank(group, rank)
                for param_group in partitions[rank]:
                    for p in param_group["params"]:
                        data = p.data
                        self.pending[id(p)] = (dist.broadcast(data, src=src, group=group, async_op=True), p, data)
        return launch

    def _waiter(self, params: List[nn.Parameter]):
        ids = [id(p) for p in params]

        @torch.compiler.disable
        def wait_own(module: nn.Module, args: Any) -> None:
            if self.pending:
                for i in ids:
                    entry = self.pending.pop(i, None)
                    if entry is not None:
                        self._finish(entry)
                        self.waited_in_forward += 1
        return wait_own

    def wait_all(self) -> None:
        """Wait for every broadcast still in flight (in the order they were started)."""
        entries, self.pending = list(self.pending.values()), {}
        for entry in entries:
            self._finish(entry)

    def _finish(self, entry: Tuple[Any, nn.Parameter, Tensor]) -> None:
        work, p, data = entry
        work.wait()
        if self.after_wait is not None:
            self.after_wait(p, data)

    def remove(self) -> None:
        """Wait, then restore the optimizers' blocking broadcast and remove the hooks."""
        self.wait_all()
        for zero in self.optimizers:
            zero.__dict__.pop("_sync_params", None)
        for h in self._hooks:
            h.remove()
        self._hooks = []
