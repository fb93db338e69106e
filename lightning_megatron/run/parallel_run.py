"""``ParallelRun``: one training run's parallel state and its per-step calls, without Lightning.

What a run is made of, each piece built where its concern lives and only held here: the process grid
(:class:`~lightning_megatron.parallel.mesh.ParallelMesh`), what :func:`~lightning_megatron.parallelize.parallelize`
did to the model (:class:`~lightning_megatron.parallelize.ParallelizedModel`, with the parameter-and-gradient buffer),
the FSDP2 units at the FSDP levels, the gradient finaliser
(:class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer`), the distributed optimizer's overlapped
parameter gathers and the sharded checkpoint writer. :class:`~lightning_megatron.strategy.MegatronStrategy` holds one
(``strategy.run``) and translates Lightning's hooks into its calls; the plain quick-start loop
(``examples/run_simple_train_loop.py``) makes the same calls itself::

    run = ParallelRun(mesh, device)
    run.parallelize(model, seed=1234)             # the recipe, the buffer, the finaliser
    run.prepare_data_parallel(model)              # fitting: replicas made equal (or FSDP2 units)
    optimizer, = run.shard_optimizers([torch.optim.AdamW(model.parameters())], model)
    for batch in batches:
        run.start_step(1)                         # before the step's first backward
        model(...).backward()
        run.finalize()                            # the step's reductions; then run.clip(params, max_norm) if any
        optimizer.step()                          # the buffer returns to the compute view after it
        optimizer.zero_grad(set_to_none=True)
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.finalize_grads import GradientFinalizer
from lightning_megatron.parallel.fsdp import FSDPModel
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.nonfinite import NonFiniteGuard
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG
from lightning_megatron.parallelize import ParallelizedModel, parallelize
from lightning_megatron.run.model_setup import equalize_replicas, shard_fsdp, shard_optimizer_states

if TYPE_CHECKING:   # the writer's module loads the data package (and Lightning with it): imported when used
    from lightning_megatron.checkpoint.distributed import ShardedCheckpointIO

__all__ = ["ParallelRun"]


class ParallelRun:
    """The parallel state of one run on this rank and the calls each step makes (no Lightning).

    Args:
        mesh: the process grid (its groups: ``tp``, ``pp``, ``dp_cp``, ``cp``, ``edp``, ``ep_etp``, ``embedding``).
        device: where this rank's parameters live.
        config: the layout and options (default ``mesh.config``).

    Attributes (None until the call that builds them):
        parallelized: the record of :meth:`parallelize` (the parameter buffer: ``parallelized.main_params``).
        finalizer: the :class:`GradientFinalizer` of the step's reductions, clipping and non-finite checks.
        fsdp: the FSDP2 units (``optim_grads`` / ``optim_grads_params``), after :meth:`prepare_data_parallel`.
        param_gather: the distributed optimizer's overlapped parameter gathers (``overlap_param_gather``).
        sharded_io: the sharded checkpoint writer (``ckpt_format="torch_dist"``), after :meth:`start_sharded_io`.
    """

    def __init__(self, mesh: ParallelMesh, device: torch.device, config: Optional[ParallelConfig] = None) -> None:
        self.mesh, self.device = mesh, device
        self.config: ParallelConfig = config if config is not None else mesh.config
        self.parallelized: Optional[ParallelizedModel] = None
        self.finalizer: Optional[GradientFinalizer] = None
        self.fsdp: Optional[FSDPModel] = None
        self.param_gather: Optional[Any] = None
        self.sharded_io: Optional["ShardedCheckpointIO"] = None

    # ------------------------------------------------------------------------------------------ building
    def rebind(self, mesh: ParallelMesh) -> None:
        """A later run over the same model (Lightning's ``setup_environment`` of another ``fit`` / ``validate``): the
        new grid; the record, the FSDP2 units and the parameter gathers stay (:meth:`parallelize` returns the same
        record and builds the finaliser over the new grid; :meth:`shard_optimizers` removes the earlier gathers)."""
        self.mesh = mesh

    def parallelize(self, module: nn.Module, *, seed: int, tp_rng: Optional[TensorParallelRNG] = None,
                    forward_context: Callable[[], ContextManager] = contextlib.nullcontext, fp8: Any = None,
                    convert: Optional[Callable[[nn.Module], Any]] = None, params_dtype: Optional[torch.dtype] = None,
                    store_param_remainders: bool = False, check_grads: bool = True) -> ParallelizedModel:
        """:func:`~lightning_megatron.parallelize.parallelize` ``module`` over the mesh (collective where a recipe
        step is: materialisation over ``tp`` / ``pp``), then hold its parameters in the contiguous buffer (outside the
        FSDP levels, or with ``params_dtype``: the buffer then owns the reductions over ``dp_cp`` / ``edp``), and build
        the gradient finaliser (with the record's end-of-step hooks).

        ``convert``: called with the module before the buffer takes the parameters' storage (a precision plugin's
        ``convert_module``); ``params_dtype`` / ``store_param_remainders``: how the buffer stores the parameters
        (bf16 copies of fp32 main parameters, remainders); ``fp8``: the precision's FP8 step of the recipe;
        ``check_grads``: whether the non-finite guard checks gradients (off when a loss scaler owns inf / NaN)."""
        cfg = self.config
        self.parallelized = parallelize(module, self.mesh, cfg, device=self.device, seed=seed, tp_rng=tp_rng,
                                        forward_context=forward_context, fp8=fp8)
        if convert is not None:
            convert(module)
        if params_dtype is not None or not cfg.fsdp:   # the buffer owns the gradients (FSDP2 at its levels)
            self.parallelized.hold_in_buffer(params_dtype, cfg.bucket_size, store_param_remainders)
        self.finalizer = GradientFinalizer(self.parallelized, self.mesh, self.fsdp)   # a later fit: its units
        self.finalizer.guard.grads = check_grads
        return self.parallelized

    def prepare_data_parallel(self, module: nn.Module, precision: str = "32-true") -> None:
        """When fitting: at the FSDP levels the FSDP2 units over ``dp_cp`` (experts ``edp``; once, mixed precision
        from ``precision``, the finaliser then working on the shards), else the replicas made equal (the buffer's
        dense buckets broadcast from the first rank of ``dp_cp``, routed experts' from the first of ``edp``)."""
        assert self.parallelized is not None and self.finalizer is not None, "parallelize first"
        cfg = self.config
        if cfg.fsdp and self.fsdp is None:
            self.fsdp = shard_fsdp(module, self.parallelized, self.mesh, cfg, precision)
            check_grads = self.finalizer.guard.grads
            self.finalizer = GradientFinalizer(self.parallelized, self.mesh, self.fsdp)
            self.finalizer.guard.grads = check_grads
        elif not cfg.fsdp:
            equalize_replicas(self.parallelized, self.mesh)

    def shard_optimizers(self, optimizers: Sequence[Any], model: nn.Module,
                         lr_scheduler_configs: Sequence[Any] = ()) -> List[Any]:
        """The optimizers to step: under the distributed optimizer (``use_distributed_optimizer``, dp x cp > 1) each
        one's states sharded over ``dp_cp`` (experts' over ``edp``; LR schedulers in ``lr_scheduler_configs``
        rebound), with ``overlap_param_gather`` the gathers overlapped with the next forward (:attr:`param_gather`);
        with a parameter buffer each returned optimizer gets the post-step hook that returns the parameters to their
        compute view (:meth:`MainParams.attach`)."""
        assert self.parallelized is not None, "parallelize first"
        sharded, self.param_gather = shard_optimizer_states(list(optimizers), list(lr_scheduler_configs), model,
                                                            self.parallelized, self.mesh, self.config,
                                                            self.param_gather)
        main_params = self.parallelized.main_params
        if main_params is not None:   # the optimizer stepped the fp32 main parameters: back to bf16
            for optimizer in sharded:
                main_params.attach(optimizer)
        return sharded

    def start_sharded_io(self, timeout: Optional[timedelta] = None) -> None:
        """With ``ckpt_format="torch_dist"``: the sharded checkpoint writer (:attr:`sharded_io`), with ``async_save``
        on a gloo group of its own (background saves must not share the training's group; collective on every rank
        of the world); nothing for ``"torch"``."""
        cfg = self.config
        if cfg.ckpt_format != "torch_dist":
            return
        from lightning_megatron.checkpoint.distributed import ShardedCheckpointIO

        group = torch.distributed.new_group(backend="gloo", timeout=timeout) if cfg.async_save else None
        self.sharded_io = ShardedCheckpointIO(cfg.async_save, group)

    # ------------------------------------------------------------------------------------------ each step
    @property
    def guard(self) -> Optional[NonFiniteGuard]:
        """The finaliser's non-finite guard (``check_for_nan_in_loss_and_grad``), None before :meth:`parallelize`."""
        return self.finalizer.guard if self.finalizer is not None else None

    def reduces_grads(self) -> bool:
        """Whether :meth:`finalize` changes the gradients in this layout (:meth:`GradientFinalizer.reduces_grads`)."""
        return self.finalizer is not None and self.finalizer.reduces_grads()

    def start_step(self, num_microbatches: Optional[int], direct: bool = False) -> None:
        """Before a step's first forward: bf16 parameters back to their compute copies (a skipped step left the fp32
        main view on) and told whether the step keeps its gradients as the backward computes them (``direct``:
        nothing accumulates, reduces or scales them, :meth:`MainParams.start_step`); then, with
        ``num_microbatches`` (backward passes per parameter and pipeline chunk), the overlapped data-parallel
        reductions armed: each bucket's all-reduce / reduce-scatter over ``dp_cp`` (experts ``edp``) starts in the
        backward once its gradients are complete. ``None``: not armed (manual optimization), :meth:`finalize` reduces.
        No communication here."""
        assert self.parallelized is not None and self.finalizer is not None, "parallelize first"
        main_params = self.parallelized.main_params
        if main_params is not None:
            main_params.to_compute()
            main_params.start_step(direct=direct)
        if num_microbatches is not None:
            self.finalizer.start_step(num_microbatches)

    def finalize(self, num_microbatches: Optional[int] = None) -> None:
        """After the step's last backward, once: wait for parameter gathers still in flight, then the finaliser's
        reductions (:meth:`GradientFinalizer.finalize`: the buffer's buckets over ``dp_cp`` / ``edp``, experts over
        ``edp``, SP-replicated gradients over ``tp``, the tied embedding over ``embedding``) and the end-of-step hooks
        (``num_microbatches``: the step's micro-batches under pipeline parallelism). Collective on every rank."""
        assert self.finalizer is not None, "parallelize first"
        self.wait_for_parameters()   # before the step writes the parameters again
        self.finalizer.finalize(num_microbatches)

    def clip(self, params: List[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip ``params``' gradients to global L2 norm ``max_norm`` (counted over ``tp``, ``pp``, ``ep_etp``, and
        ``dp_cp`` / ``edp`` for sharded gradients); returns the norm before clipping. After :meth:`finalize`."""
        assert self.finalizer is not None, "parallelize first"
        return self.finalizer.clip(params, float(max_norm))

    def end_step(self) -> None:
        """After an optimizer step was taken: the non-finite guard's end of the step (a device-decided verdict is read
        at the next step's :meth:`NonFiniteGuard.settle`)."""
        if self.guard is not None:
            self.guard.end_step()

    def wait_for_parameters(self) -> None:
        """With ``overlap_param_gather``: wait for the distributed optimizer's parameter gathers still in flight
        (over ``dp_cp`` / ``edp``); the weights are then the current ones."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    # ------------------------------------------------------------------------------------------ checkpoints
    def main_view(self) -> ContextManager:
        """bf16 parameters: a context in which they hold their fp32 main values (what checkpoints read and write);
        otherwise nothing."""
        return self.parallelized.main_view() if self.parallelized is not None else contextlib.nullcontext()

    def pp_group(self) -> Any:
        """The pipeline group under pp > 1 (full checkpoints merge the stages over it), else None."""
        return self.mesh.group("pp") if self.config.pp > 1 else None

    def layout_signature(self, world_size: int) -> Dict[str, int]:
        """The layout a sharded checkpoint records (``world``, ``tp``, ``pp``, ``cp``, ``ep``, ``etp``)."""
        c = self.mesh.config
        return {"world": world_size, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "etp": c.etp}
