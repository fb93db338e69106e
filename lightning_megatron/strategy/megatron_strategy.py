"""``MegatronStrategy``: Lightning's hooks, translated into the library's calls.

The strategy is Lightning's face over one :class:`~lightning_megatron.run.ParallelRun` (``strategy.run``: the mesh,
the parallelised model, the gradient finaliser, the optimizers' sharding, checkpoint I/O), which the plain quick-start
loop uses too. ``setup_environment`` starts the process group and builds the :class:`ParallelMesh` (and the run over
it) and RNG streams; ``setup`` calls the run's ``parallelize``, ``prepare_data_parallel`` and ``shard_optimizers``. Training runs every layout through one step path
(:class:`~lightning_megatron.strategy.step_path.StepPath`) that calls the module's own step hooks; under pipeline
parallelism the schedule runs the step's forward and backward and the strategy's ``backward`` only fires Lightning's
hooks (the one place its loop is bypassed). Lightning features a layout cannot run are refused at
``setup_environment`` (:mod:`~lightning_megatron.strategy.lightning_features`). Gradient hooks: :mod:`~lightning_megatron.strategy.gradients`; checkpoint hooks:
:mod:`~lightning_megatron.strategy.checkpoints`; keyword routing: :mod:`~lightning_megatron.strategy.options`.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Generator, List, Literal, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

import lightning.pytorch as pl
from lightning_megatron.checkpoint.atomic_io import AtomicCheckpointIO
from lightning_megatron.contract import ConfiguredModule, ParallelLightningModule
from lightning_megatron.parallel.context_parallel.layout import split_batch
from lightning_megatron.parallel.compile import check_cuda_graph_run
from lightning_megatron.parallel.dry_run import DryRun, init_fake_process_group
from lightning_megatron.parallel.fsdp import FSDPModel
from lightning_megatron.parallel.mesh import ParallelMesh
from lightning_megatron.parallel.layout_rules import min_microbatches
from lightning_megatron.parallel.tensor_parallel.random import TensorParallelRNG, seed_rank_streams
from lightning_megatron.parallelize import ParallelizedModel
from lightning_megatron.precision.plugin import (MegatronPrecision, ParamPrecision, megatron_precision_for,
                                                 param_precision_for)
from lightning_megatron.run import ParallelRun
from lightning_megatron.run.model_setup import check_pipeline_module, parallel_context
from lightning_megatron.strategy.checkpoints import CheckpointHooks
from lightning_megatron.strategy.gradients import GradientHooks
from lightning_megatron.strategy.lightning_features import (adopt_compiled_module, attach_weight_averages,
                                                          check_lightning_features, check_short_pipeline_steps)
from lightning_megatron.strategy.launcher import (MegatronMultiProcessingLauncher, MegatronScriptLauncher,
                                                  end_process_groups, global_seed, guard_processes, kill_launched,
                                                  restart_safe_store)
from lightning_megatron.strategy.options import (LAYOUT_OPTIONS, STRATEGY_KEYWORDS, parallel_config_from_options,
                                                 signature_with_layout_options)
from lightning_megatron.strategy.registry import register_strategy_names
from lightning_megatron.strategy.resilience import (ExitSignalHandler, Preempted, PreemptionCheckpoint,
                                                    check_requeue_signal, install_auto_resume)
from lightning_megatron.strategy.step_path import StepPath
from lightning_megatron.strategy.summary import count_whole_model

log = logging.getLogger(__name__)
__all__ = ["MegatronStrategy", "LAYOUT_OPTIONS"]


class MegatronStrategy(CheckpointHooks, GradientHooks, DDPStrategy):
    """Tensor (+sequence), pipeline (incl. virtual stages), context, expert and data parallelism for Lightning.

    Args:
        tp, pp, vp, cp, ep, etp, sequence_parallel: the layout (dp is ``world / (tp * pp * cp)``; ep is carved out of
            the dp x cp x tp ranks).
        options: any other field of :class:`ParallelConfig` (``cp_comm_type``, ``pipeline_schedule``,
            ``use_distributed_optimizer``, ...: Megatron's names, validated there). Arguments of torch
            ``DistributedDataParallel`` and Lightning's DDP hook options raise ValueError naming what replaces them
            (the parameters' contiguous buffer reduces the gradients, not DDP); any other keyword raises TypeError
            naming the closest valid one.
        checkpoint_io: default :class:`~lightning_megatron.checkpoint.AtomicCheckpointIO` (a local checkpoint is
            complete or absent, never truncated); used by ``ckpt_format="torch"``.
        ckpt_format, async_save: ``"torch"`` (default) saves one file of full tensors; ``"torch_dist"`` a directory
            where each rank writes its own shards (:mod:`lightning_megatron.checkpoint.distributed`), in the
            background with ``async_save=True``. Both load under any layout; loading detects the format.
        timeout, distributed_timeout_minutes: the timeout of every process group (the world's and each of the
            mesh's); give one of them (``distributed_timeout_minutes``: Megatron's name, in minutes).
        start_method: ``"popen"`` (default: re-runs the script per process; also works under torchrun and
            SLURM) or ``"spawn"`` / ``"fork"`` (tests, notebooks; the main process gets the full weights back).
        max_restarts: with ``"spawn"`` / ``"fork"`` and ``auto_resume=True``: when a rank fails (an error, a kill)
            every rank is started again, up to this many times, each restart resuming from the newest complete
            checkpoint (torchrun's ``--max-restarts`` for the strategy's own launcher; under ``"popen"`` a
            ValueError: use torchrun or a SLURM requeue).
        dry_run: a :class:`~lightning_megatron.parallel.dry_run.DryRun`: this one process (``Trainer(devices=1)``)
            plays rank ``dry_run.rank`` of a job of ``dry_run.world_size`` over torch's fake communication backend
            (collectives return at once, memory and compute are that rank's; the non-finite checks are off, losses
            meaningless). ``docs/planner.md`` ("Dry runs").

    ``strategy.run`` (:class:`~lightning_megatron.run.ParallelRun`) and ``strategy.mesh`` exist after
    ``setup_environment``, ``strategy.parallelized`` after ``setup``. Data is sharded by data-parallel rank (CP ranks
    then keep their part, :meth:`batch_to_device`). A :class:`~lightning_megatron.contract.ParallelLightningModule` (as
    :class:`ParallelGPTModule`) trains through the one step path under every layout (``train_loss``: the step's
    global token-mean); other LightningModules through Lightning's own loop (pp == 1).
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
        *,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        max_restarts: int = 0,
        dry_run: Optional[DryRun] = None,
        **options: Any,
    ) -> None:
        if dry_run is not None and not isinstance(dry_run, DryRun):
            raise ValueError(f"dry_run={dry_run!r}: give a lightning_megatron.DryRun(world_size=..., rank=...)")
        if dry_run is not None:   # a fake collective's result is unfilled memory: a non-finite check means nothing
            options.setdefault("check_for_nan_in_loss_and_grad", False)
        self.parallel_config, timeout = parallel_config_from_options(
            options, timeout, default_pg_timeout, STRATEGY_KEYWORDS, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, etp=etp,
            sequence_parallel=sequence_parallel)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                         **options)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts!r} must be an int >= 0")
        if max_restarts and start_method == "popen":
            raise ValueError(f"max_restarts={max_restarts} with start_method='popen': the script's own process is "
                             "rank 0 and cannot start itself again; use torchrun --max-restarts (or a SLURM "
                             "requeue), or start_method='spawn'")
        if max_restarts and not self.parallel_config.auto_resume:
            raise ValueError(f"max_restarts={max_restarts} without auto_resume=True: a restart would train from "
                             "the start again; set auto_resume=True (and a ModelCheckpoint that saves)")
        #: spawn / fork: how often the launcher starts every rank again after one failed (:class:`MegatronMultiProcessingLauncher`)
        self.max_restarts = max_restarts
        #: the Lightning-free run (mesh, parallelised model, finaliser, sharded optimizers, checkpoint I/O), built at
        #: ``setup_environment``
        self.run: Optional[ParallelRun] = None
        self.tp_rng: Optional[TensorParallelRNG] = None
        self.seed: int = global_seed()
        self._steps: Optional[StepPath] = None
        self._context: Optional[Any] = None   # the ParallelContext the module was told (with the step path)
        self.skipped_steps: int = 0   # steps dropped by check_for_nan_in_loss_and_grad="skip" (logged as such)
        self._skips_unlogged = False   # a skip counted outside an optimizer step, logged at the next one
        self.dry_run: Optional[DryRun] = dry_run
        if dry_run is not None and self.parallel_config.check_for_nan_in_loss_and_grad:
            raise ValueError("check_for_nan_in_loss_and_grad=True with dry_run: the fake collectives leave their "
                             "results unfilled, so losses and gradients of a dry run are meaningless; drop it")
        self.rerun_steps: int = 0   # non-finite steps replayed finite by check_for_nan_in_loss_and_grad="rerun"
        self._exit_signals: Optional[ExitSignalHandler] = None   # exit_signal_handler=True: during fit

    @property
    def mesh(self) -> Optional[ParallelMesh]:
        """The process grid (the run's), after ``setup_environment``."""
        return self.run.mesh if self.run is not None else None

    @property
    def parallelized(self) -> Optional[ParallelizedModel]:
        """What :func:`~lightning_megatron.parallelize.parallelize` did to the module (the run's record), after
        ``setup``."""
        return self.run.parallelized if self.run is not None else None

    @property
    def fsdp(self) -> Optional[FSDPModel]:
        """The FSDP2 units (``optim_grads`` / ``optim_grads_params``, the run's), after fit's ``setup``."""
        return self.run.fsdp if self.run is not None else None

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin (Lightning's ``Precision()``, fp32, when none was given)."""
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning's precision strings mean what :class:`MegatronPrecision` of the same name means:
        ``Trainer(precision="16-mixed" | "bf16-mixed")`` (Lightning's ``MixedPrecision``) becomes
        ``MegatronPrecision("16-mixed" | "bf16-mixed")``; ``"bf16-true"`` / ``"16-true"`` are refused with the
        ``MegatronPrecision`` to use (:func:`~lightning_megatron.precision.plugin.megatron_precision_for`)."""
        self._precision_plugin = megatron_precision_for(plugin)

    @property
    def pipeline_schedule(self) -> str:
        """The pipeline schedule's name (``parallel_config.pipeline_schedule``)."""
        return self.parallel_config.pipeline_schedule

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether the a2a CP layers delay their weight gradients (resolved against the model after setup)."""
        return self.parallelized.delay_wgrad if self.parallelized is not None else self.parallel_config.delays_wgrad

    def _configure_launcher(self) -> None:
        if self.dry_run is not None and self.num_processes * self.num_nodes != 1:
            raise ValueError(f"dry_run={self.dry_run!r} plays one rank in one process, but the Trainer asks for "
                             f"{self.num_processes} device(s) x {self.num_nodes} node(s): use Trainer(devices=1, "
                             "num_nodes=1)")
        super()._configure_launcher()   # popen (Lightning's); spawn / fork hand the weights back to the main process
        if isinstance(self._launcher, _SubprocessScriptLauncher):   # popen, the requeue exit code let through
            self._launcher = MegatronScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        if self._start_method != "popen":
            self._launcher = MegatronMultiProcessingLauncher(self, start_method=self._start_method,
                                                             max_restarts=self.max_restarts)

    def setup_environment(self) -> None:
        """Refuse the Lightning features this layout cannot run (every rank at once, before any collective), start
        the process group, build the mesh, check the model's shape, seed the RNG streams."""
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            check_lightning_features(module.trainer, module, self.parallel_config,
                                     self._param_precision().params_dtype)
            self._add_long_run_hooks(module.trainer)
        guard_processes(self._launcher, self.cluster_environment, self.num_processes * self.num_nodes)
        super().setup_environment()
        mesh = ParallelMesh(self.parallel_config, device_type=self.root_device.type, timeout=self._timeout)
        if self.run is None:
            self.run = ParallelRun(mesh, self.root_device, self.parallel_config)
        else:   # a later fit / validate of this strategy: its record, FSDP units and gathers stay
            self.run.rebind(mesh)
        if self.parallel_config.enable_cuda_graph:   # before the model exists: nothing to undo
            check_cuda_graph_run(self.lightning_module, self.root_device, self._param_precision().params_dtype)
        self.run.start_sharded_io(self._timeout)
        if isinstance(self.lightning_module, ConfiguredModule):
            self.parallel_config.validate_model(self.lightning_module.config)
        self.seed = global_seed()
        self.tp_rng = seed_rank_streams(self.seed, mesh.rank("tp"), mesh.rank("pp"), self.root_device)
        log.info("lightning-megatron mesh: %r", mesh)

    def _add_long_run_hooks(self, trainer: "pl.Trainer") -> None:
        """``auto_resume``: the newest complete checkpoint when ``fit`` got no ``ckpt_path``;
        ``exit_signal_handler``: the end-of-step save on an exit signal
        (:mod:`~lightning_megatron.strategy.resilience`)."""
        cfg = self.parallel_config
        if cfg.check_for_nan_in_loss_and_grad == "rerun" and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"check_for_nan_in_loss_and_grad='rerun' with Trainer(accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): a replay reruns only the last micro-batch (the earlier ones' "
                "gradients are already summed); use accumulate_grad_batches=1 (pipeline parallelism runs its "
                "micro-batches inside the step) or 'skip'")
        if cfg.auto_resume:
            install_auto_resume(trainer, self)
        if cfg.exit_signal_handler and trainer.state.fn == TrainerFn.FITTING:
            if not trainer.checkpoint_callbacks:
                raise ValueError("exit_signal_handler=True saves into the ModelCheckpoint directory: add "
                                 "ModelCheckpoint(dirpath=...) to the Trainer's callbacks (or enable_checkpointing)")
            check_requeue_signal(trainer, cfg.exit_signals)
            saver = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
            if saver is None:
                saver = PreemptionCheckpoint(ExitSignalHandler(cfg.exit_signals))
                trainer.callbacks.append(saver)
            saver.handler.received = None
            self._exit_signals = saver.handler

    def setup_distributed(self) -> None:
        """Lightning's process-group start, except in two cases. In a dry run it starts the fake group of
        ``dry_run.world_size`` ranks (Lightning itself sees one process: it logs and prints as rank 0). Under
        torchrun with its shared rendezvous store the group starts on a store prefixed by the restart attempt, so
        that a job restarted in place (``--max-restarts``) never reads the dead attempt's keys
        (:func:`~lightning_megatron.strategy.launcher.restart_safe_store`). Every backend's groups are destroyed at
        the process's exit (:func:`~lightning_megatron.strategy.launcher.end_process_groups`; Lightning does so for
        NCCL only)."""
        if self.dry_run is not None:
            reset_seed()
            self.set_world_ranks()
            init_fake_process_group(self.dry_run, self._timeout)
            self._process_group_backend = "fake"
            return
        env = self.cluster_environment
        store = None
        if not torch.distributed.is_initialized() and env is not None:
            store = restart_safe_store(env.main_address, env.main_port, self._timeout or default_pg_timeout)
        atexit.unregister(end_process_groups)   # once however many fits
        atexit.register(end_process_groups)
        if store is None:
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        device_id = self.root_device if self.root_device.type != "cpu" else None
        log.info("Initializing distributed: GLOBAL_RANK: %d, MEMBER: %d/%d (restart attempt's store)",
                 self.global_rank, self.global_rank + 1, self.world_size)
        torch.distributed.init_process_group(self._process_group_backend, store=store, rank=self.global_rank,
                                             world_size=self.world_size, timeout=self._timeout, device_id=device_id)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; in a dry run the object itself (Lightning sees one process; a fake broadcast of
        a pickled object would unpickle unfilled memory on a rank other than ``src``)."""
        return obj if self.dry_run is not None else super().broadcast(obj, src)

    def on_exception(self, exception: BaseException) -> None:
        """A failed rank (an error, a timed-out collective) takes the ranks it launched with it; after an
        exit-signal checkpoint (:class:`Preempted`, every rank stops alike) they are waited for instead."""
        super().on_exception(exception)
        if self._exit_signals is not None:
            self._exit_signals.uninstall()
        kill_launched(self._launcher, wait=isinstance(exception, Preempted))

    def connect(self, model: "pl.LightningModule") -> None:
        """Lightning's ``connect``; a module passed through ``torch.compile`` is trained with its transformer layers
        compiled instead of its whole steps (:func:`~lightning_megatron.strategy.lightning_features.
        adopt_compiled_module`)."""
        adopt_compiled_module(model, self.parallel_config)
        super().connect(model)

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

    def setup(self, trainer: "pl.Trainer") -> None:
        """Parallelise and materialise the model (its parameters in the contiguous buffer, which reduces the gradients
        over dp x cp, or FSDP2 units at the FSDP levels) when fitting, set up optimizers."""
        assert self.accelerator is not None and self.model is not None and self.run is not None
        self.accelerator.setup(trainer)
        self.parallelize(self.lightning_module)   # the precision plugin converts the module there
        self.model_to_device()
        self._install_global_norm_clipping()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:   # FSDP2 units once (the finaliser then works on the shards), or the replicas made equal
            self.run.prepare_data_parallel(self.lightning_module, self.precision_plugin.precision)
            self.setup_optimizers(trainer)
            self.optimizers = self.run.shard_optimizers(self.optimizers, self.model, self.lr_scheduler_configs)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            attach_weight_averages(trainer, self.lightning_module, self.wait_for_parameters)
        count_whole_model(trainer, self._pp_group())   # the model summary: the whole model, not this rank's part

    def wait_for_parameters(self) -> None:
        """With ``overlap_param_gather``: wait for the distributed optimizer's parameter broadcasts still in flight
        (this rank's weights are then the current ones). Forward waits per module by itself; call this before reading
        weights elsewhere between steps (e.g. in a callback)."""
        if self.run is not None:
            self.run.wait_for_parameters()

    def parallelize(self, module: "pl.LightningModule") -> ParallelizedModel:
        """:func:`~lightning_megatron.parallelize.parallelize` ``module`` over the mesh, and tell it the layout."""
        assert self.run is not None
        cfg, mesh = self.parallel_config, self.run.mesh
        check_pipeline_module(module, cfg)
        plugin = self.precision_plugin
        # the precision's one step: the FP8 conversion, whose handle registers its end-of-step hook and is the
        # plugin's checkpoint state (precision/fp8/apply.py)
        fp8 = plugin.parallelize_step(self.root_device, mesh) if isinstance(plugin, MegatronPrecision) else None
        params = self._param_precision()
        # convert_module before the buffer takes the parameters' storage (64-true: .double())
        parallelized = self.run.parallelize(module, seed=self.seed, tp_rng=self.tp_rng,
                                            forward_context=plugin.forward_context, fp8=fp8,
                                            convert=plugin.convert_module, params_dtype=params.params_dtype,
                                            store_param_remainders=params.store_param_remainders,
                                            check_grads=not self._loss_scaled())
        stages = parallelized.pipeline
        pipeline = stages.runner(mesh.group("pp"), mesh.ranks("pp"), self.root_device) if stages else None
        self._steps = StepPath(self, pipeline) if isinstance(module, ParallelLightningModule) else None
        if isinstance(module, ParallelLightningModule):   # its step hooks reach the step path through the context
            self._context = dataclasses.replace(parallel_context(mesh, cfg), step=self._steps)
            module.set_parallel_context(self._context)
        return parallelized

    def _param_precision(self) -> ParamPrecision:
        """How ``MainParams`` stores the parameters (:meth:`MegatronPrecision.param_precision`, read in this one
        place): Megatron's bf16 parameters (``params_dtype``) and remainders, or, under an FSDP sharding level, where
        FSDP2 holds them (fp32 sharded main parameters, bf16 compute copies gathered per unit by its mixed-precision
        policy, :func:`~lightning_megatron.parallel.fsdp.mixed_precision_policy`), the parameters' own dtype."""
        return param_precision_for(self.precision_plugin, self.parallel_config)

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then under cp > 1 keep this rank's load-balanced part of every sequence
        (:func:`~lightning_megatron.parallel.context_parallel.split_batch`: ``tokens``, ``labels``, ``loss_mask``,
        ``position_ids``, ``document_ids`` ``[b, s]`` -> ``[b, s / cp]``). Data modules stay unchanged; hooks after this see the split."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.parallel_config.cp == 1 or not isinstance(batch, dict) or "tokens" not in batch:
            return batch
        assert self.mesh is not None
        return split_batch(batch, self.parallel_config.cp, self.mesh.rank("cp"))

    def on_train_start(self) -> None:
        """Under pp > 1, refuse (on every rank, before the first batch) steps the schedule cannot run."""
        super().on_train_start()
        if self._exit_signals is not None:   # after Lightning registered its own handlers: these replace them
            self._exit_signals.install()
        pipeline = self._steps.pipeline if self._steps is not None else None
        if pipeline is not None:
            check_short_pipeline_steps(self.lightning_module.trainer, pipeline.schedule_name, pipeline.pp,
                                       min_microbatches, pipeline.runs_short_steps)

    def on_train_end(self) -> None:
        self.wait_for_parameters()
        self.finish_checkpoints()
        if self._exit_signals is not None:
            self._exit_signals.uninstall()
        super().on_train_end()   # GradientHooks: the last step's non-finite verdict, when decided on the device

    def teardown(self) -> None:
        """After each ``fit`` / ``validate`` / ``test`` / ``predict``: the module's step hooks stop reaching this
        strategy's step path (a later run sets it up again; under another strategy they compute the loss
        themselves); the layout it was told stays (``generate`` uses its pipeline group)."""
        module, context = self.lightning_module, self._context
        if module is not None and context is not None and isinstance(module, ParallelLightningModule):
            module.set_parallel_context(dataclasses.replace(context, step=None))
        self._context = None
        super().teardown()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``training_step``: under pp = 1 through Lightning's (DDP's forward, then Lightning's
        backward); under pp > 1 collected, and at the step's last micro-batch run after the schedule for each
        micro-batch of the step (:meth:`StepPath.pipeline_training_step`)."""
        steps = self._steps
        if steps is None:
            return super().training_step(*args, **kwargs)
        if steps.pipeline is not None:
            return steps.pipeline_training_step(args, kwargs)
        steps.begin_microbatch()
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward; under pp > 1 the schedule ran it, and this fires ``on_before_backward`` /
        ``on_after_backward`` (:meth:`StepPath.pipeline_backward`)."""
        if self._steps is not None and self._steps.pipeline is not None:
            return self._steps.pipeline_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulated micro-batches skip the data-parallel reduction: DDP's ``no_sync`` or, with FSDP2,
        its units' (their backward accumulates unsharded gradients)."""
        if self.fsdp is not None:
            with self.fsdp.no_sync():
                yield
            return
        with super().block_backward_sync():
            yield

    def _eval_context(self, context: Any) -> Any:
        """The precision plugin's context around an evaluation hook (pp = 1); pipeline stages enter it themselves."""
        return contextlib.nullcontext() if self._steps.pipeline is not None else context()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``validation_step`` (the library's adds the batch to the epoch's ``val_loss``)."""
        if self._steps is None:
            return super().validation_step(*args, **kwargs)
        with self._eval_context(self.precision_plugin.val_step_context):
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``test_step`` (the library's adds the batch to the epoch's ``test_loss``)."""
        if self._steps is None:
            return super().test_step(*args, **kwargs)
        with self._eval_context(self.precision_plugin.test_step_context):
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``predict_step`` (the library's: per-token loss ``[b, s]`` with labels, else logits
        ``[b, s, V_pad/tp]``, on every rank)."""
        if self._steps is None:
            return super().predict_step(*args, **kwargs)
        with self._eval_context(self.precision_plugin.predict_step_context):
            return self.lightning_module.predict_step(*args, **kwargs)

    @classmethod
    def from_plan(cls, plan: Any, **options: Any) -> "MegatronStrategy":
        """The strategy of a planner result (:mod:`lightning_megatron.planner`): ``plan`` is a ``Plan`` (its best
        layout) or a ``Layout``; ``options`` are further ``MegatronStrategy`` keywords and override the layout's.
        The layout's micro-batch size and micro-batches per step belong to the data module and to
        ``Trainer(accumulate_grad_batches=...)``: read them from ``plan.best``."""
        from lightning_megatron.planner import Plan

        layout = plan.best if isinstance(plan, Plan) else plan
        return cls(**{**layout.strategy_kwargs(), **options})

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"megatron"`` (popen launch) and ``"megatron_spawn"`` (spawn launch)."""
        register_strategy_names(cls, strategy_registry)


MegatronStrategy.register_strategies(StrategyRegistry)
MegatronStrategy.__init__.__signature__ = (   # type: ignore[attr-defined]
    signature_with_layout_options(MegatronStrategy.__init__))
