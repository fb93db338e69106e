"""One place for the gradient work between the last backward of a step and the optimizer: reductions that DDP
does not do, and clipping by the true global norm (Megatron's ``finalize_model_grads`` + ``clip_grad_norm``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Set

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel.grad_buckets import GradBucketReducer, overlaps_grad_reduce
from lightning_megatron.parallel.grad_norm import clip_coefficient, clip_grad_norm_
from lightning_megatron.parallel.grad_sync import (
    allreduce_data_parallel_grads,
    allreduce_expert_parallel_grads,
    allreduce_sequence_parallel_grads,
)
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.nonfinite import NonFiniteGuard

if TYPE_CHECKING:
    from lightning_megatron.parallel.fsdp import FSDPModel


class ParallelizedParts(Protocol):
    """What the finaliser reads of :func:`~lightning_megatron.parallelize.parallelize`'s record
    (:class:`~lightning_megatron.parallelize.ParallelizedModel`), declared here so that this layer does not import
    the one above it."""

    module: nn.Module
    sharded_params: Any
    expert_params: List[nn.Parameter]
    pipeline: Any
    main_params: Any
    #: work each optimizer step ends with (``hook(num_microbatches)``), e.g. FP8's amax update (none if absent)
    end_step_hooks: List[Callable[[Optional[int]], None]]


class GradientFinalizer:
    """Finishes the gradients of a :class:`~lightning_megatron.parallelize.ParallelizedModel` once per step.

    :meth:`finalize` (after the step's last backward, in this order): the data-parallel average of pipeline
    stages' gradients over dp x cp (stages are not wrapped in DDP); expert gradients summed over expert data
    parallel (``edp``) and divided by dp x cp; SP-replicated gradients summed over ``tp``; the tied word-embedding
    gradient summed over the ``embedding`` group (first and last pipeline stage).
    :meth:`clip` scales gradients to a global L2 norm counted over tp, pp and the ep x etp block; a non-finite
    norm raises (``guard``: :class:`~lightning_megatron.parallel.nonfinite.NonFiniteGuard`, on with
    ``config.check_for_nan_in_loss_and_grad``) before anything is scaled.

    ``fsdp``: the model's FSDP units (:func:`~lightning_megatron.parallel.fsdp.apply_fsdp`), or None. Under FSDP the
    data-parallel reductions are FSDP's (the dense gradients averaged over dp x cp, the experts' over edp when edp > 1);
    the tensor-parallel and embedding sums act on each rank's gradient shards, and the norm sums the shards' squares
    over dp x cp (experts: edp) too.

    End-of-step hooks: :meth:`finalize` ends by calling every hook of :attr:`end_step_hooks` in order (those of
    ``parallelized.end_step_hooks`` when the finaliser is built, then those :meth:`add_end_step_hook` adds), each
    ``hook(num_microbatches)``. The finaliser knows nothing of what they do (FP8's delayed-scaling amax update
    registers itself there: :meth:`~lightning_megatron.precision.fp8.Float8Layers.install`).
    """

    def __init__(self, parallelized: ParallelizedParts, mesh: ParallelMesh,
                 fsdp: Optional["FSDPModel"] = None) -> None:
        self.parallelized, self.mesh, self.fsdp = parallelized, mesh, fsdp
        #: called in order at the end of :meth:`finalize`, ``hook(num_microbatches)`` (:meth:`add_end_step_hook`)
        self.end_step_hooks: List[Callable[[Optional[int]], None]] = list(getattr(parallelized, "end_step_hooks", ()))
        config = mesh.config
        self.reduce_dtype: Optional[torch.dtype] = torch.bfloat16 if config.grad_reduce_in_bf16 else None
        self.experts: Set[int] = {id(p) for p in parallelized.expert_params}
        stages = parallelized.pipeline
        copy = stages.tied_copy() if stages is not None else None
        self.excluded_from_norm: Set[int] = {id(copy)} if copy is not None else set()
        check = config.check_for_nan_in_loss_and_grad
        self.guard = NonFiniteGuard(parallelized.module, enabled=bool(check), skip=check in ("skip", "rerun"))
        #: pipeline stages' data-parallel reduction started in backward (``overlap_grad_reduce``), else None
        self.reducer: Optional[GradBucketReducer] = None
        uses: dict = {}   # backward passes per micro-batch of a parameter several stages of this rank use
        for stage in stages.modules if stages is not None else []:
            for q in stage.parameters():
                uses[id(q)] = uses.get(id(q), 0) + 1
        reduce = mesh.size("dp_cp") > 1 and not config.fsdp   # FSDP: its own
        overlap = reduce and overlaps_grad_reduce(config)
        #: the buffer's buckets start their reductions inside the backward (else all in :meth:`finalize`)
        self.overlaps_buffer = overlap and parallelized.main_params is not None
        if reduce and parallelized.main_params is not None:   # the buffer's buckets reduce themselves, experts too
            parallelized.main_params.overlap_reduction(mesh.group("dp_cp"), mesh.size("dp_cp"), uses,
                                                       self.reduce_dtype, mesh.group("edp"), mesh.size("edp"))
        elif overlap and stages is not None:
            dense = [q for q in parallelized.module.parameters() if id(q) not in self.experts]
            self.reducer = GradBucketReducer(dense, mesh.group("dp_cp"), config.bucket_size, self.reduce_dtype, uses)

    def add_end_step_hook(self, hook: Callable[[Optional[int]], None]) -> None:
        """Call ``hook(num_microbatches)`` at the end of every :meth:`finalize`, after the gradient reductions and
        the hooks added before it. ``num_microbatches``: the step's micro-batch count under pipeline parallelism
        (whose schedule may run extra metadata-inference passes a hook must not count), else None. A hook that
        communicates must be registered on every rank it communicates with."""
        self.end_step_hooks.append(hook)

    def reduces_grads(self) -> bool:
        """Whether :meth:`finalize` changes gradients in this layout: a data-parallel reduction (dp x cp, FSDP's, a
        pipeline's), the experts' over expert data parallel, the sequence-parallel parameters' over tp."""
        p, mesh = self.parallelized, self.mesh
        return (mesh.size("dp_cp") > 1 or self.fsdp is not None or p.pipeline is not None
                or (bool(p.expert_params) and mesh.size("edp") > 1)
                or (bool(p.sequence_parallel_params) and mesh.size("tp") > 1))

    def start_step(self, num_microbatches: int) -> None:
        """Before a step's forward and backward passes (``num_microbatches`` of them per pipeline chunk): arm the
        overlapped reduction of pipeline stages, if on (each micro-batch's loss is divided by ``num_microbatches``
        already: the gradients need no division)."""
        if self.reducer is not None:
            self.reducer.start_step(num_microbatches)
        main_params = self.parallelized.main_params
        if main_params is not None and self.overlaps_buffer:
            main_params.arm_reduction(num_microbatches)

    def finalize(self, num_microbatches: Optional[int] = None) -> None:
        """Switch bf16 parameters to their fp32 main view (``p.grad`` the fp32 main gradient; a step that kept its bf16
        gradients: those, in the compute view, :meth:`MainParams.finish_backward`), reduce what DDP does not (the
        dp_cp average of pipeline stages and of main gradients, which are not wrapped in DDP; edp / tp / embedding
        groups as they apply), then the end-of-step hooks (:attr:`end_step_hooks`, e.g. the FP8 delayed-scaling amax
        update over tp and dp_cp), each given ``num_microbatches``, the step's micro-batches, under pipeline
        parallelism (whose schedule may run extra metadata-inference passes), else None."""
        p, mesh = self.parallelized, self.mesh
        if p.main_params is not None:   # bf16 parameters: from here on fp32 main parameters and main gradients
            p.main_params.finish_backward()
        if p.main_params is not None and p.main_params.reduces_data_parallel:
            p.main_params.finish_reduction()
        elif self.reducer is not None:
            self.reducer.finish()
        elif p.pipeline is not None and mesh.size("dp_cp") > 1 and self.fsdp is None:   # stages without a buffer
            dense = [q for q in p.module.parameters() if id(q) not in self.experts]
            size = mesh.config.bucket_size   # elements; the buckets' default otherwise (64 MiB)
            kwargs = {"bucket_bytes": size * dense[0].element_size()} if size is not None and dense else {}
            allreduce_data_parallel_grads(dense, mesh.group("dp_cp"), reduce_dtype=self.reduce_dtype, **kwargs)
        reduced = (self.fsdp is not None and self.fsdp.experts_sharded
                   or p.main_params is not None and p.main_params.reduces_experts)   # by FSDP or the buffer
        if p.expert_params and not reduced:
            allreduce_expert_parallel_grads(p.expert_params, mesh.group("edp"), mesh.size("dp_cp"),
                                            reduce_dtype=self.reduce_dtype)
        if p.sequence_parallel_params:
            allreduce_sequence_parallel_grads(p.sequence_parallel_params, mesh.group("tp"))
        if p.pipeline is not None and p.pipeline.tied:
            group, weight = mesh.group("embedding"), p.pipeline.word_embeddings()
            if group is not None and weight is not None:
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                # FSDP: both stages hold the same dp x cp shard of the weight (same shape, same dp rank)
                grad = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad
                dist.all_reduce(grad, group=group)
        for hook in self.end_step_hooks:   # e.g. FP8 delayed scaling: the step's amaxes, reduced, join the histories
            hook(num_microbatches if p.pipeline is not None else None)

    def clip(self, params: List[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip ``params``' gradients to global L2 norm ``max_norm``; returns the norm before clipping.

        TP-sharded parameters count over the TP group, expert parameters over the ep x etp block, pipeline stages'
        over the pipeline group, replicated ones once; the last stage's tied embedding copy is scaled like its
        first-stage twin but not counted.
        """
        mesh = self.mesh
        counted = [p for p in params if id(p) not in self.excluded_from_norm]
        pp_groups = [mesh.group("pp")] if mesh.config.pp > 1 else []
        fsdp = self.fsdp is not None
        main = self.parallelized.main_params
        scattered = main is not None and main.scatters   # each rank holds its shard's run of every bucket
        norm = clip_grad_norm_(counted, float(max_norm), self.parallelized.sharded_params, mesh.group("tp"),
                               pp_groups, expert=self.experts, expert_group=mesh.group("ep_etp"),
                               check=self.guard.check_grad_norm, check_local_norms=self.guard.sends_grad_norms,
                               shard_group=mesh.group("dp_cp") if fsdp or scattered else None,
                               expert_shard_group=(mesh.group("edp") if scattered or fsdp and self.fsdp.experts_sharded
                                                   else None))
        excluded = [p for p in params if id(p) in self.excluded_from_norm and p.grad is not None]
        if excluded:
            with torch.no_grad():
                coef = clip_coefficient(norm, float(max_norm))
                for p in excluded:
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    grad.mul_(coef.to(grad.device))
        return norm
