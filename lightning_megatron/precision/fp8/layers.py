"""Converting a model's linear layers to FP8 GEMMs (:func:`convert_to_fp8`) and the handle of what was converted
(:class:`Float8Layers`: the GEMMs, the delayed recipe's per-step update as an end-of-step hook, its checkpoint
state)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.contract import PipelineModel
from lightning_megatron.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.parallel.tensor_parallel.mappings import group_size
from lightning_megatron.precision.fp8.config import GEMM_ALIGNMENT, Float8Config
from lightning_megatron.precision.fp8.delayed import _end_step, _refresh_scales
from lightning_megatron.precision.fp8.gemm import Float8Gemm
from lightning_megatron.precision.fp8.te import TransformerEngineGemm, transformer_engine_context

# ---------------------------------------------------------------------------------------------- conversion
class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMM runs through ``fp8_gemm`` (:class:`Float8Gemm` or :class:`TransformerEngineGemm`);
    holds the original layer's parameters (same names, so checkpoints do not change)."""

    def __init__(self, linear: nn.Linear, fp8_gemm: Callable[..., Tensor]) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.fp8_gemm = fp8_gemm

    def forward(self, x: Tensor) -> Tensor:
        return self.fp8_gemm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=True"


@dataclass
class Float8Layers:
    """The handle of an FP8 conversion (:func:`convert_to_fp8`; in ``parallelize``:
    :func:`~lightning_megatron.precision.fp8.apply.apply_fp8`), which owns FP8 from then on:

    * :meth:`install` (after materialisation): this pipeline stage's GEMMs, their records on the device, and
      :meth:`end_step` registered as an end-of-step hook of the parallelised model, which the gradient finaliser
      runs once per optimizer step;
    * :meth:`compile_stance`: the context the forward passes run in (the precision plugin enters it);
    * :meth:`checkpoint_state` / :meth:`load_checkpoint_state`: the delayed recipe's amax histories, the whole
      model's, as checkpoints carry them (the precision plugin's ``state_dict`` holds them).

    ``converted`` / ``kept``: module names (relative to the module given to :func:`convert_to_fp8`) of the layers
    whose GEMMs run in FP8 / the linear layers left as they were, with why."""

    #: the key of :meth:`checkpoint_state` in the precision plugin's state (as checkpoints have always held it)
    CHECKPOINT_KEY = "fp8_amax_history"

    config: Float8Config
    converted: List[str] = field(default_factory=list)
    kept: Dict[str, str] = field(default_factory=dict)
    #: the converted linear layers' GEMMs and, in the same order, those layers' names (``converted`` also names the
    #: routed-expert modules, whose GEMMs are ``expert_gemms``)
    gemms: List[Any] = field(default_factory=list)
    gemm_names: List[str] = field(default_factory=list)
    amax_groups: List[Any] = field(default_factory=list)
    #: the routed experts' FP8 GEMMs (torch backend), each with its name ``<experts module>.<global expert>.fc1|fc2``
    expert_gemms: List["Float8Gemm"] = field(default_factory=list)
    expert_gemm_names: List[str] = field(default_factory=list)
    expert_amax_groups: List[Any] = field(default_factory=list)
    #: optimizer steps whose amaxes joined the delayed recipe's histories (a loaded checkpoint with histories counts)
    steps: int = 0
    #: where the delayed recipe's records and histories live (:meth:`install`), None before
    device: Optional[torch.device] = None

    @contextlib.contextmanager
    def compile_stance(self) -> Iterator[None]:
        """The context the forward passes run in: until the delayed recipe (torch backend) has had its first
        update (:meth:`end_step`), compiled layers run eagerly (``torch.compiler.set_stance("force_eager")``), so
        ``compile=True`` compiles each layer once, with histories, instead of a second time for the first step's
        scaling from current amaxes. Nothing for other recipes and backends."""
        if self.config.recipe != "delayed" or self.config.backend != "torch" or self.steps > 0:
            yield
            return
        with torch.compiler.set_stance("force_eager"):
            yield

    def retain(self, module: nn.Module) -> None:
        """Forget the converted layers no longer in ``module`` (the other pipeline stages' after the split)."""
        present = {name for name, _ in module.named_modules()}
        self.converted = [name for name in self.converted if name in present]
        keep = [i for i, name in enumerate(self.gemm_names) if name in present]
        self.gemms = [self.gemms[i] for i in keep]
        self.gemm_names = [self.gemm_names[i] for i in keep]
        self.kept = {name: why for name, why in self.kept.items() if name in present}
        experts = [i for i, name in enumerate(self.expert_gemm_names) if name.rsplit(".", 2)[0] in present]
        self.expert_gemms = [self.expert_gemms[i] for i in experts]
        self.expert_gemm_names = [self.expert_gemm_names[i] for i in experts]

    def allocate(self, device: torch.device, ring: bool = False, static: bool = False) -> None:
        """The delayed recipe's record buffers of every torch-backend GEMM on ``device`` (after materialisation, before
        the first, possibly compiled, forward: :meth:`Float8Gemm.allocate`); ``ring``: also the rings of the last uses
        that :meth:`end_step` with ``num_microbatches`` reads (pipeline schedules); ``static``: as static inputs of
        the layers' CUDA graphs (``enable_cuda_graph``)."""
        for _, gemm in self._named_gemms():
            if isinstance(gemm, Float8Gemm):
                gemm.allocate(device, ring=ring, static=static)

    def install(self, parallelized: Any, device: torch.device, static: bool = False) -> None:
        """Settle the conversion into the parallelised model, after materialisation and before the first forward:
        keep the GEMMs of the layers still in ``parallelized.module`` (:meth:`retain`: the pipeline split dropped
        the other stages'), allocate the delayed recipe's records on ``device`` (:meth:`allocate`; with the rings of
        the last uses when ``parallelized.pipeline`` is set, as static inputs of CUDA graphs with ``static``), and
        register :meth:`end_step` as an end-of-step hook of ``parallelized``
        (``parallelized.add_end_step_hook``: :class:`~lightning_megatron.parallelize.ParallelizedModel`), which the
        gradient finaliser runs once per optimizer step with the step's micro-batch count under pipeline parallelism
        (None otherwise). No collective."""
        self.retain(parallelized.module)
        self.device = torch.device(device)
        self.allocate(self.device, ring=parallelized.pipeline is not None, static=static)
        parallelized.add_end_step_hook(self.end_step)

    def _named_gemms(self) -> List[Tuple[str, Any]]:
        return list(zip(self.gemm_names, self.gemms)) + list(zip(self.expert_gemm_names, self.expert_gemms))

    def state_dict(self) -> Dict[str, Tensor]:
        """The delayed recipe's amax histories ``[3, amax_history_len]`` (input, weight, output gradient) by
        converted layer name, on the CPU; empty for other recipes or before the first step. The same on every rank of
        the amax group (tensor x data x context parallel), so one rank's holds for its pipeline stage."""
        out: Dict[str, Tensor] = {}
        for name, gemm in self._named_gemms():
            history = getattr(gemm, "history", None)
            if history is not None:
                out[name] = history.detach().cpu().clone()
        return out

    def load_state_dict(self, state: Dict[str, Tensor], device: Optional[torch.device] = None) -> None:
        """Restore the amax histories of :meth:`state_dict` onto ``device`` (default: where they are, else the
        CPU): the layers of this rank present in ``state``; a layer the checkpoint has no history for starts without
        one, as in a fresh run."""
        for name, gemm in self._named_gemms():
            if name not in state or not isinstance(gemm, Float8Gemm):
                continue
            history = state[name]
            want = (3, self.config.amax_history_len)
            if tuple(history.shape) != want:
                raise ValueError(f"FP8 amax history of {name} in the checkpoint has shape {tuple(history.shape)}, this "
                                 f"run keeps {want} (fp8_amax_history_len={self.config.amax_history_len}); resume with "
                                 f"fp8_amax_history_len={history.shape[1]}")
            where = gemm.history.device if gemm.history is not None else device
            gemm.history = history.to(where) if where is not None else history.clone()
            gemm.forget_uses()
            self.steps = max(self.steps, 1)
        _refresh_scales([gemm for _, gemm in self._named_gemms() if isinstance(gemm, Float8Gemm)])

    def checkpoint_state(self) -> Dict[str, Any]:
        """What checkpoints carry of FP8: under the delayed recipe ``{CHECKPOINT_KEY: histories}``, every converted
        layer's (and routed expert's) amax history ``[3, amax_history_len]`` by name (:meth:`state_dict`), gathered
        from all ranks of the default group (pipeline stages and expert-parallel ranks hold different ones;
        ``all_gather_object``, collective on every rank), so a resumed run scales exactly as the uninterrupted one.
        Empty for other recipes and before the first step."""
        if self.config.recipe != "delayed":
            return {}
        history = self.state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, history)
            history = {k: v for part in parts for k, v in part.items()}
        return {self.CHECKPOINT_KEY: history} if history else {}

    def load_checkpoint_state(self, state: Mapping[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore :meth:`checkpoint_state`'s histories (those of this rank's layers; :meth:`load_state_dict`) onto
        ``device`` (default: :attr:`device`). A state without them changes nothing. No collective."""
        history = state.get(self.CHECKPOINT_KEY)
        if history is not None:
            self.load_state_dict(history, device if device is not None else self.device)

    def end_step(self, num_microbatches: Optional[int] = None) -> None:
        """The delayed recipe's per-step amax update: per GEMM the largest amax its training uses recorded this
        step, reduced (max) over the amax groups in one all-reduce per group, becomes the newest history entry.
        ``num_microbatches``: count only the last that many uses of each GEMM (a pipeline schedule's metadata
        inference runs an extra forward and backward on placeholder tensors first). No-op for other recipes.
        Call once per optimizer step on every rank (the gradient finaliser does)."""
        if self.config.recipe != "delayed" or self.config.backend != "torch":
            return
        for gemms, groups in ((self.gemms, self.amax_groups), (self.expert_gemms, self.expert_amax_groups)):
            _end_step(gemms, groups, num_microbatches)
        self.steps += 1



def _expert_types() -> Tuple[type, ...]:
    from lightning_megatron.moe.experts import GroupedMLPExperts, SequentialMLPExperts

    return (GroupedMLPExperts, SequentialMLPExperts)


def _fp8_capable(module: nn.Module) -> Optional[Tuple[int, int]]:
    """``(in, out)`` of the local GEMM of a linear layer FP8 can convert, else None."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or type(module) is nn.Linear:
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            return None
        return int(weight.shape[1]), int(weight.shape[0])
    return None


def _candidate_layers(module: nn.Module, config: Float8Config) -> Tuple[List[Tuple[str, nn.Module]], Dict[str, str]]:
    """Linear layers and routed-expert modules to convert (name, module) and those kept out with why: inside
    models with the GPT layout (:class:`~lightning_megatron.contract.PipelineModel`) the transformer layers' linears
    and experts; in any other module every linear layer."""
    models = [(name, m) for name, m in module.named_modules() if isinstance(m, PipelineModel)]
    kept: Dict[str, str] = {}
    out: List[Tuple[str, nn.Module]] = []
    if not models:
        return [(n, m) for n, m in module.named_modules() if _fp8_capable(m) is not None], kept
    for model_name, model in models:
        prefix = f"{model_name}." if model_name else ""
        layers = getattr(model.decoder, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            raise ValueError(f"{type(model).__name__}.decoder.layers must be an nn.ModuleDict keyed by global layer "
                             "index to apply FP8 per layer")
        bf16 = set(config.layers_in_bf16(len(layers)))
        for key, layer in layers.items():
            for sub, m in layer.named_modules():
                if _fp8_capable(m) is None and not isinstance(m, _expert_types()):
                    continue
                name = f"{prefix}decoder.layers.{key}" + (f".{sub}" if sub else "")
                if int(key) in bf16:
                    kept[name] = "first_last_layers_bf16"
                else:
                    out.append((name, m))
        for name, m in model.named_modules():
            if _fp8_capable(m) is not None and not name.startswith("decoder.layers."):
                kept[prefix + name] = "outside the transformer layers (embedding / output layer)"
    return out, kept


def _convert_experts(name: str, experts: nn.Module, config: Float8Config, result: Float8Layers) -> Optional[str]:
    """Give a :class:`~lightning_megatron.moe.experts.GroupedMLPExperts` one ``(fc1, fc2)`` pair of torch FP8 GEMMs
    per local expert (recorded in ``result`` by global expert index); returns why it stays as it is, or None."""
    from lightning_megatron.moe.experts import GroupedMLPExperts

    if not isinstance(experts, GroupedMLPExperts):
        return "reference experts (SequentialMLPExperts) are not converted"
    if config.backend != "torch":
        return "routed experts run FP8 with the torch backend only (fp8_backend='torch')"
    h, fc1_out = int(experts.weight1.shape[1]), int(experts.weight1.shape[2])
    f_local = int(experts.weight2.shape[1])
    if any(d % GEMM_ALIGNMENT for d in (h, fc1_out, f_local)):
        return f"expert GEMMs {h}x{fc1_out} / {f_local}x{h} are not multiples of {GEMM_ALIGNMENT}"
    pairs = []
    for e in range(experts.num_local_experts):
        pair = (Float8Gemm(config, result.expert_amax_groups), Float8Gemm(config, result.expert_amax_groups))
        pairs.append(pair)
        for which, gemm in zip(("fc1", "fc2"), pair):
            result.expert_gemms.append(gemm)
            result.expert_gemm_names.append(f"{name}.{experts.expert_offset + e}.{which}")
    experts.fp8_gemms = pairs
    return None


def convert_to_fp8(module: nn.Module, config: Float8Config, amax_groups: Sequence[Any] = (),
              expert_amax_groups: Sequence[Any] = ()) -> Float8Layers:
    """Give the linear layers of ``module`` FP8 local GEMMs, and its routed experts (torch backend) FP8 GEMMs per
    expert (in place; on the meta device or materialised).

    ``config`` must have its backend resolved (:meth:`Float8Config.resolve_backend`). ``amax_groups``: the
    process groups the delayed recipe reduces amaxes over (tensor parallel and data x context parallel of this
    pipeline stage); ``expert_amax_groups``: those of the experts' GEMMs (expert tensor parallel and expert data
    parallel: the ranks holding the same experts). They take part in :meth:`Float8Layers.end_step`, called once per
    step.
    """
    if config.backend == "auto":
        raise ValueError("convert_to_fp8 needs a resolved backend: call Float8Config.resolve_backend(device) first")
    result = Float8Layers(config=config, amax_groups=[g for g in amax_groups if group_size(g) > 1],
                          expert_amax_groups=[g for g in expert_amax_groups if group_size(g) > 1])
    targets, result.kept = _candidate_layers(module, config)
    from lightning_megatron.moe.experts import GroupedMLPExperts

    grouped = [name for name, layer in targets if isinstance(layer, GroupedMLPExperts)]
    if grouped and config.backend != "torch":
        raise ValueError(
            f"fp8_backend={config.backend!r} with routed experts ({len(grouped)} MoE layer(s), first {grouped[0]!r}): "
            "the experts' grouped GEMMs run FP8 with the torch backend only, so under this backend they would stay "
            "in bf16 while the rest runs FP8; use MegatronPrecision(fp8_backend='torch') for a mixture-of-experts "
            "model")
    for name, layer in targets:
        if isinstance(layer, _expert_types()):
            why = _convert_experts(name, layer, config, result)
            if why is None:
                result.converted.append(name)
            else:
                result.kept[name] = why
            continue
        in_features, out_features = _fp8_capable(layer)
        if in_features % GEMM_ALIGNMENT or out_features % GEMM_ALIGNMENT:
            result.kept[name] = f"local GEMM {in_features}x{out_features} is not a multiple of {GEMM_ALIGNMENT}"
            continue
        gemm = (Float8Gemm(config, result.amax_groups) if config.backend == "torch"
                else TransformerEngineGemm(in_features, out_features))
        result.gemms.append(gemm)
        result.gemm_names.append(name)
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            layer.fp8_gemm = gemm
        else:
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, child, Float8Linear(layer, gemm))
        result.converted.append(name)
    _activation_records_fc1_grad_amax(module, result)
    return result


def _activation_records_fc1_grad_amax(module: nn.Module, result: Float8Layers) -> None:
    """For the delayed recipe (torch backend): every SwiGLU MLP (an ``fc1_grad_amax`` attribute) whose
    ``linear_fc1`` was converted hands the amax of ``linear_fc1``'s output gradient, taken in SwiGLU's backward pass,
    to that GEMM's record (:meth:`Float8Gemm.record_grad_amax`) instead of the GEMM's backward reading the gradient
    once more for it. The amax is the same value; the step records the same histories."""
    if result.config.recipe != "delayed" or result.config.backend != "torch":
        return
    gemms = dict(zip(result.gemm_names, result.gemms))
    for name, mlp in module.named_modules():
        gemm = gemms.get(f"{name}.linear_fc1" if name else "linear_fc1")
        if isinstance(gemm, Float8Gemm) and getattr(mlp, "swiglu", False) and hasattr(mlp, "fc1_grad_amax"):
            mlp.fc1_grad_amax = gemm.record_grad_amax
            gemm.grad_amax_from_producer = True


def fp8_forward_context(config: Optional[Float8Config], amax_group: Any = None) -> Callable[[], ContextManager]:
    """The context FP8 GEMMs need around forward: TE's autocast for the TE backend, nothing for torch's."""
    if config is None or config.backend != "te":
        return contextlib.nullcontext
    return transformer_engine_context(config, amax_group)
