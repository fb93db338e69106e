"""``MegatronStrategy``: Lightning's hooks, translated into the library's calls.

``setup_environment`` starts the process group and builds the :class:`ParallelMesh` and RNG streams;
``setup`` calls :func:`~lightning_megatron.parallelize.parallelize` (TP -> CP -> EP -> pipeline split ->
materialise), wraps data parallelism (:func:`~lightning_megatron.parallel.data_parallel.apply_dp`) and sets up the
optimizers. Training runs every layout through one step path
(:func:`~lightning_megatron.parallel.forward_backward.forward_backward`): the strategy collects the micro-batches of
an optimizer step (``Trainer(accumulate_grad_batches)``) and runs them at the last one, where Lightning's own
backward is switched off (the one place Lightning's loop is bypassed). Gradients are finished and clipped by
:class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer`; checkpoints hold full, layout-independent
tensors (:mod:`lightning_megatron.parallel.state_dict`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_megatron.contract import ParallelContext, ParallelLightningModule
from lightning_megatron.keywords import check_keywords
from lightning_megatron.launcher import MegatronMultiProcessingLauncher, global_seed
from lightning_megatron.parallel import forward_backward as step
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.parallel.data_parallel import apply_dp
from lightning_megatron.parallel.distributed_optimizer import (
    gathered_state_dict,
    is_sharded_optimizer,
    rebind_lr_scheduler,
    shard_optimizer,
)
from lightning_megatron.parallel.finalize_grads import GradientFinalizer
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.pipeline import PipelineRunner
from lightning_megatron.parallel.state_dict import (
    full_model_state_dict,
    full_optimizer_state_dict,
    shard_model_state_dict,
    shard_optimizer_state_dict,
)
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG, default_seed, tensor_parallel_seed
from lightning_megatron.parallelize import ParallelizedModel, parallelize
from lightning_megatron.precision import MegatronPrecision

log = logging.getLogger(__name__)

#: keywords of ``DDPStrategy`` itself that reach Lightning's DDP hook registration
_DDP_STRATEGY_KEYWORDS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
#: ``DistributedDataParallel`` arguments the strategy sets itself
_DDP_SET_BY_STRATEGY = ("self", "module", "device_ids", "output_device")


def _check_keywords(extra: Dict[str, Any], own: Sequence[str]) -> None:
    """Raise TypeError for a keyword that is neither the strategy's nor torch DDP's (naming the closest valid one)."""
    ddp = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in _DDP_SET_BY_STRATEGY]
    own = [n for n in own if n not in ("self", "ddp_kwargs")]
    check_keywords("MegatronStrategy", extra, own + list(_DDP_STRATEGY_KEYWORDS) + ddp)


class MegatronStrategy(DDPStrategy):
    """Tensor (+sequence), pipeline (incl. virtual stages), context, expert and data parallelism for Lightning.

    Args:
        tp, pp, vp, cp, ep, etp, sequence_parallel, cp_comm_type, hierarchical_context_parallel_sizes,
        pipeline_schedule, num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage,
        grad_reduce_in_bf16, use_distributed_optimizer, delay_wgrad_compute, cp_attention_kernel, cp_compile_merge,
        cp_sm_carveout: the layout and its options, the fields
            of :class:`ParallelConfig` (Megatron's names and meaning; validated there). dp is
            ``world / (tp * pp * cp)``; ep is carved out of the dp x cp x tp ranks.
        start_method: ``"popen"`` (default: re-runs the script per process; also works under torchrun and
            SLURM) or ``"spawn"`` / ``"fork"`` (tests, notebooks; the main process gets the full weights back).
        ddp_kwargs: arguments for ``torch.nn.parallel.DistributedDataParallel`` (dp x cp > 1, pp == 1) and
            Lightning's DDP hook options (``ddp_comm_hook``, ...). Any other keyword raises TypeError.

    The mesh (``strategy.mesh``) exists after ``setup_environment``. The DataLoader is sharded by data-parallel
    rank: TP, PP and CP peers see identical batches (CP ranks then keep their part, :meth:`batch_to_device`).
    A LightningModule implementing :class:`~lightning_megatron.contract.ParallelLightningModule` (as
    :class:`ParallelGPTModule`) trains through the one step path under every layout; ``train_loss`` is then the
    optimizer step's global token-mean, logged once per step at its last micro-batch. Other LightningModules
    train through Lightning's own loop (pp == 1).
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        vp: Optional[int] = None,
        cp: int = 1,
        ep: int = 1,
        etp: Optional[int] = None,
        sequence_parallel: bool = False,
        cp_comm_type: Union[str, Sequence[str]] = "p2p",
        hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None,
        pipeline_schedule: Optional[str] = None,
        grad_reduce_in_bf16: bool = False,
        use_distributed_optimizer: bool = False,
        delay_wgrad_compute: Optional[bool] = None,
        cp_attention_kernel: str = "auto",
        cp_compile_merge: bool = True,
        cp_sm_carveout: Optional[int] = None,
        num_layers_in_first_pipeline_stage: Optional[int] = None,
        num_layers_in_last_pipeline_stage: Optional[int] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        if "overlap_cp_a2a" in ddp_kwargs:
            raise ValueError("overlap_cp_a2a was removed: splitting the a2a layers' projections around their "
                             "exchanges measured no gain on 2xH200 (benchmarks/RESULTS.md). The a2a layers overlap "
                             "their backward exchanges by default (delay_wgrad_compute); drop overlap_cp_a2a")
        _check_keywords(ddp_kwargs, list(inspect.signature(MegatronStrategy.__init__).parameters))
        self.parallel_config = ParallelConfig(
            tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, etp=etp, sequence_parallel=sequence_parallel,
            cp_comm_type=cp_comm_type, hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
            pipeline_schedule=pipeline_schedule, grad_reduce_in_bf16=grad_reduce_in_bf16,
            use_distributed_optimizer=use_distributed_optimizer, delay_wgrad_compute=delay_wgrad_compute,
            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
            cp_attention_kernel=cp_attention_kernel, cp_compile_merge=cp_compile_merge, cp_sm_carveout=cp_sm_carveout,
        )
        if grad_reduce_in_bf16 and ddp_kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("grad_reduce_in_bf16=True installs its own DDP communication hook; drop ddp_comm_hook="
                             f"{ddp_kwargs['ddp_comm_hook']!r} or grad_reduce_in_bf16")
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **ddp_kwargs,
        )
        self.mesh: Optional[ParallelMesh] = None
        self.tp_rng: Optional[TensorParallelRNG] = None
        self.seed: int = global_seed()
        self.parallelized: Optional[ParallelizedModel] = None
        self._grads: Optional[GradientFinalizer] = None
        self._pipeline: Optional[PipelineRunner] = None
        self._microbatches: List[Any] = []
        self._step_microbatches: Optional[int] = None

    @property
    def pipeline_schedule(self) -> str:
        """The pipeline schedule's name (``parallel_config.pipeline_schedule``)."""
        return self.parallel_config.pipeline_schedule

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether the a2a CP layers delay their weight gradients (resolved against the model after setup)."""
        if self.parallelized is not None:
            return self.parallelized.delay_wgrad
        cfg = self.parallel_config
        return cfg.delay_wgrad_applies if cfg.delay_wgrad_compute is None else cfg.delay_wgrad_compute

    # ------------------------------------------------------------------ launch / environment
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":
            self._launcher = MegatronMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        """Start the process group, build the mesh, check the model's shape, seed the RNG streams."""
        super().setup_environment()
        self.mesh = ParallelMesh(self.parallel_config, device_type=self.root_device.type)
        model_config = getattr(self.lightning_module, "config", None)
        if model_config is not None:
            self.parallel_config.validate_model(model_config)
        self.seed = global_seed()
        pp_rank, tp_rank = self.mesh.rank("pp"), self.mesh.rank("tp")
        torch.manual_seed(default_seed(self.seed, pp_rank))
        self.tp_rng = TensorParallelRNG(tensor_parallel_seed(self.seed, tp_rank, pp_rank), self.root_device)
        log.info("lightning-megatron mesh: %r", self.mesh)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Shard data by data-parallel rank: TP (and CP) peers get the same samples."""
        assert self.mesh is not None, "distributed_sampler_kwargs needs setup_environment first"
        return {"num_replicas": self.mesh.size("dp"), "rank": self.mesh.rank("dp")}

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device: :meth:`setup` shards the model, then allocates and
        initialises only this rank's part (``empty_init=False`` builds on the root device instead)."""
        device = self.root_device if empty_init is False else torch.device("meta")
        with device, self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ model setup
    def setup(self, trainer: "pl.Trainer") -> None:
        """Parallelise and materialise the model, wrap DDP over dp x cp when fitting, set up optimizers."""
        assert self.accelerator is not None and self.model is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        self.parallelize(self.lightning_module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._install_global_norm_clipping()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self.parallelized.pipeline is None:
            register_ours = self._ddp_comm_hook is None
            self.model = apply_dp(self.model, self.mesh, self.parallel_config,
                                  expert_params=self.parallelized.expert_params,
                                  device_ids=self.determine_ddp_device_ids(), ddp_kwargs=self._ddp_kwargs,
                                  register_hook=register_ours)
            if not register_ours and isinstance(self.model, DistributedDataParallel):
                self._register_ddp_hooks()
        if fitting:
            self.setup_optimizers(trainer)
            if self.parallel_config.use_distributed_optimizer and self.mesh.size("dp_cp") > 1:
                self._shard_optimizers()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: "pl.LightningModule") -> ParallelizedModel:
        """:func:`~lightning_megatron.parallelize.parallelize` ``module`` over the mesh, and tell it the layout."""
        assert self.mesh is not None
        cfg, mesh = self.parallel_config, self.mesh
        if cfg.pp > 1 and not isinstance(module, ParallelLightningModule):
            raise ValueError(
                f"pp={cfg.pp}: {type(module).__name__} does not implement lightning_megatron.contract."
                "ParallelLightningModule (forward_step, loss_sum, token_count, ...): under pipeline parallelism the "
                "strategy runs the schedule and needs the module's step pieces (see ParallelGPTModule)"
            )
        plugin = self.precision_plugin
        fp8 = plugin.bind(self.root_device, mesh) if isinstance(plugin, MegatronPrecision) else None
        self.parallelized = parallelize(module, mesh, cfg, device=self.root_device, seed=self.seed,
                                        tp_fork=self.tp_rng.fork if self.tp_rng else None,
                                        forward_context=self.precision_plugin.forward_context, fp8=fp8)
        self._grads = GradientFinalizer(self.parallelized, mesh)
        stages = self.parallelized.pipeline
        self._pipeline = stages.runner(mesh.group("pp"), mesh.ranks("pp"), self.root_device) if stages else None
        if isinstance(module, ParallelLightningModule):
            tokens = [mesh.group("dp_cp")] + ([mesh.group("tp")] if cfg.sequence_parallel else [])
            module.set_parallel_context(ParallelContext(
                dp_group=mesh.group("dp_cp"), dp_size=mesh.size("dp_cp"), token_groups=tokens,
                pp_group=mesh.group("pp") if cfg.pp > 1 else None))
        return self.parallelized

    def _shard_optimizers(self) -> None:
        """Replace each optimizer by its states-sharded version over dp x cp; LR schedulers follow."""
        assert self.mesh is not None
        sharded = [shard_optimizer(opt, self.mesh.group("dp_cp")) for opt in self.optimizers]
        for old, new in zip(self.optimizers, sharded):
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is old:
                    rebind_lr_scheduler(config.scheduler, new)
        self.optimizers = sharded

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then under cp > 1 keep this rank's load-balanced part of every sequence.

        ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` ``[b, s]`` are cut into ``2*cp`` chunks along
        ``s`` and CP rank ``r`` keeps chunks ``r`` and ``2*cp-1-r``; ``position_ids`` (made ``arange(s)`` when
        absent) keep the true positions for RoPE. Data modules stay unchanged; hooks after this see the split.
        """
        batch = super().batch_to_device(batch, device, dataloader_idx)
        cfg = self.parallel_config
        if cfg.cp == 1 or not isinstance(batch, dict) or "tokens" not in batch:
            return batch
        from lightning_megatron.parallel.context_parallel import zigzag_split

        assert self.mesh is not None
        split = dict(batch)
        if split.get("position_ids") is None:
            tokens = batch["tokens"]
            split["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            if isinstance(split.get(key), torch.Tensor):
                split[key] = zigzag_split(split[key], cfg.cp, self.mesh.rank("cp"), dim=1)
        return split

    # ------------------------------------------------------------------ the one step path
    def _uses_step_path(self) -> bool:
        return isinstance(self.lightning_module, ParallelLightningModule)

    def _step_functions(self, context: Callable[[], Any]) -> step.StepFunctions:
        """The module's step pieces; without a pipeline its forward and loss run inside ``context`` (the precision
        plugin's autocast; pipeline stages enter it themselves) and backward outside it."""
        lm = self.lightning_module

        def forward(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
            with context():
                if isinstance(self.model, DistributedDataParallel) and lm.trainer.training:
                    return self._forward_redirection(self.model, lm, "forward_step", batch)   # DDP's reducer hooks
                return lm.forward_step(batch)

        def loss_sum(output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
            if self._pipeline is not None:
                return lm.loss_sum(output, batch)
            with context():
                return lm.loss_sum(output, batch)

        def scale_loss(loss: torch.Tensor) -> torch.Tensor:
            return self.precision_plugin.pre_backward(loss, lm)

        def backward(loss: torch.Tensor) -> None:
            self.precision_plugin.backward(loss, lm, None)
            self.precision_plugin.post_backward(loss, lm)

        return step.StepFunctions(forward, loss_sum, lm.token_count, scale_loss, backward)

    def on_train_start(self) -> None:
        """The step path runs forward and backward inside ``training_step``: Lightning's own backward is off."""
        super().on_train_start()
        if self._uses_step_path():
            self.lightning_module.trainer.fit_loop._skip_backward = True

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._uses_step_path():
            self.lightning_module.trainer.fit_loop._skip_backward = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Collect the step's micro-batches (one per Lightning batch, ``accumulate_grad_batches`` of them) and run
        :func:`forward_backward` on the last one. Returns the step's loss (the same on every rank)."""
        if not self._uses_step_path():
            return super().training_step(*args, **kwargs)
        assert self.mesh is not None
        self._microbatches.append(args[0])
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return torch.zeros((), device=self.root_device)
        microbatches, self._microbatches = self._microbatches, []
        self._step_microbatches = len(microbatches)
        lm, m, dp = self.lightning_module, len(microbatches), self.mesh.size("dp_cp")
        for optimizer in self.optimizers:   # Lightning's zero_grad is off with its backward
            optimizer.zero_grad(set_to_none=True)
        scaler = getattr(self.precision_plugin, "scaler", None)   # fp16: aux losses get the loss scale too
        loss_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        lm.set_moe_aux_loss_scale((float(dp) if self._pipeline is not None else dp / m) * loss_scale)
        no_sync = self.model.no_sync if isinstance(self.model, DistributedDataParallel) else contextlib.nullcontext
        loss = step.forward_backward(microbatches, self._step_functions(self.precision_plugin.train_step_context),
                                     device=self.root_device, dp_group=self.mesh.group("dp_cp"), dp=dp,
                                     pipeline=self._pipeline, no_sync=no_sync)
        lm.log_train_step(loss, m)
        return loss

    def _eval_step(self, batch: Any, context: Callable[[], Any]) -> None:
        totals = step.eval_totals(batch, self._step_functions(context), device=self.root_device,
                                  pipeline=self._pipeline)
        self.lightning_module.accumulate_eval_totals(totals)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._uses_step_path():
            return super().validation_step(*args, **kwargs)
        return self._eval_step(args[0], self.precision_plugin.val_step_context)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._uses_step_path():
            return super().test_step(*args, **kwargs)
        return self._eval_step(args[0], self.precision_plugin.test_step_context)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Per-token loss ``[b, s]`` (with labels) or logits ``[b, s, V_pad/tp]``, on every rank."""
        if not self._uses_step_path():
            return super().predict_step(*args, **kwargs)
        fns = self._step_functions(self.precision_plugin.predict_step_context)
        return step.predict(args[0], fns, self.lightning_module.per_token_loss, pipeline=self._pipeline)

    # ------------------------------------------------------------------ gradients
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (forward + backward), finish the gradients, then let the precision plugin clip and
        step. Lightning calls this once per optimizer step, after the last micro-batch."""

        def closure_then_finalize() -> Any:
            result = closure()
            self.finalize_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_finalize, model, **kwargs)

    def finalize_gradients(self) -> None:
        """Gradient reductions DDP does not do, once per optimizer step (:class:`GradientFinalizer`)."""
        assert self._grads is not None
        self._grads.finalize(self._step_microbatches)

    def _install_global_norm_clipping(self) -> None:
        """Route Lightning's ``gradient_clip_val`` (norm) through the global-norm clip (the one override)."""
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign]
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # bf16-mixed has no loss scaler, so a fused optimizer (ours on CUDA) has nothing to unscale and
            # clipping before its step is correct; Lightning's check refuses it anyway. fp16 keeps the check.
            plugin.clip_gradients = functools.partial(Precision.clip_gradients, plugin)  # type: ignore[method-assign]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to global L2 norm ``clip_val``; returns the norm before clipping."""
        assert self._grads is not None
        return self._grads.clip([p for group in optimizer.param_groups for p in group["params"]], float(clip_val))

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load ``ckpt_path`` after :meth:`setup`: before it the weights are on the meta device (loading into
        them is a silent no-op) and not yet sharded."""
        return True

    def _pp_group(self) -> Any:
        return self.mesh.group("pp") if self.mesh is not None and self.parallel_config.pp > 1 else None

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Full, layout-independent state (TP shards gathered; collective on every rank)."""
        return full_model_state_dict(self.lightning_module, self._pp_group())

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """Full optimizer state (per-parameter state of TP shards gathered; collective on every rank)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)   # unwrap a LightningOptimizer
        raw = gathered_state_dict(optimizer) if is_sharded_optimizer(optimizer) else None
        return full_optimizer_state_dict(optimizer, self.lightning_module, self._pp_group(), raw=raw)

    def load_model_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True) -> None:
        """Load a full checkpoint, keeping this rank's shards."""
        state = shard_model_state_dict(self.lightning_module, checkpoint["state_dict"])
        self.lightning_module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        """Load full optimizer states, keeping this rank's shards."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(shard_optimizer_state_dict(state, optimizer, self.lightning_module))
            if is_sharded_optimizer(optimizer):
                # ZeroRedundancyOptimizer also keeps the loaded states in its own (unused) ``state``: on the
                # device, a second copy of this rank's share. Its steps and state_dict use the shard's optimizer.
                optimizer.state.clear()

    # ------------------------------------------------------------------ registry
    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"megatron"`` (popen launch) and ``"megatron_spawn"`` (spawn launch)."""
        if "megatron" not in strategy_registry:
            strategy_registry.register("megatron", cls, description="lightning-megatron MegatronStrategy")
        if "megatron_spawn" not in strategy_registry:
            strategy_registry.register("megatron_spawn", cls, description="MegatronStrategy, spawn launch",
                                       start_method="spawn")


MegatronStrategy.register_strategies(StrategyRegistry)
