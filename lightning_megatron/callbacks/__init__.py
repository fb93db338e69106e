"""Training callbacks: throughput and model FLOPs utilisation (``MFUMonitor``) with Megatron's FLOPs count; the
loss curve as CSV and PNG or SVG (``LossCurve``); the weights of a checkpoint without training state at the start
(``CheckpointWeights``); the ranks that set everyone's pace (``StragglerMonitor``)."""
from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS = {
    "CheckpointWeights": "lightning_megatron.callbacks.checkpoint_weights",
    "flops_per_token": "lightning_megatron.callbacks.flops",
    "num_floating_point_operations": "lightning_megatron.callbacks.flops",
    "LossCurve": "lightning_megatron.callbacks.loss_curve",
    "plot_loss_curve": "lightning_megatron.callbacks.loss_curve",
    "PEAK_FLOPS": "lightning_megatron.callbacks.mfu",
    "MFUMonitor": "lightning_megatron.callbacks.mfu",
    "device_peak_flops": "lightning_megatron.callbacks.mfu",
    "peak_memory_gib": "lightning_megatron.callbacks.mfu",
    "peak_memory_reserved_gib": "lightning_megatron.callbacks.mfu",
    "precision_kind": "lightning_megatron.callbacks.mfu",
    "SampleContinuation": "lightning_megatron.callbacks.sample",
    "StragglerMonitor": "lightning_megatron.callbacks.straggler",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
