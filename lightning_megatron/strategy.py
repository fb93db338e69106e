"""``MegatronStrategy``: Megatron-style parallelism as a Lightning strategy.

Order of work (Lightning calls these): ``setup_environment`` starts the process group and builds the
:class:`ParallelMesh` and the RNG streams; ``setup`` applies tensor (+ sequence) parallelism to every
submodule that has a ``tensor_parallel_plan`` (e.g. :class:`GPTModel`), routes attention through context
parallelism, splits the model into pipeline stages, materialises meta-device weights and initialises them
layout-independently, then wraps data parallelism (torch DDP over the dp x cp group, or a once-per-step
average for pipeline stages).
Gradient clipping is replaced by clipping at the true global norm; checkpoints hold full (unsharded)
tensors, so they load under any tp/dp layout.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_megatron.parallel.config import A2A_COMM_TYPES, ParallelConfig
from lightning_megatron.parallel.distributed_optimizer import (
    gathered_state_dict,
    is_sharded_optimizer,
    rebind_lr_scheduler,
    shard_optimizer,
)
from lightning_megatron.parallel.grad_norm import clip_grad_norm_
from lightning_megatron.parallel.grad_sync import (
    allreduce_data_parallel_grads,
    allreduce_expert_parallel_grads,
    allreduce_sequence_parallel_grads,
    bf16_allreduce_hook,
    defer_sequence_parallel_grad_reduce,
    mean_allreduce_hook,
    owned_parameters,
)
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.pipeline import (
    V_SHAPE_SCHEDULES,
    PipelineRunner,
    PipelineStageModule,
    check_schedule,
    default_schedule,
    layers_per_stage,
    split_model,
)
from lightning_megatron.parallel.state_dict import (
    full_model_state_dict,
    full_optimizer_state_dict,
    shard_model_state_dict,
    shard_optimizer_state_dict,
)
from lightning_megatron.parallel.tensor_parallel.layers import TensorParallelModule, pad_vocab_size
from lightning_megatron.parallel.tensor_parallel.plan import apply_tp
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG, default_seed, tensor_parallel_seed

log = logging.getLogger(__name__)

DEFAULT_SEED = 1234  # Megatron's --seed default, used when seed_everything was not called


class MegatronStrategy(DDPStrategy):
    """Tensor (+sequence), pipeline (incl. virtual stages), context and data parallelism for Lightning.

    Args:
        tp, pp, vp, cp: tensor / pipeline / virtual-pipeline / context parallel sizes; dp is world / (tp*pp*cp).
        ep, etp: expert-parallel and expert-tensor-parallel sizes (etp defaults to tp) for mixture-of-experts
            models: ep is carved out of the dp x cp x tp ranks (Megatron's "MoE parallel folding"), the
            expert-data-parallel size is ``world / (etp * ep * pp)``. Expert gradients are summed over the
            expert-data-parallel group and divided by dp x cp; the other gradients go through DDP over dp x cp.
        sequence_parallel: Megatron's sequence parallelism (needs tp > 1; warns and disables otherwise).
        cp_comm_type, hierarchical_context_parallel_sizes: context-parallel attention options (Megatron's).
        pipeline_schedule: one of :data:`lightning_megatron.parallel.pipeline.SCHEDULE_NAMES` (default
            ``"1f1b"``, ``"interleaved_1f1b"`` with ``vp``); the micro-batches per optimizer step are
            ``Trainer(accumulate_grad_batches)``.
        num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage: uneven pipeline splits.
        grad_reduce_in_bf16: reduce the data-parallel (dp x cp) gradients in bfloat16 (Megatron's
            ``--grad-reduce-in-bf16``): half the all-reduce traffic, each gradient rounded to bf16 once before
            the sum. Default: the gradients' own dtype (float32 under bf16-mixed, as Megatron's default).
        use_distributed_optimizer: Megatron's distributed optimizer (ZeRO-1): optimizer states sharded over dp x cp
            (torch's ``ZeroRedundancyOptimizer``); each rank steps its share of the parameters and broadcasts
            them. Checkpoints stay full and layout-independent. Not with ``ep > 1`` yet.
        delay_wgrad_compute: Megatron's ``--delay-wgrad-compute`` for the a2a context-parallel layers (cp > 1,
            ``cp_comm_type`` "a2a" / "a2a+p2p", tp=1): ``linear_proj`` and the dense MLP's linears leave their
            weight-gradient GEMMs to the attention's backward, which runs them while its all-to-alls travel
            (the exchanges would otherwise be exposed). Gradients are unchanged. ``None`` (default): on wherever
            it applies (those layouts, with a model whose ``set_context_parallel`` takes the delay, as
            ``GPTModel``'s); measured 0.7-0.9% faster at cp=2 on 2xH200. ``False``: off.
        cp_attention_kernel, cp_compile_merge, cp_sm_carveout: context-parallel kernel options, see
            :class:`~lightning_megatron.parallel.config.ParallelConfig` (block kernel on CUDA half types, compiled
            ring merge, SMs left to the a2a exchanges by the delayed weight-gradient GEMMs).
        start_method: ``"popen"`` (default: re-runs the script per process; also works under torchrun and
            SLURM) or ``"spawn"`` / ``"fork"`` (tests, notebooks).
        ddp_kwargs: extra arguments to ``torch.nn.parallel.DistributedDataParallel`` (used when pp == 1).

    The mesh (``strategy.mesh``, a :class:`ParallelMesh`) exists after ``setup_environment``. The
    DataLoader is sharded by data-parallel rank: TP, PP and CP peers see identical batches (CP ranks then keep
    their part of each sequence, see :meth:`batch_to_device`).
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
        self.parallel_config = ParallelConfig(
            tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, etp=etp, sequence_parallel=sequence_parallel,
            cp_comm_type=cp_comm_type, hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
            cp_attention_kernel=cp_attention_kernel, cp_compile_merge=cp_compile_merge, cp_sm_carveout=cp_sm_carveout,
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **ddp_kwargs,
        )
        self.mesh: Optional[ParallelMesh] = None
        self.tp_rng: Optional[TensorParallelRNG] = None
        self.seed: int = DEFAULT_SEED
        self._sharded_params: Set[int] = set()
        self._sp_owners: List[Tuple[nn.Module, str]] = []
        self.pipeline_schedule = pipeline_schedule or default_schedule(vp)
        self.grad_reduce_in_bf16 = grad_reduce_in_bf16
        self.use_distributed_optimizer = use_distributed_optimizer
        if use_distributed_optimizer and ep > 1:
            raise ValueError(f"use_distributed_optimizer=True with ep={ep} is not supported yet: expert weights differ "
                             "between the dp x cp ranks the optimizer states are sharded over; use ep=1 or the "
                             "plain optimizer")
        types = [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)
        delay_applies = cp > 1 and any(t in A2A_COMM_TYPES for t in types) and tp == 1
        self._delay_wgrad_auto = delay_wgrad_compute is None
        self.delay_wgrad_compute = delay_applies if delay_wgrad_compute is None else delay_wgrad_compute
        if delay_wgrad_compute and not delay_applies:
            raise ValueError(
                "delay_wgrad_compute=True runs the weight-gradient GEMMs during the a2a context-parallel "
                f"exchanges: it needs cp > 1 with cp_comm_type 'a2a' or 'a2a+p2p' and tp=1; got cp={cp}, "
                f"cp_comm_type={cp_comm_type!r}, tp={tp}")
        if "overlap_cp_a2a" in ddp_kwargs:
            raise ValueError("overlap_cp_a2a was removed: splitting the a2a layers' projections around their "
                             "exchanges measured no gain on 2xH200 (benchmarks/RESULTS.md). The a2a layers overlap "
                             "their backward exchanges by default (delay_wgrad_compute); drop overlap_cp_a2a")
        if grad_reduce_in_bf16 and ddp_kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("grad_reduce_in_bf16=True installs its own DDP communication hook; drop ddp_comm_hook="
                             f"{ddp_kwargs['ddp_comm_hook']!r} or grad_reduce_in_bf16")
        if pp > 1:
            check_schedule(self.pipeline_schedule, pp, vp)
        self._pp_layers = (num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)
        self._pp_runner: Optional[PipelineRunner] = None
        self._pp_stage_modules: List[PipelineStageModule] = []
        self._pp_stage_indices: List[int] = []
        self._pp_num_stages = 1
        self._pp_buffer: List[Any] = []
        self._pp_tied = False
        self._embedding_param_owner: Optional[nn.Module] = None
        self._excluded_from_norm: Set[int] = set()
        self._expert_params: List[nn.Parameter] = []

    # ------------------------------------------------------------------ launch / environment
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":
            self._launcher = _MegatronMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        """Start the process group, build the mesh, check the model's shape, seed the RNG streams."""
        super().setup_environment()
        self.mesh = ParallelMesh(self.parallel_config, device_type=self.root_device.type)
        model_config = getattr(self.lightning_module, "config", None)
        if model_config is not None:
            self.parallel_config.validate_model(model_config)
            if self.parallel_config.pp > 1 and hasattr(model_config, "num_layers"):
                cfg = self.parallel_config
                layers_per_stage(model_config.num_layers, cfg.pp * (cfg.vp or 1), *self._pp_layers)
        self.seed = self._agree_on_seed()
        pp_rank, tp_rank = self.mesh.rank("pp"), self.mesh.rank("tp")
        torch.manual_seed(default_seed(self.seed, pp_rank))
        self.tp_rng = TensorParallelRNG(tensor_parallel_seed(self.seed, tp_rank, pp_rank), self.root_device)
        log.info("lightning-megatron mesh: %r", self.mesh)

    def _agree_on_seed(self) -> int:
        env = os.environ.get("PL_GLOBAL_SEED")
        if env is not None:
            return int(env)
        return DEFAULT_SEED

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Shard data by data-parallel rank: TP (and CP) peers get the same samples."""
        assert self.mesh is not None, "distributed_sampler_kwargs needs setup_environment first"
        return {"num_replicas": self.mesh.size("dp"), "rank": self.mesh.rank("dp")}

    # ------------------------------------------------------------------ model setup
    def setup(self, trainer: "pl.Trainer") -> None:
        """Apply TP(+SP), materialise and initialise weights, wrap DDP over dp x cp, set up optimizers."""
        assert self.accelerator is not None and self.model is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        self.parallelize(self.lightning_module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._install_global_norm_clipping()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.parallel_config.pp > 1:
            self._build_pipeline_runner()
        elif fitting and self.mesh.size("dp_cp") > 1:
            self._ddp_kwargs.setdefault("process_group", self.mesh.group("dp_cp"))
            # gradients live in DDP's buckets (Megatron's contiguous grad buffer): no per-step copy in and out
            self._ddp_kwargs.setdefault("gradient_as_bucket_view", True)
            self._exclude_experts_from_ddp()
            self.configure_ddp()
            # Lightning registers ddp_comm_hook on CUDA only: ours are registered here, on every device. Without
            # a hook DDP divides each gradient by the group size in a kernel of its own (2.9 ms of a 280 ms cp=2
            # step of the 1.3B model on H200).
            if self._ddp_comm_hook is None:
                assert isinstance(self.model, DistributedDataParallel)
                hook = bf16_allreduce_hook if self.grad_reduce_in_bf16 else mean_allreduce_hook
                self.model.register_comm_hook(self.mesh.group("dp_cp"), hook)
        if fitting:
            self.setup_optimizers(trainer)
            if self.use_distributed_optimizer and self.mesh.size("dp_cp") > 1:
                self._shard_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_optimizers(self) -> None:
        """Replace each optimizer by its states-sharded version over dp x cp; LR schedulers follow."""
        assert self.mesh is not None
        sharded = [shard_optimizer(opt, self.mesh.group("dp_cp")) for opt in self.optimizers]
        for old, new in zip(self.optimizers, sharded):
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is old:
                    rebind_lr_scheduler(config.scheduler, new)
        self.optimizers = sharded

    def parallelize(self, module: nn.Module) -> nn.Module:
        """Apply the parallelisms to ``module`` in place (TP+SP now) and materialise meta weights.

        Every submodule with a ``tensor_parallel_plan`` method is tensor-parallelised over the TP group.
        Meta-device weights are then allocated on the root device and initialised with the submodule's
        ``init_weights(seed)`` (layout-independent) or, for modules without it, ``reset_parameters()``.
        """
        assert self.mesh is not None
        cfg = self.parallel_config
        targets = [m for m in module.modules() if hasattr(m, "tensor_parallel_plan")]
        if cfg.tp > 1 and not targets:
            raise ValueError(
                f"tp={cfg.tp} but {type(module).__name__} contains no module with a tensor_parallel_plan(tp, "
                "sequence_parallel) method; use lightning_megatron.GPTModel or call "
                "lightning_megatron.parallel.apply_tp(model, group, plan=...) in configure_model"
            )
        if cfg.tp > 1:
            for target in targets:
                apply_tp(target, self.mesh.group("tp"), cfg.sequence_parallel, tp_fork=self.tp_rng.fork)
        if cfg.cp > 1:
            self._apply_context_parallel(targets)
        self._apply_expert_parallel(targets)
        if cfg.pp > 1:
            self._split_pipeline(targets)
        self._sp_owners = defer_sequence_parallel_grad_reduce(module) if cfg.sequence_parallel else []
        self._materialize(module, targets)
        # after materialisation: to_empty() replaces meta Parameter objects
        self._sharded_params = {
            id(p)
            for m in module.modules()
            if isinstance(m, TensorParallelModule)
            for name, p in m.named_parameters(recurse=False)
            if m.is_sharded(name)
        }
        self._expert_params = _expert_parameters(module)
        self._resolve_tied_embedding()
        return module

    # ------------------------------------------------------------------ expert parallel
    def _apply_expert_parallel(self, targets: List[nn.Module]) -> None:
        """Mixture-of-experts models: shard the experts over the ep / etp groups (on the meta device) and tell
        the routers where the rest of each micro-batch's tokens are (dp; cp and, under SP, tp)."""
        assert self.mesh is not None
        cfg = self.parallel_config
        moe_targets = [t for t in targets if hasattr(t, "set_expert_parallel")
                       and any(True for _ in getattr(t, "moe_layers", dict)().values())]
        if not moe_targets:
            if cfg.ep > 1:
                raise ValueError(f"ep={cfg.ep} needs a mixture-of-experts model (e.g. GPTModel with num_moe_experts); "
                                 "none was found")
            return
        mesh = self.mesh
        for target in moe_targets:
            target.set_expert_parallel(mesh.group("ep") if cfg.ep > 1 else None,
                                       mesh.group("etp") if cfg.etp > 1 else None,
                                       mesh.group("ep_etp") if cfg.ep * cfg.etp > 1 else None)
            sequence = [mesh.group("cp")] + ([mesh.group("tp")] if cfg.sequence_parallel else [])
            target.set_moe_token_groups(sequence, [mesh.group("dp")])

    def _exclude_experts_from_ddp(self) -> None:
        """Expert weights differ between dp ranks (they are reduced over expert data parallel instead) and the
        routers' token-count buffers are per rank: keep both out of DDP (no broadcast, no gradient hooks)."""
        if not self._expert_params:
            return
        from lightning_megatron.moe.router import TopKRouter

        experts = {id(p) for p in self._expert_params}
        names = [n for n, p in self.model.named_parameters() if id(p) in experts]
        for mod_name, m in self.model.named_modules():
            if isinstance(m, TopKRouter):
                names += [f"{mod_name}.{b}" for b, _ in m.named_buffers(recurse=False)]
        existing = list(getattr(self.model, "_ddp_params_and_buffers_to_ignore", []))
        self.model._ddp_params_and_buffers_to_ignore = existing + names

    # ------------------------------------------------------------------ context parallel
    def _apply_context_parallel(self, targets: List[nn.Module]) -> None:
        """Route each model's core attention through context-parallel attention over the CP group."""
        if not targets or not all(hasattr(t, "set_context_parallel") for t in targets):
            raise ValueError(
                f"cp={self.parallel_config.cp} needs a model with set_context_parallel(attention_for_layer) "
                "(as lightning_megatron.GPTModel)"
            )
        for target in targets:
            if self.delay_wgrad_compute and (not self._delay_wgrad_auto or _takes_wgrad_delay(target)):
                target.set_context_parallel(self._context_parallel_attention_for, self._delays_wgrad)
            else:
                target.set_context_parallel(self._context_parallel_attention_for)

    def _comm_type(self, layer: int) -> str:
        types = self.parallel_config.cp_comm_type
        return types if isinstance(types, str) else types[layer]

    def _delays_wgrad(self, layer: int) -> bool:
        """Whether ``layer`` delays its weight gradients into its CP attention (a2a comm types only)."""
        return self.delay_wgrad_compute and self._comm_type(layer) in A2A_COMM_TYPES

    def _context_parallel_attention_for(self, layer: int) -> Callable[..., torch.Tensor]:
        from lightning_megatron.parallel.context_parallel import context_parallel_attention

        assert self.mesh is not None
        comm_type = self._comm_type(layer)
        inner = self.mesh.group("cp_inner") if comm_type == "a2a+p2p" else None
        outer = self.mesh.group("cp_outer") if comm_type == "a2a+p2p" else None
        cfg = self.parallel_config
        return functools.partial(context_parallel_attention, group=self.mesh.group("cp"), comm_type=comm_type,
                                 inner_group=inner, outer_group=outer, attention_kernel=cfg.cp_attention_kernel,
                                 compile_merge=cfg.cp_compile_merge, sm_carveout=cfg.cp_sm_carveout)

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
        cp, rank = cfg.cp, self.mesh.rank("cp")
        tokens = batch["tokens"]
        split = dict(batch)
        if split.get("position_ids") is None:
            split["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            if isinstance(split.get(key), torch.Tensor):
                split[key] = zigzag_split(split[key], cp, rank, dim=1)
        return split

    # ------------------------------------------------------------------ pipeline parallel
    def _split_pipeline(self, targets: List[nn.Module]) -> None:
        """Prune the (meta) model to this rank's pipeline stages and build the stage modules."""
        assert self.mesh is not None
        cfg = self.parallel_config
        layout = [t for t in targets if hasattr(t, "decoder") and hasattr(t, "embed") and hasattr(t, "head")]
        if len(layout) != 1:
            raise ValueError(
                f"pp={cfg.pp} needs exactly one model with the GPT layout (embedding, decoder.layers, "
                f"final_layernorm, output_layer, embed/head methods, as lightning_megatron.GPTModel), found "
                f"{len(layout)}"
            )
        lm = self.lightning_module
        for hook in ("pipeline_loss_sum", "token_count"):
            if not hasattr(lm, hook):
                raise ValueError(
                    f"pp={cfg.pp}: {type(lm).__name__} has no {hook}(...): under pipeline parallelism the "
                    "strategy runs the schedule and needs the module's loss pieces (see ParallelGPTModule)"
                )
        model = layout[0]
        self._pp_tied = getattr(model.output_layer, "weight", 0) is None
        self._pp_stage_modules, self._pp_stage_indices, self._pp_num_stages = split_model(
            model, self.mesh.rank("pp"), cfg.pp, cfg.vp or 1, self.pipeline_schedule, cfg.tp, *self._pp_layers
        )
        for stage in self._pp_stage_modules:
            stage.forward_context = self.precision_plugin.forward_context
        self._embedding_param_owner = model.embedding

    def _resolve_tied_embedding(self) -> None:
        """Tied embeddings over pp > 1 (loop placement): the last stage holds a copy of the word embeddings,
        initialised identically; its gradient is summed with the first stage's each step and it is left out
        of the gradient norm (counted once, on the first stage)."""
        self._excluded_from_norm = set()
        if self.parallel_config.pp == 1 or not self._pp_tied or self.pipeline_schedule in V_SHAPE_SCHEDULES:
            return
        holds_first = 0 in self._pp_stage_indices
        holds_last = self._pp_num_stages - 1 in self._pp_stage_indices
        if holds_last and not holds_first:
            self._excluded_from_norm.add(id(self._embedding_param_owner.word_embeddings.weight))

    def _build_pipeline_runner(self) -> None:
        """Stages are not wrapped in torch DDP (its reducer expects one backward per step, a schedule runs
        one per micro-batch): their gradients are averaged over dp x cp in :meth:`finalize_gradients`."""
        assert self.mesh is not None
        self._pp_runner = PipelineRunner(
            self._pp_stage_modules, self._pp_stage_indices, self._pp_num_stages,
            self.mesh.group("pp"), self.mesh.ranks("pp"), self.pipeline_schedule, self.root_device,
            self.pipeline_schedule in V_SHAPE_SCHEDULES,
        )

    def on_train_start(self) -> None:
        """Under pp > 1 the schedule runs forward and backward inside ``training_step``: Lightning's own
        zero_grad and backward are switched off (the one place Lightning's loop is bypassed)."""
        super().on_train_start()
        if self._pp_runner is not None:
            self.lightning_module.trainer.fit_loop._skip_backward = True

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._pp_runner is not None:
            self.lightning_module.trainer.fit_loop._skip_backward = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1: collect the step's micro-batches (one per Lightning batch, ``accumulate_grad_batches``
        of them) and run the pipeline schedule on the last one. Returns the step's loss (same on every rank)."""
        if self._pp_runner is None:
            return super().training_step(*args, **kwargs)
        self._pp_buffer.append(args[0])
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return torch.zeros((), device=self.root_device)
        microbatches, self._pp_buffer = self._pp_buffer, []
        loss = self._pipeline_train_step(microbatches)
        self.lightning_module.on_pipeline_train_step_end(loss)
        return loss

    def _pipeline_train_step(self, microbatches: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
        assert self.mesh is not None and self._pp_runner is not None
        lm = self.lightning_module
        runner = self._pp_runner
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        dp_group, dp = self.mesh.group("dp_cp"), self.mesh.size("dp_cp")
        if hasattr(lm, "set_moe_aux_loss_scale"):
            lm.set_moe_aux_loss_scale(float(dp))   # the schedule divides every gradient by the micro-batch count
        counts = torch.stack([lm.token_count(mb).float() for mb in microbatches]).to(self.root_device)
        if runner.holds_last and dp > 1:
            dist.all_reduce(counts, group=dp_group)
        counts = counts.clamp(min=1.0)
        # by micro-batch index: torch's schedules may evaluate the loss once more while setting up a stage
        parts: Dict[int, torch.Tensor] = {}

        def loss_fn(output: torch.Tensor, index: int) -> torch.Tensor:
            loss_sum = lm.pipeline_loss_sum(output, microbatches[index])
            parts[index] = loss_sum.detach() / counts[index]
            return loss_sum * dp / counts[index]

        tokens = torch.cat([mb["tokens"] for mb in microbatches]).to(self.root_device)
        positions = [mb.get("position_ids") for mb in microbatches]
        runner.train_step(tokens, positions, loss_fn)
        value = torch.stack(list(parts.values())).sum() / len(microbatches) if parts else torch.zeros((), device=self.root_device)
        value = value.float()
        if runner.holds_last and dp > 1:
            dist.all_reduce(value, group=dp_group)
        return runner.broadcast_from_last(value)

    def _pipeline_forward(self, batch: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        assert self._pp_runner is not None
        model_config = self.lightning_module.config
        dtype = next(p for m in self._pp_stage_modules for p in m.parameters()).dtype
        return self._pp_runner.forward_only(
            batch["tokens"], batch.get("position_ids"), model_config.hidden_size,
            self.parallel_config.sequence_parallel, self.parallel_config.tp, dtype,
        )

    def _pipeline_eval_step(self, batch: Dict[str, torch.Tensor]) -> None:
        assert self._pp_runner is not None
        lm = self.lightning_module
        logits = self._pipeline_forward(batch)
        totals = torch.zeros(2, device=self.root_device)
        if logits is not None:
            totals = torch.stack([lm.pipeline_loss_sum(logits, batch).float(), lm.token_count(batch).float()])
        lm.accumulate_eval_totals(self._pp_runner.broadcast_from_last(totals))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp_runner is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval_step(args[0])

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp_runner is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval_step(args[0])

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1: per-token loss ``[b, s]`` (with labels) or logits ``[b, s, V_pad/tp]``, on every rank."""
        if self._pp_runner is None:
            return super().predict_step(*args, **kwargs)
        lm, batch = self.lightning_module, args[0]
        logits = self._pipeline_forward(batch)
        b, s = batch["tokens"].shape
        if batch.get("labels") is not None:
            out = torch.zeros(b, s, device=self.root_device)
            if logits is not None:
                out = lm.model.per_token_loss(logits, batch["labels"]).float()
        else:
            cfg = self.parallel_config
            vocab = pad_vocab_size(lm.config.vocab_size, cfg.tp, lm.config.make_vocab_size_divisible_by) // cfg.tp
            out = torch.zeros(b, s, vocab, device=self.root_device)
            if logits is not None:
                out = logits.transpose(0, 1).float().contiguous()
        return self._pp_runner.broadcast_from_last(out)

    def _materialize(self, module: nn.Module, targets: List[nn.Module]) -> None:
        if not any(p.is_meta for p in module.parameters()):
            return
        module.to_empty(device=self.root_device)
        initialised: Set[int] = set()
        for target in targets:
            if hasattr(target, "init_weights"):
                target.init_weights(self.seed)
                initialised.update(id(m) for m in target.modules())
        with torch.no_grad():
            for m in module.modules():
                if id(m) not in initialised and hasattr(m, "reset_parameters"):
                    m.reset_parameters()

    # ------------------------------------------------------------------ gradients
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (forward + backward), finish the gradients (:meth:`finalize_gradients`), then let
        the precision plugin clip and step. Lightning calls this once per optimizer step, after the last
        micro-batch of gradient accumulation."""

        def closure_then_finalize() -> Any:
            result = closure()
            self.finalize_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_finalize, model, **kwargs)

    @property
    def _grad_reduce_dtype(self) -> Optional[torch.dtype]:
        return torch.bfloat16 if self.grad_reduce_in_bf16 else None

    def finalize_gradients(self) -> None:
        """Gradient reductions once per optimizer step, after the last backward: data-parallel average of
        pipeline stages' grads (pp > 1), expert grads summed over expert data parallel and divided by dp x cp,
        SP-replicated grads summed over TP, tied embedding grads summed over the first and last pipeline stage."""
        assert self.mesh is not None
        experts = {id(p) for p in self._expert_params}
        if self._pp_runner is not None and self.mesh.size("dp_cp") > 1:
            dense = [p for p in self.lightning_module.parameters() if id(p) not in experts]
            allreduce_data_parallel_grads(dense, self.mesh.group("dp_cp"), reduce_dtype=self._grad_reduce_dtype)
        if self._expert_params:
            allreduce_expert_parallel_grads(self._expert_params, self.mesh.group("edp"), self.mesh.size("dp_cp"),
                                            reduce_dtype=self._grad_reduce_dtype)
        if self._sp_owners:
            allreduce_sequence_parallel_grads(owned_parameters(self._sp_owners), self.mesh.group("tp"))
        if self._pp_tied and self.parallel_config.pp > 1 and self.pipeline_schedule not in V_SHAPE_SCHEDULES:
            group = self.mesh.group("embedding")
            if group is not None and self._embedding_param_owner is not None:
                weight = self._embedding_param_owner.word_embeddings.weight
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                dist.all_reduce(weight.grad, group=group)


    def _install_global_norm_clipping(self) -> None:
        """Route Lightning's ``gradient_clip_val`` (norm) through the global-norm clip (the one override)."""
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign]
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # bf16-mixed has no loss scaler, so a fused optimizer (ours on CUDA) has nothing to unscale and
            # clipping before its step is correct; Lightning's check refuses it anyway. fp16 keeps the check.
            plugin.clip_gradients = functools.partial(Precision.clip_gradients, plugin)  # type: ignore[method-assign]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to global L2 norm ``clip_val``; returns the norm before clipping.

        The norm counts TP-sharded parameters over the TP group, expert parameters over the ep x etp block, and
        replicated ones once.
        """
        assert self.mesh is not None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        counted = [p for p in params if id(p) not in self._excluded_from_norm]
        pp_groups = [self.mesh.group("pp")] if self.parallel_config.pp > 1 else []
        experts = {id(p) for p in self._expert_params}
        norm = clip_grad_norm_(counted, float(clip_val), self._sharded_params, self.mesh.group("tp"), pp_groups,
                               expert=experts, expert_group=self.mesh.group("ep_etp"))
        excluded = [p for p in params if id(p) in self._excluded_from_norm and p.grad is not None]
        if excluded:  # the tied copy is scaled like its first-stage twin
            with torch.no_grad():
                coef = torch.clamp(float(clip_val) / (norm + 1e-6), max=1.0)
                for p in excluded:
                    p.grad.mul_(coef.to(p.grad.device))
        return norm

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load ``ckpt_path`` after :meth:`setup`: before it the weights are on the meta device (loading into
        them is a silent no-op) and not yet sharded."""
        return True

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Full, layout-independent state (TP shards gathered; collective on every rank)."""
        assert self.lightning_module is not None
        return full_model_state_dict(self.lightning_module, self._pp_group())

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """Full optimizer state (per-parameter state of TP shards gathered; collective on every rank)."""
        if hasattr(optimizer, "_optimizer"):  # LightningOptimizer
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        raw = gathered_state_dict(optimizer) if is_sharded_optimizer(optimizer) else None
        return full_optimizer_state_dict(optimizer, self.lightning_module, self._pp_group(), raw=raw)

    def _pp_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.group("pp") if self.mesh is not None and self.parallel_config.pp > 1 else None

    def load_model_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True) -> None:
        """Load a full checkpoint, keeping this rank's shards."""
        assert self.lightning_module is not None
        state = shard_model_state_dict(self.lightning_module, checkpoint["state_dict"])
        self.lightning_module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        """Load full optimizer states, keeping this rank's shards."""
        assert self.lightning_module is not None
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


def _takes_wgrad_delay(model: nn.Module) -> bool:
    """Whether ``model.set_context_parallel`` accepts the per-layer delay (a second positional parameter, as
    ``GPTModel``'s ``delay_wgrad_for_layer``); the automatic ``delay_wgrad_compute`` skips models that do not."""
    method = getattr(model, "set_context_parallel", None)
    try:
        params = list(inspect.signature(method).parameters.values()) if callable(method) else []
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _expert_parameters(module: nn.Module) -> List[nn.Parameter]:
    """Parameters of the routed experts in ``module`` (marked ``allreduce = False``, Megatron's marker)."""
    from lightning_megatron.moe.experts import GroupedMLPExperts, SequentialMLPExperts

    params: List[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, (GroupedMLPExperts, SequentialMLPExperts)):
            for p in m.parameters():
                p.allreduce = False   # materialisation may have replaced the marked meta parameters
                params.append(p)
    return params


class _MegatronMultiProcessingLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the main process full (gathered) weights instead of rank 0's TP shards."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # Tear the process groups down before the worker exits: left to interpreter shutdown, the gloo threads
        # of the mesh's subgroups abort the worker now and then ("terminate called without an active
        # exception", SIGABRT), which fails the whole run after training succeeded.
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        import tempfile

        strategy = self._strategy
        state_dict = strategy.lightning_module_state_dict() if trainer.state.fn == TrainerFn.FITTING else None
        if strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: "pl.Trainer") -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None and not any(True for _ in module.parameters()):
            if hasattr(module, "configure_model"):
                with torch.device("meta"):
                    module.configure_model()
        if worker_output.weights_path is not None:
            ckpt = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(ckpt, strict=False, assign=True)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)


MegatronStrategy.register_strategies(StrategyRegistry)
