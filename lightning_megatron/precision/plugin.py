"""``MegatronPrecision``: Megatron's mixed precision and FP8 as a Lightning precision plugin.

``Trainer(strategy=MegatronStrategy(...), plugins=[MegatronPrecision("bf16-mixed", fp8="hybrid")])``.

* ``"bf16-mixed"``: autocast to bf16, fp32 parameters, gradients and optimizer states (Lightning's).
* ``"16-mixed"``: autocast to fp16 with dynamic loss scaling (``torch.amp.GradScaler``) that works under every
  layout: gradients are always unscaled before clipping, and the scaler's found-inf flag is reduced (max) over
  all ranks, i.e. every tensor, pipeline, context, expert and data parallel group, so every rank skips the same
  steps and keeps the same loss scale. The MoE aux-loss gradient gets the same loss scale
  (``MegatronStrategy`` multiplies the routers' scale by it).
* ``"32-true"``: fp32 (FP8 GEMMs may still be asked for).
* ``fp8``: the linear layers' GEMMs in FP8 (:mod:`lightning_megatron.precision.fp8`), applied by
  :func:`lightning_megatron.parallelize` in its ``apply_fp8`` step; the torch-native backend
  (``torch._scaled_mm``, also on CPU) or Transformer Engine (imported only when asked for).

What a strategy reads of this plugin goes through two typed entry points, and nothing outside this package reads its
fields: :meth:`MegatronPrecision.param_precision` (:class:`ParamPrecision`: how parameters are stored, resolved
against the layout) and :meth:`MegatronPrecision.parallelize_step` (binds the plugin to its device and mesh and
gives ``parallelize`` the FP8 step, whose handle the plugin then keeps for its compile stance and checkpoint
state).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import LBFGS, Optimizer

import lightning.pytorch as pl
from lightning_megatron.precision.fp8 import (
    AMAX_COMPUTE_ALGOS,
    FP8_BACKENDS,
    FP8_FORMATS,
    FP8_RECIPES,
    Float8Config,
    Float8Layers,
    Float8Step,
    fp8_forward_context,
)
from lightning_megatron.utils.keywords import check_keywords

if TYPE_CHECKING:
    from lightning_megatron.parallel.config import ParallelConfig
    from lightning_megatron.parallel.mesh import ParallelMesh

PRECISIONS = ("bf16-mixed", "16-mixed", "32-true")
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class ParamPrecision:
    """How the parameter-and-gradient buffer (:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`) stores
    the parameters of a run: the precision plugin's ``params_dtype`` / ``store_param_remainders`` resolved against
    the layout (:meth:`MegatronPrecision.param_precision`), read in this one place and passed on by the strategy.

    Attributes:
        params_dtype: ``torch.bfloat16``: Megatron's bf16 parameters held by the buffer, with fp32 main parameters
            and fp32 main gradients; None: the parameters in their own dtype (fp32; also under FSDP's sharding
            levels, where FSDP2's mixed-precision policy holds bf16 compute copies instead).
        store_param_remainders: the fp32 main parameters held as bf16 copy plus int16 remainder (only with
            ``params_dtype=torch.bfloat16``).
    """

    params_dtype: Optional[torch.dtype] = None
    store_param_remainders: bool = False


class MegatronPrecision(MixedPrecision):
    """Megatron mixed precision (bf16 / fp16 with a layout-wide loss scaler / fp32) and FP8 GEMMs.

    Args:
        precision: ``"bf16-mixed"`` (default), ``"16-mixed"`` or ``"32-true"``.
        fp8: None (no FP8), ``"e4m3"`` or ``"hybrid"`` (e4m3 forward, e5m2 gradients); Megatron's
            ``--fp8-format``.
        fp8_recipe: ``"delayed"`` (default, Megatron's: scales from an amax history reduced over tensor x data x
            context parallel once per step), ``"tensorwise"`` (current per-tensor scales), ``"rowwise"`` (current
            per-row scales; torch backend) or ``"mxfp8"`` (Transformer Engine on compute capability >= 10.0).
        fp8_margin: powers of two of headroom left above the amax.
        fp8_amax_history_len, fp8_amax_compute_algo: the delayed recipe's history length and ``"most_recent"`` /
            ``"max"`` (Megatron's defaults 1 and ``"most_recent"``).
        fp8_backend: ``"auto"`` (Transformer Engine on CUDA when installed and the recipe is one of its own, else
            torch), ``"te"`` or ``"torch"`` (``torch._scaled_mm``).
        first_last_layers_bf16: keep the first ``num_layers_at_start_in_bf16`` and last
            ``num_layers_at_end_in_bf16`` transformer layers out of FP8 (the embedding and output layer always are).
        fp8_sequence_parallel_gather: under sequence parallelism, all-gather the input of column-parallel layers in
            FP8 rather than bf16 (same result, half the bytes; torch backend). None (default): with the delayed
            recipe; True: also with ``"tensorwise"`` (one all-reduce of the amax over tp per layer); False: never.
        initial_loss_scale, loss_scale_window: fp16's dynamic loss scale: the starting value and the number of
            overflow-free steps after which it doubles (it halves at every overflow). Only with ``"16-mixed"``.
        params_dtype: None (default: fp32 parameters, autocast casts them for every GEMM) or ``torch.bfloat16``
            (Megatron's bf16: parameters stored in bf16, fp32 main parameters stepped by the optimizer, gradients
            accumulated, reduced and clipped in fp32; ``--accumulate-allreduce-grads-in-fp32``;
            :mod:`lightning_megatron.parallel.param_buffer.buffer`). Only with ``"bf16-mixed"`` under
            :class:`~lightning_megatron.MegatronStrategy`. Checkpoints hold the fp32 main parameters.
        store_param_remainders: with ``params_dtype=torch.bfloat16``, hold each fp32 main parameter as its bf16 copy
            plus a 16-bit remainder (Megatron's ``--store-param-remainders``): the same fp32 values for 2 bytes per
            parameter instead of 4. The bf16 copies are then rounded to nearest with ties away from zero (one bf16
            step from round-to-even at exact ties only). Checkpoints are unchanged (fp32 main parameters). None
            (default): on with bf16 parameters, as Megatron's default (``--no-store-param-remainders`` turns it off),
            except under FSDP's sharding levels, where FSDP2 holds the fp32 main parameters as shards (an explicit
            True there is refused); False: fp32 main parameters of 4 bytes.

    Every argument is validated here (ValueError naming the value and what to use); an unknown keyword raises
    TypeError naming the closest valid one. Under :class:`~lightning_megatron.MegatronStrategy` the strategy
    binds the plugin to its process grid and device (:meth:`bind`); under another strategy the device is taken
    from the model's parameters.
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        fp8: Optional[str] = None,
        fp8_recipe: str = "delayed",
        fp8_margin: int = 0,
        fp8_amax_history_len: int = 1,
        fp8_amax_compute_algo: str = "most_recent",
        fp8_backend: str = "auto",
        first_last_layers_bf16: bool = False,
        num_layers_at_start_in_bf16: int = 1,
        num_layers_at_end_in_bf16: int = 1,
        fp8_sequence_parallel_gather: Optional[bool] = None,
        initial_loss_scale: float = 2.0 ** 16,
        loss_scale_window: int = 1000,
        params_dtype: Optional[torch.dtype] = None,
        store_param_remainders: Optional[bool] = None,
        **unknown: Any,
    ) -> None:
        check_keywords("MegatronPrecision", unknown,
                       [n for n in inspect.signature(MegatronPrecision.__init__).parameters
                        if n not in ("self", "unknown")])
        if precision not in PRECISIONS:
            hint = ""
            if precision in ("bf16", "bf16-true", "16", "16-true", "fp16", "32", "fp32"):
                hint = ("; MegatronPrecision keeps fp32 parameters (use 'bf16-mixed' or '16-mixed'), or fp32 main "
                        "parameters behind bf16 ones: MegatronPrecision('bf16-mixed', params_dtype=torch.bfloat16)")
            raise ValueError(f"MegatronPrecision(precision={precision!r}): precision must be one of "
                             f"{', '.join(repr(p) for p in PRECISIONS)}{hint}")
        if fp8 is not None and fp8 not in FP8_FORMATS:
            raise ValueError(f"MegatronPrecision(fp8={fp8!r}): fp8 must be None, 'e4m3' or 'hybrid' (e4m3 forward, "
                             "e5m2 gradients; Megatron's --fp8-format)")
        if fp8 is None:
            given = {name: value for name, value, default in (
                ("fp8_recipe", fp8_recipe, "delayed"), ("fp8_margin", fp8_margin, 0),
                ("fp8_amax_history_len", fp8_amax_history_len, 1),
                ("fp8_amax_compute_algo", fp8_amax_compute_algo, "most_recent"), ("fp8_backend", fp8_backend, "auto"),
                ("first_last_layers_bf16", first_last_layers_bf16, False),
                ("num_layers_at_start_in_bf16", num_layers_at_start_in_bf16, 1),
                ("num_layers_at_end_in_bf16", num_layers_at_end_in_bf16, 1),
                ("fp8_sequence_parallel_gather", fp8_sequence_parallel_gather, None)) if value != default}
            if given:
                raise ValueError(f"MegatronPrecision({', '.join(f'{k}={v!r}' for k, v in given.items())}) sets FP8 "
                                 "options without fp8: pass fp8='hybrid' or fp8='e4m3', or drop them")
        for name, value, choices in (("fp8_recipe", fp8_recipe, FP8_RECIPES),
                                     ("fp8_amax_compute_algo", fp8_amax_compute_algo, AMAX_COMPUTE_ALGOS),
                                     ("fp8_backend", fp8_backend, FP8_BACKENDS)):
            if value not in choices and not (name == "fp8_recipe" and value == "blockwise"):
                raise ValueError(f"MegatronPrecision({name}={value!r}): must be one of "
                                 f"{', '.join(repr(c) for c in choices)}")
        self.fp8_config: Optional[Float8Config] = None
        if fp8 is not None:
            try:
                self.fp8_config = Float8Config(
                    fp8_format=fp8, recipe=fp8_recipe, margin=fp8_margin, amax_history_len=fp8_amax_history_len,
                    amax_compute_algo=fp8_amax_compute_algo, backend=fp8_backend,
                    first_last_layers_bf16=first_last_layers_bf16,
                    num_layers_at_start_in_bf16=num_layers_at_start_in_bf16,
                    num_layers_at_end_in_bf16=num_layers_at_end_in_bf16,
                    sequence_parallel_gather=fp8_sequence_parallel_gather)
            except ValueError as e:
                raise ValueError(f"MegatronPrecision: {e}") from e
        if isinstance(initial_loss_scale, bool) or not isinstance(initial_loss_scale, (int, float)) \
                or not initial_loss_scale > 0:
            raise ValueError(f"MegatronPrecision(initial_loss_scale={initial_loss_scale!r}) must be a number > 0")
        if isinstance(loss_scale_window, bool) or not isinstance(loss_scale_window, int) or loss_scale_window < 1:
            raise ValueError(f"MegatronPrecision(loss_scale_window={loss_scale_window!r}) must be an int >= 1 "
                             "(overflow-free steps before the loss scale doubles)")
        if precision != "16-mixed" and (initial_loss_scale != 2.0 ** 16 or loss_scale_window != 1000):
            raise ValueError(f"MegatronPrecision(precision={precision!r}): initial_loss_scale / loss_scale_window "
                             "apply to precision='16-mixed' only (bf16 and fp32 need no loss scaling); drop them")
        if params_dtype not in (None, torch.bfloat16, torch.float32):
            raise ValueError(f"MegatronPrecision(params_dtype={params_dtype!r}): must be None / torch.float32 (fp32 "
                             "parameters) or torch.bfloat16 (bf16 parameters with fp32 main parameters and gradients)")
        if params_dtype == torch.bfloat16 and precision != "bf16-mixed":
            raise ValueError(f"MegatronPrecision(precision={precision!r}, params_dtype=torch.bfloat16): bf16 "
                             "parameters need precision='bf16-mixed'; drop params_dtype or use 'bf16-mixed'")
        if store_param_remainders is not None and not isinstance(store_param_remainders, bool):
            raise ValueError(f"MegatronPrecision(store_param_remainders={store_param_remainders!r}) must be None (on "
                             "with bf16 parameters) or a bool")
        if store_param_remainders and params_dtype != torch.bfloat16:
            raise ValueError(f"MegatronPrecision(store_param_remainders=True, params_dtype={params_dtype!r}): the "
                             "remainders complete bf16 parameters to their fp32 main parameters; add "
                             "params_dtype=torch.bfloat16 or drop store_param_remainders")
        self.precision = precision
        self.fp8 = fp8
        #: the dtype parameters are stored in during forward / backward (None: fp32)
        self.params_dtype: Optional[torch.dtype] = params_dtype if params_dtype == torch.bfloat16 else None
        #: fp32 main parameters held as bf16 copy plus int16 remainder (:mod:`lightning_megatron.parallel.param_buffer.buffer`):
        #: the argument resolved (None: with bf16 parameters)
        self.store_param_remainders: bool = (self.params_dtype is not None if store_param_remainders is None
                                             else store_param_remainders)
        #: whether store_param_remainders was given (an explicit True is refused under FSDP's levels)
        self.store_param_remainders_given = store_param_remainders is not None
        self.initial_loss_scale, self.loss_scale_window = float(initial_loss_scale), loss_scale_window
        self._device: Optional[torch.device] = None
        self.scaler: Optional[torch.amp.GradScaler] = None
        self._fp8_context: Callable[[], Any] = contextlib.nullcontext
        self._amax_group: Any = None
        #: the FP8 step this plugin handed ``parallelize`` (:meth:`parallelize_step`), holding its handle
        self._fp8_step: Optional[Float8Step] = None
        self._bound = False

    # ------------------------------------------------------------------ binding to the layout / device
    @property
    def device(self) -> str:
        """The device type autocast runs on (``"cuda"`` or ``"cpu"``): the bound device's, else CUDA when present."""
        if self._device is not None:
            return self._device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @device.setter
    def device(self, value: Union[str, torch.device]) -> None:
        self._device = torch.device(value)

    def bind(self, device: torch.device, mesh: Optional["ParallelMesh"] = None) -> Optional[Float8Config]:
        """Fix the device (autocast, the fp16 loss scaler) and resolve the FP8 backend for it; returns the FP8
        config :func:`lightning_megatron.parallelize` applies (None without FP8). With the Transformer Engine
        backend, ``mesh`` gives the group TE reduces amaxes over (tensor x data x context parallel of this pipeline
        stage; built here, collectively: call on every rank)."""
        self._device = torch.device(device)
        self._bound = True
        self._ensure_scaler()
        if self.fp8_config is None:
            return None
        self.fp8_config = self.fp8_config.resolve_backend(self._device)
        if self.fp8_config.backend == "te" and mesh is not None and self._amax_group is None:
            self._amax_group = mesh.dense["dp", "cp", "tp"]._flatten("fp8_amax").get_group()
        self._fp8_context = fp8_forward_context(self.fp8_config, self._amax_group)
        return self.fp8_config

    def parallelize_step(self, device: torch.device, mesh: Optional["ParallelMesh"] = None) -> Optional[Float8Step]:
        """The one call a strategy makes before :func:`lightning_megatron.parallelize`: :meth:`bind` to ``device``
        and ``mesh`` (collective with the Transformer Engine backend: call on every rank), and the FP8 step to pass
        as ``parallelize(fp8=...)`` (None without FP8). ``parallelize`` converts the model with it and the step keeps
        the handle (:class:`~lightning_megatron.precision.fp8.Float8Layers`), which this plugin then reads for its
        compile stance (:meth:`forward_context`) and its checkpoint state (:meth:`state_dict`); the handle registers
        its end-of-step work with the gradient finaliser itself."""
        config = self.bind(device, mesh)
        self._fp8_step = Float8Step(config) if config is not None else None
        return self._fp8_step

    @property
    def fp8_layers(self) -> Optional[Float8Layers]:
        """The FP8 conversion's handle (:class:`~lightning_megatron.precision.fp8.Float8Layers`) once
        ``parallelize`` ran this plugin's :meth:`parallelize_step`, else None."""
        return self._fp8_step.layers if self._fp8_step is not None else None

    def param_precision(self, config: Optional["ParallelConfig"] = None) -> ParamPrecision:
        """How the parameters are stored under the layout ``config`` (:class:`ParamPrecision`): ``params_dtype``
        and ``store_param_remainders`` as given, except under FSDP's sharding levels (``config.fsdp``), where FSDP2
        holds the fp32 main parameters (its mixed-precision policy gathers bf16 compute copies): then None / False.

        Raises:
            ValueError: ``store_param_remainders=True`` given explicitly under an FSDP sharding level (FSDP2's shards
                have no bf16 halves to complete).
        """
        if config is not None and config.fsdp:
            if self.params_dtype is not None and self.store_param_remainders_given and self.store_param_remainders:
                raise ValueError(
                    f"MegatronPrecision(store_param_remainders=True) with data_parallel_sharding_strategy="
                    f"{config.data_parallel_sharding_strategy!r}: FSDP2 holds the fp32 main parameters as dp-sharded "
                    "tensors of its own, which have no bf16 halves to complete; drop store_param_remainders (or use "
                    "'no_shard' / 'optim' to keep them)")
            return ParamPrecision()
        return ParamPrecision(self.params_dtype, self.store_param_remainders)

    def check_device(self, device: torch.device) -> None:
        """Check, without binding the plugin, that its FP8 backend can run on ``device`` (e.g. an explicit
        ``fp8_backend='te'`` on a CPU run: ValueError naming the fix)."""
        if self.fp8_config is not None:
            self.fp8_config.resolve_backend(torch.device(device))

    def _ensure_scaler(self) -> None:
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device, init_scale=self.initial_loss_scale,
                                               growth_interval=self.loss_scale_window)

    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        """Without :meth:`bind` (another strategy), the device is the model's; ``params_dtype`` needs the
        strategy."""
        if self.params_dtype is not None and not self._bound:
            raise ValueError("MegatronPrecision(params_dtype=torch.bfloat16) is applied by MegatronStrategy (bf16 "
                             "parameters with fp32 main parameters after materialisation); use it with "
                             "strategy=MegatronStrategy(...), or drop params_dtype")
        if self._device is None:
            params = [p for p in model.parameters() if not p.is_meta]
            if params:
                self._device = params[0].device
        self._ensure_scaler()
        return super().connect(model, optimizers, lr_schedulers)

    # ------------------------------------------------------------------ forward
    def autocast_context_manager(self) -> Any:
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast (bf16 / fp16; none for fp32), Transformer Engine's autocast with its backend, and with the torch
        backend's delayed recipe eager compiled layers until its first update (:meth:`Float8Layers.compile_stance`)."""
        layers = self.fp8_layers
        stance = layers.compile_stance() if layers is not None else contextlib.nullcontext()
        with self.autocast_context_manager(), self._fp8_context(), stance:
            yield

    # ------------------------------------------------------------------ backward / step
    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        """Multiply the loss by the loss scale (fp16), then Lightning's ``on_before_backward``."""
        self._ensure_scaler()
        return super().pre_backward(tensor, module)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def reduce_found_inf(self, optimizer: Optimizer) -> None:
        """Make the scaler's found-inf flag of ``optimizer`` (set by ``unscale_``) the max over all ranks (one
        all-reduce of one element over the default group: every tp, pp, cp, ep and dp group together), so every
        rank skips the same step and updates the loss scale the same way."""
        assert self.scaler is not None
        state = self.scaler._per_optimizer_states[id(optimizer)]
        found: Dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        device = self._device or torch.device(self.device)
        total = torch.zeros(1, device=device)
        for value in found.values():
            total += value.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        if not found:
            found[device] = total
        for key in list(found):
            found[key] = total.to(key)

    def optimizer_step(self, optimizer: Optimizable, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:  # type: ignore[override]
        """bf16 / fp32: Lightning's. fp16: closure (forward + backward), unscale (always, also for fused
        optimizers, so clipping sees true gradients), found-inf reduced over all ranks, clipping hooks, then the
        scaler's step (skipped on overflow) and update."""
        if self.scaler is None:
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError("MegatronPrecision('16-mixed') does not work with LBFGS (its closure re-evaluates the "
                             "loss); use precision='bf16-mixed' or another optimizer")
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            if getattr(self.scaler, "_scale", None) is None:
                # a pipeline stage without the loss scaled nothing: it follows the same (shared) loss scale
                self.scaler.scale(torch.zeros((), device=self._device or torch.device(self.device)))
            self.scaler.unscale_(optimizer)   # type: ignore[arg-type]
            self.reduce_found_inf(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self.scaler.update()
        return out

    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Gradients are unscaled before clipping under every precision here, so fused optimizers may clip."""
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def attach_fp8_layers(self, layers: Optional[Float8Layers]) -> None:
        """Deprecated: the FP8 step of :meth:`parallelize_step` hands its handle to this plugin by itself. Makes
        ``layers`` this plugin's FP8 handle."""
        warnings.warn("MegatronPrecision.attach_fp8_layers is deprecated: pass parallelize(fp8=plugin.parallelize_step"
                      "(device, mesh)), whose step hands the FP8 handle to the plugin", DeprecationWarning, stacklevel=2)
        if layers is None:
            self._fp8_step = None
        else:
            self._fp8_step = self._fp8_step or Float8Step(layers.config)
            self._fp8_step.adopt(layers)

    def state_dict(self) -> Dict[str, Any]:
        """The fp16 loss scaler's state and the FP8 handle's checkpoint state
        (:meth:`~lightning_megatron.precision.fp8.Float8Layers.checkpoint_state`: under the delayed recipe
        ``"fp8_amax_history"``, every converted layer's amax history, gathered from all ranks; collective on every
        rank)."""
        self._ensure_scaler()
        state = dict(super().state_dict())
        layers = self.fp8_layers
        if layers is not None:
            state.update(layers.checkpoint_state())
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s (the FP8 handle restores its own part onto the bound device)."""
        self._ensure_scaler()
        state_dict = dict(state_dict)
        fp8_state = {Float8Layers.CHECKPOINT_KEY: state_dict.pop(Float8Layers.CHECKPOINT_KEY)} \
            if Float8Layers.CHECKPOINT_KEY in state_dict else {}
        layers = self.fp8_layers
        if fp8_state and layers is not None:
            layers.load_checkpoint_state(fp8_state, self._device)
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        fp8 = f", fp8={self.fp8!r}, fp8_recipe={self.fp8_config.recipe!r}" if self.fp8_config else ""
        params = ", params_dtype=torch.bfloat16" if self.params_dtype is not None else ""
        params += ", store_param_remainders=True" if self.store_param_remainders else ""
        return f"MegatronPrecision({self.precision!r}{params}{fp8})"


#: what ``torch.amp.GradScaler()`` starts with; a Lightning ``MixedPrecision`` scaler with other settings was built by
#: the user and is not replaced silently (:func:`megatron_precision_for`)
_DEFAULT_SCALER = {"_init_scale": 2.0 ** 16, "_growth_factor": 2.0, "_backoff_factor": 0.5, "_growth_interval": 2000,
                   "_enabled": True}


def param_precision_for(plugin: Optional[Precision], config: Optional["ParallelConfig"] = None) -> ParamPrecision:
    """The :class:`ParamPrecision` a run with ``plugin`` under the layout ``config`` uses: the
    :class:`MegatronPrecision`'s (:meth:`MegatronPrecision.param_precision`), else the default (parameters in their
    own dtype, no remainders)."""
    if isinstance(plugin, MegatronPrecision):
        return plugin.param_precision(config)
    return ParamPrecision()


def megatron_precision_for(plugin: Optional[Precision]) -> Optional[Precision]:
    """The precision plugin :class:`~lightning_megatron.MegatronStrategy` runs with when Lightning hands it
    ``plugin`` (built from ``Trainer(precision=...)``, or given in ``plugins``).

    * Lightning's own ``MixedPrecision`` (``"16-mixed"`` / ``"bf16-mixed"``, the plugin of those strings): the
      :class:`MegatronPrecision` of the same name, whose fp16 loss scaler works under every layout (the loss scaled
      inside the pipeline schedule, the found-inf flag reduced over all ranks). Lightning's plugin scales the loss in
      a backward the step path does not run, and checks for overflow per process.
    * Lightning's ``HalfPrecision`` (``"bf16-true"`` / ``"16-true"``: half-precision weights without fp32 main
      parameters): refused (ValueError naming the ``MegatronPrecision`` to use).
    * Anything else (``MegatronPrecision``, ``"32-true"``, ``"64-true"``, a subclass of Lightning's plugins): as it is.

    Raises:
        ValueError: ``HalfPrecision``; a ``MixedPrecision`` with a ``GradScaler`` of its own settings (pass them to
            ``MegatronPrecision("16-mixed", initial_loss_scale=..., loss_scale_window=...)``).
    """
    if isinstance(plugin, HalfPrecision):
        use = ("Trainer(plugins=[MegatronPrecision('bf16-mixed', params_dtype=torch.bfloat16)]) (bf16 parameters with "
               "fp32 main parameters and gradients: Megatron's --bf16) or Trainer(precision='bf16-mixed') (fp32 "
               "parameters, bf16 compute)") if plugin.precision == "bf16-true" else (
            "Trainer(plugins=[MegatronPrecision('16-mixed')]) (fp16 compute, fp32 parameters, a loss scaler shared "
            "by all ranks)")
        raise ValueError(f"Trainer(precision={plugin.precision!r}) with MegatronStrategy: Lightning's "
                         f"{type(plugin).__name__} keeps weights and optimizer states in half precision without fp32 "
                         f"main parameters, which no Megatron recipe does; use {use}")
    if type(plugin) is not MixedPrecision:
        return plugin
    scaler = plugin.scaler
    if scaler is not None:
        own = {name: getattr(scaler, name, default) for name, default in _DEFAULT_SCALER.items()
               if getattr(scaler, name, default) != default}
        if own:
            raise ValueError(f"MixedPrecision({plugin.precision!r}, scaler=GradScaler(...)) with MegatronStrategy: the "
                             f"scaler's own settings ({', '.join(f'{k[1:]}={v!r}' for k, v in own.items())}) would be "
                             "lost; MegatronStrategy runs fp16 with MegatronPrecision's loss scaler (shared by all "
                             "ranks): pass plugins=[MegatronPrecision('16-mixed', initial_loss_scale=..., "
                             "loss_scale_window=...)] instead (doubling and halving the scale, as Megatron)")
    return MegatronPrecision(plugin.precision)


__all__ = ["MegatronPrecision", "PRECISIONS", "ParamPrecision", "megatron_precision_for", "param_precision_for"]
