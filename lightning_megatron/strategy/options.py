"""The keywords of :class:`~lightning_megatron.MegatronStrategy`: which go to :class:`ParallelConfig` (the layout
and its options), which to ``DistributedDataParallel`` or Lightning's DDP hooks, and the process-group timeout;
plus the constructor signature that shows the layout options to ``inspect`` and LightningCLI."""
from __future__ import annotations

import dataclasses
import inspect
import typing
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from torch.nn.parallel import DistributedDataParallel

from lightning_megatron.utils.keywords import check_keywords
from lightning_megatron.parallel.config import ParallelConfig

#: keywords of ``DDPStrategy`` itself that reach Lightning's DDP hook registration
DDP_STRATEGY_KEYWORDS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
#: ``DistributedDataParallel`` arguments the strategy sets itself
DDP_SET_BY_STRATEGY = ("self", "module", "device_ids", "output_device")
#: the layout options (every init field of ParallelConfig) a MegatronStrategy keyword may set
LAYOUT_OPTIONS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.init)
#: ``MegatronStrategy.__init__``'s own named parameters (the layout's sizes, then Lightning's); every other keyword
#: is a layout option, a DDP argument or a DDP hook option (``tests/test_strategy.py`` holds this to the signature)
STRATEGY_KEYWORDS = ("tp", "pp", "vp", "cp", "ep", "etp", "sequence_parallel", "accelerator", "parallel_devices",
                     "cluster_environment", "checkpoint_io", "precision_plugin", "process_group_backend", "timeout",
                     "start_method", "max_restarts", "dry_run")


def parallel_config_from_options(options: Dict[str, Any], timeout: Optional[timedelta], default_timeout: timedelta,
                                 own_keywords: Iterable[str], **layout: Any) -> Tuple[ParallelConfig, Optional[timedelta]]:
    """Take the :data:`LAYOUT_OPTIONS` out of ``options`` (the strategy's ``**options``; what stays there goes to
    ``DDPStrategy``) and build the :class:`ParallelConfig` of ``layout`` (``tp``, ``pp``, ...) and them.

    ``distributed_timeout_minutes`` (Megatron's name) sets the returned timeout unless ``timeout`` (not
    ``default_timeout``) disagrees, which raises ValueError. A keyword that is neither one of ``own_keywords``, a
    layout option, a DDP argument nor a DDP hook option raises TypeError naming the closest valid one.
    """
    if "overlap_cp_a2a" in options:
        raise ValueError("overlap_cp_a2a was removed: splitting the a2a layers' projections around their "
                         "exchanges measured no gain on 2xH200 (benchmarks/RESULTS.md). The a2a layers overlap "
                         "their backward exchanges by default (delay_wgrad_compute); drop overlap_cp_a2a")
    layout.update({k: options.pop(k) for k in list(options) if k in LAYOUT_OPTIONS})
    minutes = layout.get("distributed_timeout_minutes")
    if minutes is not None and not isinstance(minutes, bool) and isinstance(minutes, (int, float)) and minutes > 0:
        if timeout is not default_timeout and timeout != timedelta(minutes=minutes):
            raise ValueError(f"timeout={timeout!r} and distributed_timeout_minutes={minutes!r} disagree: both set "
                             "the timeout of every process group; give one of them")
        timeout = timedelta(minutes=minutes)
    ddp = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in DDP_SET_BY_STRATEGY]
    check_keywords("MegatronStrategy", options,
                   list(own_keywords) + list(LAYOUT_OPTIONS) + list(DDP_STRATEGY_KEYWORDS) + ddp)
    refuse_ddp_keywords(options)
    return ParallelConfig(**layout), timeout


#: what replaces a torch DDP keyword now that the parameter-and-gradient buffer reduces the gradients
DDP_REPLACEMENTS = {
    "bucket_cap_mb": "Give bucket_size= instead (elements per bucket of the buffer).",
    "find_unused_parameters": "It is not needed: a parameter without a gradient joins its bucket's reduction with "
                              "zeros.",
    "gradient_as_bucket_view": "It is not needed: the gradients are always views of the buffer's buckets.",
    "static_graph": "It is not needed: each bucket is reduced once its last gradient of the step has arrived.",
    "ddp_comm_hook": "To communicate in bf16, give grad_reduce_in_bf16=True instead.",
    "ddp_comm_state": "To communicate in bf16, give grad_reduce_in_bf16=True instead.",
    "ddp_comm_wrapper": "To communicate in bf16, give grad_reduce_in_bf16=True instead.",
}


def refuse_ddp_keywords(options: Dict[str, Any]) -> None:
    """ValueError for a ``DistributedDataParallel`` argument or Lightning DDP hook option in ``options``: torch DDP
    wraps no model of :class:`~lightning_megatron.MegatronStrategy` (the contiguous parameter-and-gradient buffer,
    or FSDP2 at its levels, reduces the gradients), so such a keyword would do nothing. The message names what
    replaces it (:data:`DDP_REPLACEMENTS`)."""
    if not options:
        return
    name = sorted(options)[0]
    instead = DDP_REPLACEMENTS.get(name, "It has no counterpart here.")
    raise ValueError(
        f"MegatronStrategy({name}={options[name]!r}): {name} is an option of torch DistributedDataParallel, which "
        "this strategy does not use (the parameters' contiguous buffer, or FSDP2 at the FSDP sharding levels, "
        f"reduces the gradients). {instead} Drop {name}=.")


def signature_with_layout_options(init: Callable[..., None]) -> inspect.Signature:
    """``init``'s signature (``MegatronStrategy.__init__``) with the :class:`ParallelConfig` options (its
    ``**options``) as keyword-only parameters of their own types and defaults, so that ``inspect.signature`` and
    LightningCLI's parser (``trainer.strategy.init_args`` in a YAML file) see every layout keyword; the other
    ``**options`` (DDP's keywords) stay accepted by the constructor."""
    sig = inspect.signature(init)
    hints = typing.get_type_hints(ParallelConfig)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for f in dataclasses.fields(ParallelConfig):
        if f.init and f.name not in sig.parameters:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=hints[f.name]))
    return sig.replace(parameters=params)
