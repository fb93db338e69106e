"""Training callbacks: throughput and model FLOPs utilisation (``MFUMonitor``) with Megatron's FLOPs count; the
loss curve as CSV / PNG (``LossCurve``)."""
from lightning_megatron.callbacks.flops import flops_per_token, num_floating_point_operations
from lightning_megatron.callbacks.loss_curve import LossCurve, plot_loss_curve
from lightning_megatron.callbacks.mfu import PEAK_FLOPS, MFUMonitor, device_peak_flops, peak_memory_gib, precision_kind
from lightning_megatron.callbacks.sample import SampleContinuation

__all__ = [
    "LossCurve",
    "MFUMonitor",
    "num_floating_point_operations",
    "flops_per_token",
    "device_peak_flops",
    "precision_kind",
    "peak_memory_gib",
    "PEAK_FLOPS",
    "SampleContinuation",
    "plot_loss_curve",
]
