"""Lightning features :class:`~lightning_megatron.strategy.MegatronStrategy` cannot run under some layouts, refused
before anything runs (:func:`check_lightning_features`, at ``setup_environment``, from the configuration alone, so
every rank raises at once and none waits in a collective), ``StochasticWeightAveraging`` made to average the
parameters that exist after the model is built (:func:`attach_weight_averages`), and a module compiled with
``torch.compile`` trained with its transformer layers compiled instead (:func:`adopt_compiled_module`)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_megatron.contract import ParallelLightningModule

__all__ = ["check_lightning_features", "check_short_pipeline_steps", "attach_weight_averages", "AveragedParameters",
           "layout_name", "adopt_compiled_module"]


def layout_name(cfg: Any) -> str:
    """``MegatronStrategy(tp=2, sequence_parallel=True, pp=2)``: the layout's non-default dimensions, for messages."""
    parts = [f"{name}={getattr(cfg, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(cfg, name) > 1]
    if getattr(cfg, "vp", None) and cfg.vp > 1:
        parts.append(f"vp={cfg.vp}")
    if cfg.sequence_parallel:
        parts.append("sequence_parallel=True")
    return f"MegatronStrategy({', '.join(parts)})"


def _shards_parameters(cfg: Any, params_dtype: Any) -> Optional[str]:
    """Why this layout's ranks do not each hold the whole model in its training dtype (None when they do)."""
    if cfg.tp > 1:
        return f"tp={cfg.tp} shards the weights over the tensor-parallel ranks"
    if cfg.pp > 1:
        return f"pp={cfg.pp} holds each pipeline stage's layers on its own rank"
    if cfg.ep > 1:
        return f"ep={cfg.ep} holds each rank's own experts"
    if cfg.fsdp:
        return f"data_parallel_sharding_strategy={cfg.data_parallel_sharding_strategy!r} shards the weights"
    if params_dtype is not None:
        return ("MegatronPrecision(params_dtype=...) keeps bf16 compute copies of fp32 main parameters, which the "
                "average would bypass")
    return None


def check_lightning_features(trainer: "pl.Trainer", module: "pl.LightningModule", cfg: Any,
                             params_dtype: Any = None) -> None:
    """When fitting, raise ValueError, naming the Lightning feature, the layout and what to use instead, for what this
    layout cannot run:

    * manual optimization (``automatic_optimization = False``) under pp > 1: the pipeline schedule runs the forward
      and backward of a whole step's micro-batches at once, so there is no per-micro-batch backward to call;
    * a ``LightningModule.backward`` override under pp > 1 (the schedule runs the backward);
    * ``StochasticWeightAveraging`` where ranks do not each hold the whole model (tp, pp, ep, FSDP, bf16 parameters):
      its copy of the module would hold full tensors or shards that its checkpoint state cannot place.
    """
    if trainer.state.fn != TrainerFn.FITTING:   # validate / test / predict run none of these
        return
    layout = layout_name(cfg)
    if cfg.pp > 1 and not module.automatic_optimization:
        raise ValueError(
            f"manual optimization ({type(module).__name__}.automatic_optimization = False) is not supported under "
            f"{layout}: the pipeline schedule runs the forward and backward of all of a step's micro-batches together, "
            "so there is no loss to call manual_backward on. Use automatic optimization (Trainer("
            "accumulate_grad_batches=...) sets the micro-batches per step), or pp=1 (manual optimization works with "
            "tp, cp, ep and dp)")
    if cfg.pp > 1 and type(module).backward is not pl.LightningModule.backward:
        raise ValueError(
            f"{type(module).__name__}.backward overrides LightningModule.backward, which {layout} cannot call: the "
            "pipeline schedule runs every micro-batch's backward itself. Remove the override (on_before_backward / "
            "on_after_backward still fire once per micro-batch), or train with pp=1")
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            why = _shards_parameters(cfg, params_dtype)
            if why is not None:
                raise ValueError(
                    f"StochasticWeightAveraging is not supported under {layout}: {why}, and the callback's copy of "
                    "the module (and the average it saves in checkpoints) would not match them. Use it with "
                    "MegatronStrategy's data and context parallelism only (tp = pp = ep = 1, fp32 parameters), or "
                    "average saved checkpoints after training instead")


def check_short_pipeline_steps(trainer: "pl.Trainer", schedule: str, pp: int, fewest: Callable[[str, int], int],
                               runs_short_steps: bool) -> None:
    """Under pp > 1 with a schedule that cannot run a step of fewer micro-batches than ``fewest(schedule, pp)`` (and
    no stand-in schedule for such a step, ``runs_short_steps`` False): ValueError before training when a step would
    have fewer (``fast_dev_run``, ``accumulate_grad_batches``, an epoch's short last step), naming them."""
    if runs_short_steps:
        return
    need = fewest(schedule, pp)
    batches = trainer.num_training_batches
    accumulate = trainer.accumulate_grad_batches
    if not isinstance(batches, int):   # an iterable of unknown length: the step path's own check holds
        return
    sizes = {min(accumulate, batches)} | ({batches % accumulate} if batches % accumulate else set())
    short = min(sizes)
    if short >= need:
        return
    what = ("fast_dev_run runs one batch" if trainer.fast_dev_run else
            f"accumulate_grad_batches={accumulate}" if short == min(accumulate, batches) and accumulate < need else
            f"an epoch of {batches} training batches with accumulate_grad_batches={accumulate} ends with a step "
            f"of {short}")
    raise ValueError(
        f"pipeline_schedule={schedule!r} with pp={pp} needs at least {need} micro-batches per optimizer step, and "
        f"{what}: a step of {short} micro-batch(es). Make every step have >= {need} (Trainer("
        f"accumulate_grad_batches>={need}), limit_train_batches / the dataset length a multiple of it, no "
        "fast_dev_run) or use a schedule that runs any number (pipeline_schedule='gpipe' or '1f1b')")


class AveragedParameters(nn.Module):
    """The running average ``StochasticWeightAveraging`` keeps: one tensor per parameter of the module, in its
    ``parameters()`` order, on this rank (the callback averages and transfers parameter by parameter).
    ``before_read`` runs before the callback reads the module's parameters (parameters still being gathered by an
    overlapped distributed optimizer are waited for)."""

    def __init__(self, module: nn.Module, before_read: Callable[[], None]) -> None:
        super().__init__()
        self.params = nn.ParameterList(
            [nn.Parameter(p.detach().clone(), requires_grad=False) for p in module.parameters()])
        object.__setattr__(self, "_before_read", before_read)

    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        self._before_read()
        return super().parameters(recurse)


def attach_weight_averages(trainer: "pl.Trainer", module: nn.Module, before_read: Callable[[], None]) -> List[Any]:
    """Give every ``StochasticWeightAveraging`` callback an average of ``module``'s parameters as they are now (after
    the strategy built and placed them): the callback copied the module at its ``setup``, before
    ``configure_model`` built the model, so its copy has no parameters to average."""
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, StochasticWeightAveraging)]
    for callback in callbacks:
        callback._average_model = AveragedParameters(module, before_read)
    return callbacks


def adopt_compiled_module(module: "pl.LightningModule", cfg: Any) -> None:
    """``trainer.fit(torch.compile(module))`` for a :class:`~lightning_megatron.contract.ParallelLightningModule`:
    Lightning hands the strategy the module with its step methods compiled whole, which would trace the step path
    (its collectives, the pipeline schedule, the non-finite checks). The module is taken back uncompiled (Lightning's
    ``to_uncompiled``) and ``cfg.compile`` turned on: each transformer layer, the head and the loss are compiled
    instead (``apply_compile``, with the library's Inductor options; the ``torch.compile`` arguments are not used),
    with a warning that says so. Other modules (Lightning's own loop) keep their compiled steps."""
    if getattr(module, "_compiler_ctx", None) is None or not isinstance(module, ParallelLightningModule):
        return
    to_uncompiled(module)
    rank_zero_warn(
        f"{type(module).__name__} was passed through torch.compile: MegatronStrategy trains it uncompiled around its "
        "step path and compiles each transformer layer, the head and the loss instead (compile=True; the arguments "
        "given to torch.compile are not used). Pass the module itself and MegatronStrategy(compile=True) to say so.",
        category=UserWarning)
    cfg.compile = True
