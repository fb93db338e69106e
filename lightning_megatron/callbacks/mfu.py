"""``MFUMonitor``: step time, token throughput, TFLOP/s per GPU and model FLOPs utilisation, correct under
every parallel layout of :class:`~lightning_megatron.MegatronStrategy` (and plain Lightning strategies).

What it counts, per optimizer step:

- **Global tokens** = micro-batch ``b`` x sequence ``s`` x micro-batches per step (``accumulate_grad_batches``)
  x data-parallel size ``dp``. Each data-parallel replica is counted once: the tensor-, pipeline- and
  context-parallel ranks of one replica work on the same samples. ``dp`` is ``trainer.strategy.mesh.size("dp")``
  when the strategy has a ``mesh`` (``MegatronStrategy``), the ``"data_parallel"`` dimension of Lightning's
  ``ModelParallelStrategy.device_mesh``, else ``trainer.world_size`` (DDP, FSDP). ``b`` and ``s`` are read
  from the ``batch`` passed to ``on_train_batch_end`` (``batch["tokens"]`` ``[b, s]``, a tensor, or the first
  element of a tuple/list), not from ``training_step``, which a pipeline schedule may bypass. Batches are
  assumed to hold full sequences (context parallelism splits them inside the strategy).
- **FLOPs per device** = :func:`num_floating_point_operations` of the global step / ``world_size``: every
  device does its share of the model's work under tp/pp/cp/ep. (This is Megatron's
  ``TFLOP/s/GPU = F / (iter_time * 1e12 * world_size)``.)

Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` computes the windowed rates. It is
built with ``world_size=1`` and fed the *global* sequence and token counts and the *per-device* FLOPs, so its
``device/items_per_sec`` is the global tokens/s and its ``device/flops_per_sec`` the per-device FLOP/s (with
``world_size=N`` it would multiply the per-rank counts by every rank, over-counting tokens by tp*pp*cp).
It is updated only at logging steps, so ``window_size=2`` (the default) gives the rates over the last
``log_every_n_steps`` optimizer steps.

Memory: on CUDA, ``peak_memory_gib`` is the peak memory allocated by tensors on one GPU since training started
(``torch.cuda.max_memory_allocated``; the statistics are reset at ``on_train_start``, so setup does not count),
and ``peak_memory_reserved_gib`` the peak the caching allocator held (``torch.cuda.max_memory_reserved``), each the
largest over the ranks. Nothing is logged for them on other devices. Compare runs with CUDA graphs
(``MegatronStrategy(enable_cuda_graph=True)``) by the reserved figure: tensors a replayed graph writes (its
activations, and the gradients of fp32 parameters) live in the graph's memory pool, which the allocated figure does
not count.

Timing: ``time.perf_counter`` at logging steps only, after ``torch.cuda.synchronize`` when the device is
CUDA (never a synchronisation on the other steps). The interval is reduced with MAX over all ranks (the step
is as slow as its slowest rank), together with the counts and the peak memories, in one all-reduce of six numbers
per logging step, so every logged value is identical on every rank. Validation time inside an interval is left out.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback

from lightning_megatron.callbacks.flops import (core_attention_flops_per_square, num_floating_point_operations,
                                                same_document_pairs)

__all__ = ["MFUMonitor", "device_peak_flops", "PEAK_FLOPS", "peak_memory_gib", "peak_memory_reserved_gib",
           "precision_kind", "fp8_mfu_peak"]

# Dense (no structured sparsity) peak tensor FLOP/s of one GPU, from NVIDIA's datasheets (datasheet values
# "with sparsity" halved). fp16 is the same as bf16. fp32 is the plain (non-tensor-core) rate. The SXM
# bf16 value is 989 TFLOP/s as in Megatron's README MFU table and our PEERS.md baselines.
_H100_SXM = {"fp8": 1978e12, "bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12}
_NVL = {"fp8": 1671e12, "bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}
PEAK_FLOPS: Dict[str, Dict[str, float]] = {
    "H200 SXM": dict(_H100_SXM),
    "H200 NVL": dict(_NVL),
    "H100 SXM": dict(_H100_SXM),
    "H100 NVL": dict(_NVL),
    "H100 PCIe": {"fp8": 1513e12, "bf16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # no fp8 tensor cores
}

#: what ``MFUMonitor(attention_flops=...)`` counts for a packed batch's attention
ATTENTION_FLOPS = ("sequence", "documents")
_PRECISION_ALIASES = {"bf16": "bf16", "fp16": "bf16", "16": "bf16", "half": "bf16", "fp8": "fp8", "float8": "fp8",
                      "tf32": "tf32", "fp32": "fp32", "32": "fp32", "float32": "fp32"}


def _table_entry(device_name: str) -> Optional[str]:
    """The :data:`PEAK_FLOPS` key for a ``torch.cuda.get_device_name()`` string, or None if unknown.

    The real H200 name is just ``"NVIDIA H200"`` (no form factor), which is the SXM part; ``GH200`` has the same
    peaks. H100: ``"NVIDIA H100 80GB HBM3"`` (SXM), ``"NVIDIA H100 PCIe"``, ``"NVIDIA H100 NVL"``.
    """
    name = device_name.lower()
    if "h200" in name:
        return "H200 NVL" if "nvl" in name else "H200 SXM"
    if "h100" in name:
        if "nvl" in name:
            return "H100 NVL"
        if "pcie" in name:
            return "H100 PCIe"
        return "H100 SXM"
    if "a100" in name:
        return "A100"
    return None


def device_peak_flops(device: Union[str, torch.device, None] = None, precision: str = "bf16") -> Optional[float]:
    """Dense peak FLOP/s of one GPU at ``precision`` ("bf16"/"fp16", "fp8", "tf32", "fp32").

    ``device`` is a device name as ``torch.cuda.get_device_name()`` gives it (``"NVIDIA H200"``), a CUDA
    ``torch.device``, or None for the current CUDA device. Returns None for a device or precision that is not
    in :data:`PEAK_FLOPS` (CPUs included).
    """
    if device is None or isinstance(device, torch.device):
        if device is not None and device.type != "cuda":
            return None
        if not torch.cuda.is_available():
            return None
        device = torch.cuda.get_device_name(device)
    key = _PRECISION_ALIASES.get(str(precision).lower())
    if key is None:
        raise ValueError(f"precision={precision!r} is not one of {sorted(_PRECISION_ALIASES)}")
    entry = _table_entry(device)
    if entry is None:
        return None
    return PEAK_FLOPS[entry].get(key)


def precision_kind(plugin: Any) -> str:
    """The peak-table precision of a Lightning precision plugin: "fp8", "bf16", "tf32", "fp32" or "fp64".

    fp8: Transformer Engine's plugin (``precision="transformer-engine"``), or any plugin whose ``precision``
    string or class name mentions fp8/float8 or that has ``fp8=True``. bf16 and fp16 (mixed or true): "bf16".
    fp32 ("32-true"): "tf32" when ``torch.get_float32_matmul_precision()`` lets matmuls use TF32, else "fp32".
    """
    prec = str(getattr(plugin, "precision", "32-true")).lower()
    cls = type(plugin).__name__.lower()
    if (getattr(plugin, "fp8", False) is True or "transformer-engine" in prec or "transformerengine" in cls
            or any(tag in prec or tag in cls for tag in ("fp8", "float8"))):
        return "fp8"
    if prec.startswith(("bf16", "16")):
        return "bf16"
    if prec.startswith("64"):
        return "fp64"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def peak_memory_gib(device: Union[str, torch.device]) -> Optional[float]:
    """Peak memory allocated by tensors on CUDA ``device`` since its statistics were last reset
    (``torch.cuda.max_memory_allocated``), in GiB; None on any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def peak_memory_reserved_gib(device: Union[str, torch.device]) -> Optional[float]:
    """Peak memory the caching allocator held on CUDA ``device`` since its statistics were last reset
    (``torch.cuda.max_memory_reserved``: tensors, the allocator's free blocks and CUDA graph memory pools), in GiB;
    None on any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**30


def fp8_mfu_peak(plugin: Any, device_name: str, precision: Optional[str] = None) -> Optional[float]:
    """The FP8 peak of ``device_name`` when ``plugin`` runs FP8 GEMMs (its ``fp8`` is set, as
    ``MegatronPrecision(fp8="hybrid")``) while ``mfu`` counts against another peak (``precision`` or
    :func:`precision_kind`): MFUMonitor then also logs ``mfu_fp8``. None otherwise or for an unknown device."""
    if not getattr(plugin, "fp8", None) or (precision or precision_kind(plugin)) == "fp8":
        return None
    return device_peak_flops(device_name, "fp8")


def _data_parallel_size(trainer: "pl.Trainer") -> int:
    strategy = trainer.strategy
    mesh = getattr(strategy, "mesh", None)
    if mesh is not None and hasattr(mesh, "size"):
        return int(mesh.size("dp"))
    try:
        device_mesh = getattr(strategy, "device_mesh", None)  # Lightning's ModelParallelStrategy
    except Exception:
        device_mesh = None
    if device_mesh is not None and "data_parallel" in (getattr(device_mesh, "mesh_dim_names", None) or ()):
        return int(device_mesh["data_parallel"].size())
    return int(trainer.world_size)


class MFUMonitor(Callback):
    """Logs ``step_time`` (s per optimizer step), ``tokens_per_sec`` (global), ``tokens_per_sec_per_gpu``,
    ``tflops_per_gpu`` and ``mfu`` (a fraction of the peak, not a percentage), and on CUDA ``peak_memory_gib`` and
    ``peak_memory_reserved_gib`` (the largest per-GPU peaks of allocated and of reserved memory since training
    started; with CUDA graphs compare the reserved one, see the module docstring), every ``log_every_n_steps``
    optimizer steps through ``pl_module.log`` (the same value on every rank). With FP8 GEMMs (``MegatronPrecision(fp8=...)``)
    ``mfu`` stays against the bf16 peak and ``mfu_fp8`` against the FP8 peak is logged too (on GPUs whose FP8 peak
    the table knows).

    Args:
        config: the model shape (:class:`~lightning_megatron.GPTConfig` or an object with its fields); default
            ``pl_module.config``.
        peak_flops: peak FLOP/s of one device, overriding the table (:data:`PEAK_FLOPS`). Required on CPU and
            on GPUs not in the table; without it, everything but ``mfu`` is logged and a warning is given once.
        log_every_n_steps: logging period in optimizer steps; default ``trainer.log_every_n_steps``.
        causal: attention FLOPs convention of :func:`num_floating_point_operations` (True: Megatron's current
            half square; False: the full square of Megatron's README table and ``PEERS.md``).
        attention_flops: which attention a packed batch (``document_ids``, Megatron's ``--reset-attention-mask``)
            is counted for. ``"sequence"`` (default, Megatron's convention): the whole sequence's causal attention,
            as if nothing were masked, so the FLOPs per token do not depend on the data and a document-masked step
            that skips work shows as a faster step at the same FLOPs. ``"documents"``: only each document's own
            causal attention (``sum len_d**2`` instead of ``s**2`` per row, :func:`same_document_pairs`, counted on
            the device without a host sync): the work the masked kernel does. Refused under context parallelism (a
            rank holds only its chunks of each row's document ids). Batches without ``document_ids`` count the
            whole sequence either way.
        precision: "bf16", "fp8", "tf32" or "fp32" to pick the peak; default from the trainer's precision
            plugin (:func:`precision_kind`).
        window_size: number of logging points :class:`Throughput` averages over (2: the last interval).
        prog_bar: also show the values on the progress bar.
        prefix: prepended to every logged key.
    """

    KEYS = ("step_time", "tokens_per_sec", "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu")
    #: logged on CUDA devices only
    MEMORY_KEYS = ("peak_memory_gib", "peak_memory_reserved_gib")

    def __init__(self, config: Any = None, peak_flops: Optional[float] = None,
                 log_every_n_steps: Optional[int] = None, causal: bool = True, precision: Optional[str] = None,
                 window_size: int = 2, prog_bar: bool = False, prefix: str = "",
                 attention_flops: str = "sequence") -> None:
        super().__init__()
        if attention_flops not in ATTENTION_FLOPS:
            raise ValueError(f"attention_flops={attention_flops!r} is not one of {ATTENTION_FLOPS}")
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops={peak_flops} must be positive")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1")
        if window_size < 2:
            raise ValueError(f"window_size={window_size} must be >= 2")
        if precision is not None and str(precision).lower() not in _PRECISION_ALIASES:
            raise ValueError(f"precision={precision!r} is not one of {sorted(_PRECISION_ALIASES)}")
        self.config = config
        self.peak_flops_override = peak_flops
        self.log_every_n_steps = log_every_n_steps
        self.causal = causal
        self.attention_flops = attention_flops
        self.precision = precision
        self.window_size = window_size
        self.prog_bar = prog_bar
        self.prefix = prefix
        #: the values of the last logging step (Python floats), for inspection
        self.last_metrics: Dict[str, float] = {}
        self._reset_run_state()

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        self.peak_flops: Optional[float] = None
        self.peak_flops_fp8: Optional[float] = None
        self._model_config: Any = None
        self._dp = 1
        self._cp = 1
        self._world_size = 1
        self._every = 1
        self._device = torch.device("cpu")
        self._throughput: Optional[Throughput] = None
        self._started = False
        self._t_last = 0.0
        self._paused = 0.0
        self._val_t0: Optional[float] = None
        self._last_global_step = 0
        # since the last logging point, this rank's (dp-local) counts
        self._tokens = 0
        self._sequences = 0
        self._model_flops = 0.0
        #: with attention_flops="documents": sum of (s**2 - sum len_d**2) over the packed rows, on the device
        self._masked_square: Optional[torch.Tensor] = None
        self._steps = 0
        # cumulative, global, identical on all ranks (fed to Throughput)
        self._cum = {"time": 0.0, "steps": 0, "sequences": 0, "tokens": 0}
        self._warned_no_shape = False

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset_run_state()
        config = self.config if self.config is not None else getattr(pl_module, "config", None)
        if config is None:
            raise ValueError("MFUMonitor needs the model shape: give MFUMonitor(config=...) or set pl_module.config")
        self._model_config = config
        self._dp = max(1, _data_parallel_size(trainer))
        mesh = getattr(trainer.strategy, "mesh", None)
        # under context parallelism each rank's batch holds s/cp tokens of every sequence
        self._cp = int(mesh.size("cp")) if mesh is not None and hasattr(mesh, "size") else 1
        if self.attention_flops == "documents" and self._cp > 1:
            raise ValueError(f"MFUMonitor(attention_flops='documents') with cp={self._cp}: a context-parallel rank "
                             "holds only its chunks of each row's document ids; use attention_flops='sequence'")
        self._world_size = int(trainer.world_size)
        self._every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        self._device = trainer.strategy.root_device
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._last_global_step = trainer.global_step
        self.peak_flops = self._resolve_peak(trainer)
        self.peak_flops_fp8 = self._fp8_peak(trainer)
        self._throughput = Throughput(available_flops=None, world_size=1, window_size=self.window_size)

    def _fp8_peak(self, trainer: "pl.Trainer") -> Optional[float]:
        if self.peak_flops_override is not None or self._device.type != "cuda":
            return None
        return fp8_mfu_peak(trainer.precision_plugin, torch.cuda.get_device_name(self._device), self.precision)

    def _resolve_peak(self, trainer: "pl.Trainer") -> Optional[float]:
        if self.peak_flops_override is not None:
            return float(self.peak_flops_override)
        kind = self.precision or precision_kind(trainer.precision_plugin)
        name = torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else str(self._device)
        peak = device_peak_flops(name, kind) if kind in _PRECISION_ALIASES else None
        if peak is None:
            rank_zero_warn(
                f"MFUMonitor: no peak FLOP/s known for device {name!r} at precision {kind!r}; logging "
                f"{', '.join(k for k in self.KEYS if k != 'mfu')} but not mfu. Pass MFUMonitor(peak_flops=...)."
            )
        return peak

    # ------------------------------------------------------------------ timing
    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._started or self._throughput is None:
            return
        self._started = True
        self._t_last = self._now()
        self._throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0)

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._started and not trainer.sanity_checking:
            self._val_t0 = self._now()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._val_t0 is not None:
            self._paused += self._now() - self._val_t0
            self._val_t0 = None

    # ------------------------------------------------------------------ counting
    def batch_shape(self, batch: Any) -> Optional[Tuple[int, int]]:
        """``(micro_batch, seq_length)`` of this rank's batch (the full sequence length: a context-parallel
        rank's ``s/cp`` times cp), or None if it has no token tensor (override for other batch formats)."""
        tokens = batch
        if isinstance(batch, dict):
            tokens = batch.get("tokens", batch.get("input_ids"))
        elif isinstance(batch, (tuple, list)) and batch:
            tokens = batch[0]
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
            return int(tokens.shape[0]), int(tokens.shape[1]) * getattr(self, "_cp", 1)
        return None

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self._started:
            return
        shape = self.batch_shape(batch)
        if shape is not None:
            b, s = shape
            self._tokens += b * s
            self._sequences += b
            self._model_flops += num_floating_point_operations(self._model_config, b, s, self.causal)
            documents = batch.get("document_ids") if isinstance(batch, dict) else None
            if self.attention_flops == "documents" and isinstance(documents, torch.Tensor):
                masked = b * s * s - same_document_pairs(documents).double()
                self._masked_square = masked if self._masked_square is None else self._masked_square + masked
        step = trainer.global_step
        if step == self._last_global_step:  # accumulating: no optimizer step in this batch
            return
        self._steps += step - self._last_global_step
        self._last_global_step = step
        if step % self._every == 0:
            self._log(trainer, pl_module)

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        now = self._now()
        interval = now - self._t_last - self._paused
        # one all-reduce (MAX) of six numbers: the slowest rank's interval, counts any rank has seen, the largest
        # peak memories
        dtype = torch.float32 if self._device.type == "mps" else torch.float64
        memory, reserved = peak_memory_gib(self._device), peak_memory_reserved_gib(self._device)
        packed = torch.tensor([interval, self._tokens, self._sequences, self._model_flops, memory or 0.0,
                               reserved or 0.0], dtype=dtype, device=self._device)
        if self._masked_square is not None:   # attention_flops="documents": the masked attention is not counted
            per_square = core_attention_flops_per_square(self._model_config, self.causal)
            packed[3] -= per_square * self._masked_square.to(self._device, dtype)
            self._masked_square = None
        if self._world_size > 1:
            packed = trainer.strategy.reduce(packed, reduce_op="max")
        interval, tokens, sequences, model_flops, max_memory, max_reserved = packed.tolist()
        if tokens <= 0:
            if not self._warned_no_shape:
                self._warned_no_shape = True
                rank_zero_warn("MFUMonitor: no batch had a [b, s] token tensor (batch['tokens']); nothing logged. "
                               "Override MFUMonitor.batch_shape for this batch format.")
            return
        self._t_last = now
        self._paused = 0.0
        steps = self._steps
        self._tokens, self._sequences, self._model_flops, self._steps = 0, 0, 0.0, 0

        cum = self._cum
        cum["time"] += interval
        cum["steps"] += steps
        cum["sequences"] += int(round(sequences)) * self._dp
        cum["tokens"] += int(round(tokens)) * self._dp
        device_flops = model_flops * self._dp / self._world_size  # this device's share of the global step
        assert self._throughput is not None
        self._throughput.update(time=cum["time"], batches=cum["steps"], samples=cum["sequences"],
                                lengths=cum["tokens"], flops=device_flops)
        rates = self._throughput.compute()
        if "device/items_per_sec" not in rates or "device/flops_per_sec" not in rates:
            return  # window not filled yet (window_size > 2)
        metrics = {
            "step_time": 1.0 / rates["device/batches_per_sec"],
            "tokens_per_sec": rates["device/items_per_sec"],
            "tokens_per_sec_per_gpu": rates["device/items_per_sec"] / self._world_size,
            "tflops_per_gpu": rates["device/flops_per_sec"] / 1e12,
        }
        if self.peak_flops:
            metrics["mfu"] = metrics["tflops_per_gpu"] * 1e12 / self.peak_flops
        if memory is not None:
            metrics["peak_memory_gib"] = max_memory
            metrics["peak_memory_reserved_gib"] = max_reserved
        if self.peak_flops_fp8:
            metrics["mfu_fp8"] = metrics["tflops_per_gpu"] * 1e12 / self.peak_flops_fp8
        self.last_metrics = metrics
        for key, value in metrics.items():
            pl_module.log(self.prefix + key, value, on_step=True, on_epoch=False, prog_bar=self.prog_bar,
                          sync_dist=False, batch_size=1)
