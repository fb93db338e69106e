"""The parallel layout and its options (Megatron's flags, :class:`ParallelConfig`), in sections by concern
(:data:`SECTIONS`), and their validation: checks by concern, one clear error per broken rule."""
from __future__ import annotations

import signal
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple, Union

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
#: the comm types whose attention exchanges all-to-all and can run delayed weight-gradient GEMMs meanwhile
A2A_COMM_TYPES = ("a2a", "a2a+p2p")
#: per-block kernels of the ring (p2p, and the attention inside a2a / a2a+p2p) on CUDA half types: ``auto`` (cuDNN,
#: the faster; flash where cuDNN refuses), ``cudnn``, ``flash``, or ``math`` (explicit softmax in float32, the path
#: CPU and float32 inputs always take)
CP_ATTENTION_KERNELS = ("auto", "cudnn", "flash", "math")
#: Megatron's ``--data-parallel-sharding-strategy`` levels: what is sharded over dp x cp (experts: over edp)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
#: the levels built on torch FSDP2 (:mod:`lightning_megatron.parallel.fsdp`)
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")
#: checkpoint formats (Megatron's ``--ckpt-format``): one file of full tensors, or a directory of shards (DCP)
CKPT_FORMATS = ("torch", "torch_dist")


_UNHANDLEABLE = ("SIGKILL", "SIGSTOP")


def check_exit_signals(value: Any) -> Tuple[str, ...]:
    """``exit_signals`` as a tuple of signal names; ValueError naming an unknown or uncatchable one."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"exit_signals={value!r} must be a non-empty sequence of signal names, e.g. "
                         "('SIGTERM', 'SIGUSR1')")
    for name in names:
        if name not in signal.Signals.__members__ or name in _UNHANDLEABLE:
            raise ValueError(f"exit_signals: {name!r} is not a signal a process can handle; use names such as "
                             "'SIGTERM', 'SIGUSR1', 'SIGUSR2'")
    return tuple(dict.fromkeys(names))


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (``tp=True`` is a mistake, not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_cp_kernel_options(attention_kernel: Any, compile_merge: Any, sm_carveout: Any, prefix: str = "cp_") -> None:
    """Validate the context-parallel kernel options (names in errors: ``prefix`` + ``attention_kernel``, ...).

    Raises:
        ValueError: ``attention_kernel`` not in :data:`CP_ATTENTION_KERNELS`; ``compile_merge`` not a bool;
            ``sm_carveout`` neither None nor an integer >= 0.
    """
    if attention_kernel not in CP_ATTENTION_KERNELS:
        raise ValueError(
            f"{prefix}attention_kernel={attention_kernel!r} is not one of {CP_ATTENTION_KERNELS}: 'auto' uses cuDNN "
            "(flash where cuDNN refuses) for CUDA fp16/bf16 blocks, 'cudnn' / 'flash' force one fused kernel, "
            "'math' the explicit-softmax path"
        )
    if not isinstance(compile_merge, bool):
        raise ValueError(
            f"{prefix}compile_merge={compile_merge!r} must be True (compile the ring's output merge into one CUDA "
            "kernel) or False (eager ops)"
        )
    if sm_carveout is not None and (isinstance(sm_carveout, bool) or not isinstance(sm_carveout, int)
                                    or sm_carveout < 0):
        raise ValueError(
            f"{prefix}sm_carveout={sm_carveout!r} must be None (the default: 16 SMs on CUDA), 0 (no carveout) or a "
            "positive integer number of SMs the delayed weight-gradient GEMMs leave to the a2a exchanges"
        )


#: the sections of :class:`ParallelConfig`'s fields by concern, in the order they are declared and documented
SECTIONS: Dict[str, Tuple[str, ...]] = {
    "layout": ("tp", "pp", "vp", "cp", "ep", "etp", "sequence_parallel"),
    "pipeline": ("pipeline_schedule", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"),
    "context_parallel": ("cp_comm_type", "hierarchical_context_parallel_sizes", "cp_attention_kernel",
                         "cp_compile_merge", "cp_sm_carveout", "delay_wgrad_compute"),
    "data_parallel": ("use_distributed_optimizer", "data_parallel_sharding_strategy", "grad_reduce_in_bf16",
                      "overlap_grad_reduce", "bucket_size", "overlap_param_gather"),
    "tensor_parallel_comm": ("tp_comm_overlap",),
    "recompute": ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"),
    "compile": ("compile", "enable_cuda_graph"),
    "checkpoint": ("ckpt_format", "async_save"),
    "resilience": ("check_for_nan_in_loss_and_grad", "distributed_timeout_minutes", "auto_resume",
                   "exit_signal_handler", "exit_signals"),
}


@dataclass
class ParallelConfig:
    """The parallel layout and its options, with Megatron's names and meaning.

    Dense grid: ``world = pp * dp * cp * tp`` (dp is derived). Expert grid (Megatron's "MoE parallel
    folding"): ``world = pp * edp * ep * etp``, so ``ep`` is carved out of the dp x cp x tp ranks.

    The fields come in sections by concern (:data:`SECTIONS`), declared and documented in that order, and are
    validated by checks by concern (in the order of what each reads from another: the sharding level before the
    delayed weight gradients, say); they stay one flat record because they are Megatron's flags, the keywords
    ``MegatronStrategy`` takes and ``strategy.parallel_config.<flag>`` reads back.

    Layout (the grid's sizes):
        tp: tensor-model-parallel size (``--tensor-model-parallel-size``).
        pp: pipeline-model-parallel size.
        vp: virtual pipeline stages per rank (interleaved schedule); needs ``pp > 1``.
        cp: context-parallel size.
        ep: expert-model-parallel size: each expert-parallel rank holds ``num_moe_experts / ep`` experts.
        etp: expert-tensor-parallel size (default: ``tp``): ranks splitting each expert's ffn dimension.
            Expert grid: ``edp = world / (etp * ep * pp)`` expert-data-parallel replicas.
        sequence_parallel: split activations along the sequence over the TP group between TP regions.
            Ignored with a warning when ``tp == 1`` (as Megatron's training arguments do).

    Pipeline parallelism:
        pipeline_schedule: one of ``SCHEDULE_NAMES`` in :mod:`lightning_megatron.parallel.pipeline` (default
            ``"1f1b"``, ``"interleaved_1f1b"`` with ``vp``).
        num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage: uneven pipeline splits.

    Context parallelism:
        cp_comm_type: context-parallel attention communication, one string or one per layer.
        hierarchical_context_parallel_sizes: inner/outer sizes for ``cp_comm_type="a2a+p2p"``.
        cp_attention_kernel: kernel of the context-parallel attention blocks on CUDA fp16/bf16, one of
            :data:`CP_ATTENTION_KERNELS` (default ``"auto"``: cuDNN, flash where cuDNN refuses). CPU and float32
            blocks always take the math path; ``cp_comm_type="all_gather"`` uses SDPA's own choice.
        cp_compile_merge: compile the ring's log-sum-exp output merge into one kernel on CUDA (default True;
            False keeps it eager, e.g. where no compiler works; a failed compile warns and falls back anyway).
        cp_sm_carveout: SMs that the delayed weight-gradient GEMMs (``delay_wgrad_compute``) leave free while an
            a2a exchange is in flight. None (default): 16 on CUDA, none elsewhere; 0: no carveout.
        delay_wgrad_compute: ``--delay-wgrad-compute`` for the a2a context-parallel layers; None = wherever it
            applies (cp > 1, an a2a comm type, tp = 1), resolved against the model by ``parallelize``.

    Data parallelism and the gradients:
        use_distributed_optimizer: optimizer states sharded over dp x cp (``--use-distributed-optimizer``); with
            ep > 1 the routed experts' states over edp. The same as ``data_parallel_sharding_strategy="optim"``.
        data_parallel_sharding_strategy: Megatron's sharding level over dp x cp (routed experts: over edp), one of
            :data:`SHARDING_STRATEGIES`: ``"no_shard"`` (DDP), ``"optim"`` (the distributed optimizer),
            ``"optim_grads"`` (FSDP2, parameters kept gathered between forward and backward: ZeRO-2) or
            ``"optim_grads_params"`` (FSDP2, parameters gathered per layer and freed after use: ZeRO-3). None
            (default): ``"optim"`` with ``use_distributed_optimizer``, else ``"no_shard"``.
        grad_reduce_in_bf16: reduce data-parallel gradients in bfloat16 (``--grad-reduce-in-bf16``).
        overlap_grad_reduce: each bucket of the parameter-and-gradient buffer starts its data-parallel reduction
            as soon as the step's last gradient of its parameters has arrived, during backward
            (``--overlap-grad-reduce``; :class:`~lightning_megatron.parallel.param_buffer.buffer.MainParams`). None
            (default): on for pp = 1, one reduction after the schedule for pp > 1; True / False force it. (A loop
            that builds no buffer, ``parallelize`` without ``param_buffer=True``, gets torch DDP's buckets for pp = 1 and
            :mod:`lightning_megatron.parallel.grad_buckets` for pp > 1.)
        bucket_size: elements per bucket of the parameter-and-gradient buffer (``--ddp-bucket-size``); None: 40M
            elements (:data:`~lightning_megatron.parallel.param_buffer.buffer.DEFAULT_BUCKET_ELEMENTS`).
        overlap_param_gather: with the distributed optimizer, each bucket's all-gather of the stepped parameters is
            launched after the optimizer step without waiting, and each module waits for its own buckets in the next
            forward (``--overlap-param-gather``; :mod:`lightning_megatron.parallel.param_buffer.optimizer`).

    Tensor-parallel communication:
        tp_comm_overlap: under sequence parallelism, the all-gather before column-parallel GEMMs and the
            reduce-scatter after row-parallel GEMMs run as a ring of chunked GEMMs and point-to-point exchanges,
            forward and backward (``--tp-comm-overlap``;
            :mod:`lightning_megatron.parallel.tensor_parallel.comm_overlap`).

    Activation recompute:
        recompute_granularity: activation recompute (:mod:`lightning_megatron.parallel.recompute`): None (off),
            ``"selective"`` (the parts named in ``recompute_modules``) or ``"full"`` (whole layers).
        recompute_method: with ``"full"``: ``"uniform"`` (every layer, in groups of ``recompute_num_layers``
            checkpointed as one unit) or ``"block"`` (the first ``recompute_num_layers`` layers of each pipeline
            stage / virtual chunk).
        recompute_num_layers: with ``"full"``: layers per group (uniform) or per stage (block).
        recompute_modules: with ``"selective"``: Megatron's names, any of ``"core_attn"`` (the default),
            ``"mlp"``, ``"layernorm"``, ``"moe"``, ``"moe_act"``, ``"shared_experts"``.

    Compilation:
        compile: ``torch.compile`` each transformer layer (the ``apply_compile`` step of ``parallelize``; models
            implementing the GPT layout), compiled lazily at its first call.
        enable_cuda_graph: replay each compiled transformer layer's forward and backward as CUDA graphs
            (Inductor's CUDA graph trees, ``mode="reduce-overhead"``; Megatron's ``--enable-cuda-graph``): one launch
            per layer and direction instead of one per kernel, for steps whose host time exceeds the GPU's. Needs
            ``compile=True``, a CUDA device and pp = 1 (one micro-batch in flight); not with FSDP levels or activation
            recompute; with gradient accumulation only with bf16 parameters (``params_dtype=torch.bfloat16``,
            whose gradients leave the graphs' memory at once). docs/performance.md, "Fewer launches".

    Checkpoints:
        ckpt_format: ``"torch"`` (default: one file of full tp=1 tensors, gathered to rank 0) or ``"torch_dist"``
            (a directory written by ``torch.distributed.checkpoint``, each rank its own shards;
            ``--ckpt-format``; :mod:`lightning_megatron.checkpoint.distributed`).
        async_save: with ``"torch_dist"``, write checkpoints in the background (``--async-save``).

    Resilience:
        check_for_nan_in_loss_and_grad: stop with an error naming the step and parameter at a NaN/inf loss or
            gradient norm, and refuse to checkpoint non-finite weights (``--check-for-nan-in-loss-and-grad``,
            default on; :mod:`lightning_megatron.parallel.nonfinite`); ``"skip"``: drop such a step on every rank
            instead (counted and logged) and go on; ``"rerun"``: replay such a step once from the same inputs (a
            fault that does not repeat is logged and training goes on; one that repeats stops as with True).
        distributed_timeout_minutes: timeout of every process group, the world's and each of the mesh's
            (``--distributed-timeout-minutes``); None: the strategy's ``timeout`` (Lightning's, 30 minutes).
        auto_resume: a ``fit`` given no ``ckpt_path`` resumes from the newest complete checkpoint (file or sharded
            directory) in the ``ModelCheckpoint`` directories, if there is one
            (:mod:`lightning_megatron.strategy.resilience`; docs/reliability.md, "Long runs").
        exit_signal_handler: on any of ``exit_signals`` at any rank, every rank finishes the step in flight, writes
            ``last-preempted.ckpt`` into the ``ModelCheckpoint`` directory and exits with
            :data:`~lightning_megatron.strategy.resilience.REQUEUE_EXIT_CODE` (``--exit-signal-handler``).
        exit_signals: the signal names ``exit_signal_handler`` saves and exits on (default ``("SIGTERM",)``; add
            e.g. ``"SIGUSR1"`` for SLURM's early ``--signal``).
    """

    # layout
    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    sequence_parallel: bool = False
    # pipeline parallelism
    pipeline_schedule: Optional[str] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # context parallelism
    cp_comm_type: Union[str, Sequence[str]] = "p2p"
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None
    cp_attention_kernel: str = "auto"
    cp_compile_merge: bool = True
    cp_sm_carveout: Optional[int] = None
    delay_wgrad_compute: Optional[bool] = None
    # data parallelism and the gradients
    use_distributed_optimizer: bool = False
    data_parallel_sharding_strategy: Optional[str] = None
    grad_reduce_in_bf16: bool = False
    overlap_grad_reduce: Optional[bool] = None
    bucket_size: Optional[int] = None
    overlap_param_gather: bool = False
    # tensor-parallel communication
    tp_comm_overlap: bool = False
    # activation recompute
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[Sequence[str]] = None
    # compilation
    compile: bool = False
    enable_cuda_graph: bool = False
    # checkpoints
    ckpt_format: str = "torch"
    async_save: bool = False
    # resilience
    check_for_nan_in_loss_and_grad: Union[bool, str] = True
    distributed_timeout_minutes: Optional[float] = None
    auto_resume: bool = False
    exit_signal_handler: bool = False
    exit_signals: Sequence[str] = ("SIGTERM",)
    # derived by resolve(world_size)
    dp: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        for name in ("sequence_parallel", "grad_reduce_in_bf16", "use_distributed_optimizer", "compile",
                     "enable_cuda_graph", "overlap_param_gather", "tp_comm_overlap", "auto_resume",
                     "exit_signal_handler"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False (a string such as 'no' "
                                 "would count as True)")
        if self.delay_wgrad_compute is not None and not isinstance(self.delay_wgrad_compute, bool):
            raise ValueError(f"delay_wgrad_compute={self.delay_wgrad_compute!r} must be None (where it applies), "
                             "True or False")
        # checks by concern; a later one may read what an earlier one resolved (the sharding level, the schedule)
        self._check_layout()
        self._check_context_parallel_comm()
        self._check_pipeline()
        self._check_sharding()
        self._check_overlaps()
        self._check_context_parallel_kernels()
        self._check_resilience()
        self._check_checkpoint_options()
        self._check_recompute()
        self._check_cuda_graph()
        self._resolved = False

    def _check_layout(self) -> None:
        """The sizes: positive integers, ``vp`` only with a pipeline, ``sequence_parallel`` only with tp > 1 (else
        turned off with a warning, as Megatron's training arguments do)."""
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.etp is None:
            self.etp = self.tp
        if not _is_int(self.etp) or self.etp < 1:
            raise ValueError(f"etp must be a positive integer, got {self.etp!r}")
        if self.vp is not None:
            if not _is_int(self.vp) or self.vp < 1:
                raise ValueError(f"vp must be a positive integer or None, got {self.vp!r}")
            if self.vp > 1 and self.pp == 1:
                raise ValueError(
                    f"vp={self.vp} (virtual pipeline stages) needs pp > 1, got pp={self.pp}: "
                    "the interleaved schedule splits each rank's layers into vp chunks of a pipeline; "
                    "set pp >= 2 or drop vp"
                )
        if self.sequence_parallel and self.tp == 1:
            warnings.warn(
                "sequence_parallel=True has no effect with tp=1 (it splits the sequence over the tensor "
                "parallel group); disabling it",
                UserWarning,
                stacklevel=4,
            )
            self.sequence_parallel = False

    def _check_context_parallel_comm(self) -> None:
        """``cp_comm_type`` (one name or one per layer) and the a2a+p2p split's sizes."""
        types = self.cp_comm_types
        for t in types:
            if t not in CP_COMM_TYPES:
                raise ValueError(f"cp_comm_type {t!r} is not one of {CP_COMM_TYPES}")
        if self.hierarchical_context_parallel_sizes is not None:
            sizes = list(self.hierarchical_context_parallel_sizes)
            product = 1
            for size in sizes:
                product *= size
            if product != self.cp:
                raise ValueError(
                    f"hierarchical_context_parallel_sizes={sizes} multiply to {product}, not cp={self.cp}: "
                    "the inner (a2a) and outer (p2p) sizes must multiply to the context-parallel size"
                )
        elif "a2a+p2p" in types and self.cp > 1:
            raise ValueError("cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes, e.g. [2, cp // 2]")

    def _check_pipeline(self) -> None:
        """The schedule (default by ``vp``) against pp and vp, the uneven stages' sizes; pipeline options with pp = 1
        warn that they do nothing."""
        from lightning_megatron.parallel.layout_rules import check_schedule, default_schedule

        given = self.pipeline_schedule
        if self.pipeline_schedule is None:
            self.pipeline_schedule = default_schedule(self.vp)
        if self.pp > 1:
            check_schedule(self.pipeline_schedule, self.pp, self.vp)
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.pp == 1:
            from lightning_megatron.parallel.layout_rules import SCHEDULE_NAMES

            if given is not None and given not in SCHEDULE_NAMES:
                raise ValueError(f"pipeline_schedule={given!r} is not one of {SCHEDULE_NAMES}")
            unused = [f"{name}={getattr(self, name)!r}" for name in (
                "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
                if getattr(self, name) is not None] + ([f"pipeline_schedule={given!r}"] if given is not None else [])
            if unused:
                warnings.warn(f"{', '.join(unused)} has no effect with pp=1 (no pipeline); set pp > 1 or drop it",
                              UserWarning, stacklevel=4)

    def _check_sharding(self) -> None:
        """Resolve ``data_parallel_sharding_strategy`` against ``use_distributed_optimizer`` (its alias for
        ``"optim"``) and refuse the combinations FSDP does not run."""
        level = self.data_parallel_sharding_strategy
        if level is None:
            level = "optim" if self.use_distributed_optimizer else "no_shard"
        if level not in SHARDING_STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy={level!r} is not one of {SHARDING_STRATEGIES}")
        if level == "no_shard" and self.use_distributed_optimizer:
            raise ValueError(
                "data_parallel_sharding_strategy='no_shard' contradicts use_distributed_optimizer=True (which shards "
                "the optimizer states, the level 'optim'): drop one of them, or pick 'optim', 'optim_grads' or "
                "'optim_grads_params'")
        self.data_parallel_sharding_strategy = level
        if level == "optim":
            self.use_distributed_optimizer = True
        if level not in FSDP_STRATEGIES:
            return
        if self.vp is not None and self.vp > 1:
            raise ValueError(
                f"data_parallel_sharding_strategy={level!r} with vp={self.vp}: FSDP shards one pipeline stage per rank "
                "(virtual stages would share FSDP units between schedule chunks); use vp=None or the levels "
                "'no_shard' / 'optim'")
        if self.delay_wgrad_compute:
            raise ValueError(
                f"data_parallel_sharding_strategy={level!r} with delay_wgrad_compute=True: FSDP reduces each layer's "
                "weight gradients when its backward ends, before delayed weight-gradient GEMMs would have run; set "
                "delay_wgrad_compute=False (or None) or use 'no_shard' / 'optim'")
        self.delay_wgrad_compute = False

    @property
    def fsdp(self) -> bool:
        """Whether the sharding level shards gradients (and parameters) with FSDP2."""
        return self.data_parallel_sharding_strategy in FSDP_STRATEGIES

    def _check_overlaps(self) -> None:
        """Validate ``overlap_grad_reduce``, ``bucket_size``, ``overlap_param_gather`` and ``tp_comm_overlap``."""
        if self.overlap_grad_reduce is not None and not isinstance(self.overlap_grad_reduce, bool):
            raise ValueError(f"overlap_grad_reduce={self.overlap_grad_reduce!r} must be None (each path's default), "
                             "True or False")
        if self.bucket_size is not None and (not _is_int(self.bucket_size) or self.bucket_size < 1):
            raise ValueError(f"bucket_size={self.bucket_size!r} must be None or a positive number of elements per "
                             "gradient bucket")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True overlaps the distributed optimizer's parameter broadcast "
                             "with the next forward: it needs use_distributed_optimizer=True (Megatron's rule)")
        if self.tp_comm_overlap and not (self.tp > 1 and self.sequence_parallel):
            raise ValueError(
                f"tp_comm_overlap=True overlaps the sequence-parallel all-gather / reduce-scatter with the GEMMs: it "
                f"needs tp > 1 and sequence_parallel=True, got tp={self.tp}, sequence_parallel="
                f"{self.sequence_parallel}")

    def _check_context_parallel_kernels(self) -> None:
        """``delay_wgrad_compute`` against the layout (after the sharding level, which turns it off under FSDP) and
        the attention kernel options."""
        if self.delay_wgrad_compute and not self.delay_wgrad_applies:
            raise ValueError(
                "delay_wgrad_compute=True runs the weight-gradient GEMMs during the a2a context-parallel "
                f"exchanges: it needs cp > 1 with cp_comm_type 'a2a' or 'a2a+p2p' and tp=1; got cp={self.cp}, "
                f"cp_comm_type={self.cp_comm_type!r}, tp={self.tp}")
        check_cp_kernel_options(self.cp_attention_kernel, self.cp_compile_merge, self.cp_sm_carveout)

    def _check_resilience(self) -> None:
        """The non-finite check's mode, the process groups' timeout and the exit signals."""
        if not isinstance(self.check_for_nan_in_loss_and_grad, bool) \
                and self.check_for_nan_in_loss_and_grad not in ("skip", "rerun"):
            raise ValueError(f"check_for_nan_in_loss_and_grad={self.check_for_nan_in_loss_and_grad!r} must be True "
                             "(stop at a NaN/inf loss or gradient norm), 'skip' (drop that step and go on), 'rerun' "
                             "(replay that step once; stop if it repeats) or False")
        t = self.distributed_timeout_minutes
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"distributed_timeout_minutes={t!r} must be None or a number of minutes > 0")
        self.exit_signals = check_exit_signals(self.exit_signals)

    def _check_checkpoint_options(self) -> None:
        """``ckpt_format`` and ``async_save``."""
        if self.ckpt_format not in CKPT_FORMATS:
            raise ValueError(f"ckpt_format={self.ckpt_format!r} is not one of {CKPT_FORMATS}: 'torch' writes one "
                             "file of full tensors, 'torch_dist' a directory of each rank's shards")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save={self.async_save!r} must be True or False")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError("async_save=True needs ckpt_format='torch_dist' (sharded checkpoints are written in "
                             f"the background; the single-file format is not), got ckpt_format={self.ckpt_format!r}")

    def _check_recompute(self) -> None:
        """Megatron's recompute rules (:func:`~lightning_megatron.parallel.layout_rules.check_recompute_options`);
        ``recompute_modules`` resolved."""
        from lightning_megatron.parallel.layout_rules import check_recompute_options

        self.recompute_modules = check_recompute_options(self.recompute_granularity, self.recompute_method,
                                                         self.recompute_num_layers, self.recompute_modules)

    def _check_cuda_graph(self) -> None:
        """Refuse ``enable_cuda_graph`` where a layer's graph would replay over memory still in use."""
        if not self.enable_cuda_graph:
            return
        why = None
        if not self.compile:
            why = "it replays the compiled transformer layers (Inductor's CUDA graphs): set compile=True"
        elif self.pp > 1:
            why = (f"pp={self.pp}: a pipeline schedule keeps several micro-batches' activations in flight, a layer's "
                   "CUDA graph holds one; use pp=1")
        elif self.fsdp:
            why = (f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r}: FSDP gathers and frees "
                   "parameters around each layer, outside its graph; use 'no_shard' or 'optim'")
        elif self.recompute_granularity is not None:
            why = (f"recompute_granularity={self.recompute_granularity!r}: a recomputed forward would replay the "
                   "layer's graph inside its own backward; drop activation recompute")
        if why:
            raise ValueError(f"enable_cuda_graph=True: {why}, or enable_cuda_graph=False")

    @property
    def cp_comm_types(self) -> list:
        """The context-parallel comm type of each layer kind given (one entry, or one per layer)."""
        return [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else list(self.cp_comm_type)

    def cp_comm_type_of(self, layer: int) -> str:
        """The context-parallel comm type of global layer ``layer``."""
        types = self.cp_comm_type
        return types if isinstance(types, str) else types[layer]

    @property
    def delay_wgrad_applies(self) -> bool:
        """Whether the layout can delay weight gradients into CP exchanges (cp > 1, an a2a comm type, tp = 1)."""
        return self.cp > 1 and self.tp == 1 and any(t in A2A_COMM_TYPES for t in self.cp_comm_types)

    @property
    def delays_wgrad(self) -> bool:
        """``delay_wgrad_compute`` with None resolved by the layout (:attr:`delay_wgrad_applies`); the model can still
        turn it off (``ParallelizedModel.delay_wgrad`` after parallelisation)."""
        return self.delay_wgrad_applies if self.delay_wgrad_compute is None else bool(self.delay_wgrad_compute)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Check the sizes against ``world_size`` and derive ``dp``; returns ``self``.

        Raises:
            ValueError: world size not divisible by ``tp*pp*cp`` or by ``etp*ep*pp``.
        """
        if world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} "
                f"= {self.model_parallel_size}: choose sizes whose product divides the number of processes "
                f"(devices x nodes)"
            )
        expert_mp = self.etp * self.ep * self.pp
        if world_size % expert_mp != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by etp*ep*pp = {self.etp}*{self.ep}*{self.pp} "
                f"= {expert_mp}: the expert grid (pp, edp, ep, etp) must tile the world"
            )
        self.dp = world_size // self.model_parallel_size
        self._resolved = True
        return self

    @property
    def edp(self) -> int:
        """Expert-data-parallel size ``world / (etp*ep*pp)`` (after :meth:`resolve`)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def world_size(self) -> int:
        """``pp * dp * cp * tp`` (after :meth:`resolve`)."""
        if not self._resolved:
            raise RuntimeError("ParallelConfig.resolve(world_size) must be called before reading dp/edp/world_size")
        return self.pp * self.dp * self.cp * self.tp

    def validate_model(self, model_config: Any) -> None:
        """Check model shapes against the layout (attention heads / query groups divisible by tp).

        ``model_config`` is any object with Megatron's field names (``num_attention_heads``,
        ``num_query_groups``, ``num_layers``); missing fields are skipped.
        """
        heads = getattr(model_config, "num_attention_heads", None)
        if heads is not None and heads % self.tp != 0:
            raise ValueError(
                f"num_attention_heads={heads} is not divisible by tp={self.tp}: each tensor-parallel rank "
                f"holds whole heads; pick tp dividing {heads}"
            )
        groups = getattr(model_config, "num_query_groups", None) or heads
        if groups is not None and groups % self.tp != 0:
            raise ValueError(
                f"num_query_groups={groups} is not divisible by tp={self.tp}: each tensor-parallel rank "
                f"holds whole key/value groups; pick tp dividing {groups}"
            )
        layers = getattr(model_config, "num_layers", None)
        if not isinstance(self.cp_comm_type, str) and layers is not None and len(self.cp_comm_type) != layers:
            raise ValueError(
                f"cp_comm_type has {len(self.cp_comm_type)} entries but the model has num_layers={layers}: "
                "give one string, or one per layer"
            )
        if self.pp > 1 and layers is not None:
            from lightning_megatron.parallel.layout_rules import layers_per_stage

            layers_per_stage(layers, self.pp * (self.vp or 1), self.num_layers_in_first_pipeline_stage,
                             self.num_layers_in_last_pipeline_stage)
        seq = getattr(model_config, "seq_length", None)
        if self.cp > 1 and seq is not None:
            chunks = 2 * self.cp * (self.tp if self.sequence_parallel else 1)
            if seq % chunks != 0:
                rule = "2*cp*tp (load-balanced CP chunks, each split over tp by SP)" if self.sequence_parallel else "2*cp (load-balanced CP chunks)"
                raise ValueError(f"seq_length={seq} is not divisible by {rule} = {chunks}")
        if self.sequence_parallel and seq is not None and seq % self.tp != 0:
            raise ValueError(
                f"seq_length={seq} is not divisible by tp={self.tp}: sequence parallelism splits the "
                f"sequence over the tensor-parallel ranks"
            )
        self.validate_moe(model_config)
        from lightning_megatron.parallel.layout_rules import check_recompute_model

        check_recompute_model(self, model_config)

    def validate_moe(self, model_config: Any) -> None:
        """Check the expert layout against the model (``num_moe_experts``, ``moe_ffn_hidden_size``, ...).

        Raises:
            ValueError: ep > 1 or etp > tp-default on a dense model; experts not divisible by ep; the ffn of an
                expert not divisible by etp; MoE with tp > 1 but no sequence parallelism (Megatron's rule).
        """
        experts = getattr(model_config, "num_moe_experts", None)
        if experts is None:
            if self.ep > 1:
                raise ValueError(
                    f"ep={self.ep} (expert parallelism) needs a mixture-of-experts model: set "
                    f"num_moe_experts in the model config, or use ep=1"
                )
            return
        if experts % self.ep != 0:
            raise ValueError(
                f"num_moe_experts={experts} is not divisible by ep={self.ep}: each expert-parallel rank holds "
                f"num_moe_experts / ep whole experts; pick ep dividing {experts}"
            )
        ffn = getattr(model_config, "moe_ffn_hidden_size", None)
        if ffn is not None and ffn % self.etp != 0:
            raise ValueError(
                f"moe_ffn_hidden_size={ffn} is not divisible by etp={self.etp}: expert tensor parallelism "
                f"splits each expert's ffn dimension; pick etp dividing {ffn} (etp defaults to tp)"
            )
        if self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"a mixture-of-experts model with tp={self.tp} needs sequence_parallel=True (Megatron's rule: "
                f"with MoE and tensor parallelism each TP rank routes its own part of the sequence); set "
                f"MegatronStrategy(sequence_parallel=True) or tp=1"
            )

