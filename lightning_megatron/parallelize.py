"""``parallelize``: apply the parallelisms to a plain model, in one documented order.

The model has no parallelism inside it. :func:`parallelize` finds the models in a module tree that implement the
contract (:mod:`lightning_megatron.contract`) and applies, in this order, each step usable on its own
(the strategy and the plain-PyTorch quick-start loop call the same functions)::

    apply_tp         tensor (+ sequence) parallel layers          parallel/tensor_parallel/plan.py
                     (+ tp_comm_overlap rings)                    parallel/tensor_parallel/comm_overlap.py
    apply_cp         context-parallel attention                   parallel/context_parallel/apply.py
    apply_ep         experts sharded over ep / etp                parallel/expert_parallel.py
    apply_recompute  activation recompute                         parallel/recompute.py
    apply_fp8        FP8 local GEMMs (MegatronPrecision fp8=...)  precision/fp8/apply.py
                     (its handle installed after materialize: records, end-of-step hook)
    apply_compile    torch.compile of each transformer layer      parallel/compile.py
                     (compile=True; + CUDA graphs: enable_cuda_graph)
    split_pipeline   keep this rank's pipeline stages             parallel/pipeline.py
    SP gradients     replicated weights' TP sum left to the       parallel/grad_sync.py
                     finaliser (sequence_parallel)
    materialize      allocate this rank's shards                  parallel/materialize.py
                     (initialised layout-independently)
    the buffer       parameters and gradients in contiguous       parallel/param_buffer/buffer.py
                     buckets (params_dtype / param_buffer; bf16:
                     fp32 main copies): ParallelizedModel.hold_in_buffer

Everything up to ``split_pipeline`` runs on the meta device, so no rank ever holds more than its shard.
Data parallelism is left to the caller: the buffer reduces the gradients over dp x cp itself
(:class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer`); FSDP2 at the FSDP sharding levels
(parallel/fsdp.py); torch DDP for a loop without the buffer (parallel/data_parallel.py).
"""
from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, List, Optional, Set, Union

import torch
from torch import nn

from lightning_megatron.contract import TensorParallelModel, keep_parallelized_record, parallelized_record
from lightning_megatron.precision.fp8 import Float8Config, Float8Layers, Float8Step, apply_fp8
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.compile import apply_compile
from lightning_megatron.parallel.context_parallel.apply import apply_cp
from lightning_megatron.parallel.expert_parallel import apply_ep, expert_parameters
from lightning_megatron.parallel.grad_sync import defer_sequence_parallel_grad_reduce, owned_parameters
from lightning_megatron.parallel.param_buffer.buffer import MainParams
from lightning_megatron.parallel.materialize import materialize
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.pipeline import PipelineStages, split_pipeline
from lightning_megatron.parallel.recompute import apply_recompute
from lightning_megatron.parallel.tensor_parallel.layers import apply_tp_comm_overlap, tensor_parallel_sharded
from lightning_megatron.parallel.tensor_parallel.plan import apply_tp
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG


@dataclass
class ParallelizedModel:
    """What :func:`parallelize` did to a module, for the gradient finalisation, the step path and checkpoints.

    Attributes:
        module: the parallelised module (changed in place).
        models: the models that implement :class:`~lightning_megatron.contract.TensorParallelModel`.
        sharded_params: ``id()`` of parameters split over the TP group (their squared norms sum over TP).
        sequence_parallel_params: SP-replicated parameters whose gradients are summed over TP once per step.
        expert_params: routed-expert parameters (reduced over expert data parallel, not by DDP).
        pipeline: this rank's pipeline stages (pp > 1), else None.
        delay_wgrad: whether the a2a CP layers delay their weight gradients.
        layout: the layout it was split under (a second call with another layout is refused).
        fp8: the FP8 conversion's handle (:class:`~lightning_megatron.precision.fp8.Float8Layers`: the layers given
            FP8 GEMMs, their checkpoint state), None without FP8; its ``end_step`` is one of ``end_step_hooks``.
        main_params: the contiguous parameter-and-gradient buffer (:meth:`hold_in_buffer`; bf16 parameters: with fp32
            main parameters and gradients), else None (FSDP levels, or a loop that reduces otherwise).
        sequence_parallel_owners: ``(module, name)`` of the SP-replicated parameters (to find them again after
            FSDP replaced the parameter objects: :meth:`refresh`).
        end_step_hooks: work each optimizer step ends with, ``hook(num_microbatches)``, in the order added
            (:meth:`add_end_step_hook`; FP8's amax update registers itself); a
            :class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer` built on this record runs them
            after the gradient reductions.
    """

    module: nn.Module
    models: List[nn.Module]
    sharded_params: Set[int] = field(default_factory=set)
    sequence_parallel_params: List[nn.Parameter] = field(default_factory=list)
    expert_params: List[nn.Parameter] = field(default_factory=list)
    pipeline: Optional[PipelineStages] = None
    delay_wgrad: bool = False
    layout: str = ""
    fp8: Optional[Float8Layers] = None
    main_params: Optional[MainParams] = None
    sequence_parallel_owners: List[tuple] = field(default_factory=list)
    end_step_hooks: List[Callable[[Optional[int]], None]] = field(default_factory=list)

    def add_end_step_hook(self, hook: Callable[[Optional[int]], None]) -> None:
        """Run ``hook(num_microbatches)`` at the end of every optimizer step, after the gradient reductions
        (:meth:`GradientFinalizer.finalize <lightning_megatron.parallel.finalize_grads.GradientFinalizer.finalize>`
        of a finaliser built on this record afterwards; ``num_microbatches``: the step's micro-batches under pipeline
        parallelism, else None). Collective if the hook is (then on every rank)."""
        self.end_step_hooks.append(hook)

    def main_view(self) -> ContextManager:
        """The context in which bf16 parameters hold their fp32 main values (:meth:`MainParams.main_view`: what
        checkpoints and imports read and write), or none with fp32 parameters."""
        return self.main_params.main_view() if self.main_params is not None else contextlib.nullcontext()

    def hold_in_buffer(self, params_dtype: Optional[torch.dtype] = None, bucket_size: Optional[int] = None,
                       store_param_remainders: bool = False) -> MainParams:
        """Hold the module's parameters and their gradients in :class:`~lightning_megatron.parallel.param_buffer.buffer.
        MainParams`' contiguous buckets (``params_dtype=torch.bfloat16``: bf16 copies of fp32 main parameters; None:
        the parameters in their own dtype), which then own the data-parallel reduction, and route every pipeline
        schedule's weight gradients into them. Once: a record holding a buffer returns it. Call after anything that
        replaces the parameters' storage (a precision plugin's ``convert_module``), before the optimizers are built.
        """
        if self.main_params is None:
            stages = self.pipeline   # a tied embedding and its last-stage copy: a bucket each, so their shards match
            tied = [stages.word_embeddings()] if stages is not None and stages.tied else []
            self.main_params = MainParams(self.module, params_dtype, bucket_size, store_param_remainders,
                                          expert_params=self.expert_params,
                                          own_buckets=[w for w in tied if w is not None])
            if self.pipeline is not None:   # every schedule's weight gradients into the buffer
                self.pipeline.weight_grad_sink = self.main_params.weight_grads
        return self.main_params

    def refresh(self) -> None:
        """Find the recorded parameters again after a step that replaced the parameter objects (FSDP's
        ``fully_shard`` registers ``DTensor`` parameters in their place): TP-sharded, SP-replicated and expert."""
        self.sharded_params = tensor_parallel_sharded(self.module)
        self.sequence_parallel_params = owned_parameters(self.sequence_parallel_owners)
        self.expert_params = expert_parameters(self.module)




def parallelize(module: nn.Module, mesh: ParallelMesh, config: ParallelConfig, *, device: torch.device, seed: int,
                tp_fork: Optional[Callable[[], ContextManager]] = None,
                forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
                tp_rng: Optional[TensorParallelRNG] = None,
                fp8: Union[Float8Config, Float8Step, None] = None,
                params_dtype: Optional[torch.dtype] = None,
                store_param_remainders: bool = False,
                param_buffer: bool = False) -> ParallelizedModel:
    """Apply TP(+SP), CP, EP and the pipeline split to ``module`` in place, then materialise it (see the module
    docstring for the order). Collective only where a step needs it (none before materialisation).

    Args:
        module: a module tree built on the meta device (or on a real device: then only the TP slicing and
            splits apply; weights are kept).
        mesh: the process grid; ``config``: the layout (``mesh.config``).
        device: where this rank's parameters live; ``seed``: the base seed of layout-independent initialisation.
        tp_fork: context factory entering the per-TP-rank RNG stream (dropout); ``forward_context``: entered by
            each pipeline stage's forward (the precision plugin's autocast).
        tp_rng: the per-TP-rank stream itself (its ``fork`` is the default ``tp_fork``); activation recompute
            replays it in recomputed forwards.
        fp8: FP8 GEMMs for the linear layers (:func:`~lightning_megatron.precision.fp8.apply_fp8`): a
            :class:`~lightning_megatron.precision.fp8.Float8Config` (backend resolved), or the
            :class:`~lightning_megatron.precision.fp8.Float8Step` of
            :meth:`lightning_megatron.MegatronPrecision.parallelize_step` (which keeps the handle for its plugin), or
            None.
        params_dtype: ``torch.bfloat16``: after materialisation store the parameters in bf16 with fp32 main
            parameters and gradients (:class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`); None keeps fp32.
        store_param_remainders: with bf16 parameters, hold the fp32 main parameters as bf16 copy plus int16
            remainder (``MainParams(store_param_remainders=True)``).
        param_buffer: also without ``params_dtype``, hold the parameters (in their own dtype) and their gradients
            in :class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`' contiguous buckets, which then own the
            data-parallel reduction (:class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer`) in place
            of torch DDP (:meth:`ParallelizedModel.hold_in_buffer`; :class:`~lightning_megatron.MegatronStrategy`
            calls that itself, after its precision plugin converted the module).

    Idempotent: a module this function already parallelised (e.g. by ``trainer.fit`` before ``trainer.test``) is
    returned as it is, with the record of the first call, when the layout is the same.

    Raises:
        ValueError: a parallelism is asked for that the module's models do not implement (naming the contract); the
            module was already parallelised under another layout; activation recompute with a ``tp_fork`` but no
            ``tp_rng`` to replay.
    """
    done = parallelized_record(module)
    if isinstance(done, ParallelizedModel):
        if done.layout != _layout(config):
            raise ValueError(
                f"{type(module).__name__} is already parallelised as {done.layout} and cannot be re-split as "
                f"{_layout(config)}: save a checkpoint (full and layout-independent) and load it into a fresh module")
        if isinstance(fp8, Float8Step):   # the plugin of a later run reads the first conversion's handle
            fp8.adopt(done.fp8)
        return done
    if tp_fork is None and tp_rng is not None:
        tp_fork = tp_rng.fork
    if config.recompute_granularity is not None and tp_fork is not None and tp_rng is None:
        raise ValueError(
            f"recompute_granularity={config.recompute_granularity!r} replays dropout's tensor-parallel stream in "
            "recomputed forwards: pass tp_rng= (the TensorParallelRNG whose fork is tp_fork) instead of tp_fork=")
    models = [m for m in module.modules() if isinstance(m, TensorParallelModel)]
    if config.tp > 1:
        if not models:
            raise ValueError(
                f"tp={config.tp} but {type(module).__name__} contains no module with a tensor_parallel_plan(tp, "
                "sequence_parallel) method (lightning_megatron.contract.TensorParallelModel); use "
                "lightning_megatron.GPTModel or call lightning_megatron.parallel.apply_tp(model, group, plan=...) in "
                "configure_model"
            )
        for model in models:
            apply_tp(model, mesh.group("tp"), config.sequence_parallel, tp_fork=tp_fork)
            apply_tp_comm_overlap(model, config.tp_comm_overlap)
    delay_wgrad = apply_cp(models, mesh, config)
    apply_ep(models, mesh, config)
    apply_recompute(module, config, tp_rng)
    fp8_layers = apply_fp8(module, mesh, config, fp8)
    apply_compile(models, config)
    pipeline = None
    if config.pp > 1:
        if len(models) != 1:
            raise ValueError(f"pp={config.pp} needs exactly one model with the GPT layout, found {len(models)}")
        pipeline = split_pipeline(models[0], mesh.rank("pp"), config, forward_context)
    sp_owners = defer_sequence_parallel_grad_reduce(module) if config.sequence_parallel else []
    materialize(module, models, device, seed)
    # after materialisation: to_empty() replaced the meta Parameter objects
    record = ParallelizedModel(
        module=module, models=models, sharded_params=tensor_parallel_sharded(module),
        sequence_parallel_params=owned_parameters(sp_owners), expert_params=expert_parameters(module),
        pipeline=pipeline, delay_wgrad=delay_wgrad, layout=_layout(config), fp8=fp8_layers,
        sequence_parallel_owners=list(sp_owners),
    )
    if fp8_layers is not None:   # this stage's GEMMs, their records on the device, the amax update as end-step hook
        fp8_layers.install(record, device, static=config.enable_cuda_graph)
    if params_dtype is not None or param_buffer:
        record.hold_in_buffer(params_dtype, config.bucket_size, store_param_remainders)
    keep_parallelized_record(module, record)
    return record


def _layout(config: ParallelConfig) -> str:
    """The sizes and options that decide how a module is split (compared when a module is parallelised again)."""
    c = config
    return (f"tp={c.tp} pp={c.pp} vp={c.vp} cp={c.cp} ep={c.ep} etp={c.etp} sp={c.sequence_parallel} "
            f"schedule={c.pipeline_schedule} first/last={c.num_layers_in_first_pipeline_stage}/"
            f"{c.num_layers_in_last_pipeline_stage} world={c.world_size if c._resolved else None}")


class _CallableModule(types.ModuleType):
    """This module, callable as its :func:`parallelize`. The package exports the function under the module's own
    name, and Python binds ``lightning_megatron.parallelize`` to this module once anything imports the module (as
    ``MegatronStrategy`` does); ``from lightning_megatron import parallelize`` then gives this module, which must
    work as the function does."""

    def __call__(self, *args: Any, **kwargs: Any) -> ParallelizedModel:
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
