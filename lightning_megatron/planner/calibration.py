"""Hardware profiles and calibrated GPU constants, read from ``calibration.json`` beside this module (data, not
code: each value names its source, a datasheet or a row of ``benchmarks/RESULTS.md`` / the peer baselines)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Hardware", "load_hardware", "CALIBRATION_FILE", "HARDWARE_NAMES"]

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
HARDWARE_NAMES = ("h100", "h200")


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and the model's constants for it (units: GiB, TFLOP/s, TB/s, GB/s, ms).

    Datasheet: ``memory_gib``, ``bf16_tflops``, ``hbm_tbps``, ``gpus_per_node``, ``nvlink_gbps`` (one way),
    ``inter_node_gbps`` (InfiniBand per GPU). Measured on H200: ``gemm_efficiency``, the attention efficiency
    curve, ``optimizer_bytes_per_param``, ``nccl_busbw`` ((bytes, GB/s) pairs), ``fp8_gemm_speedup``. Fitted:
    ``elementwise_passes``, ``step_overhead_ms``, ``tp_bandwidth_gbps``, ``dp_overlap``, ``cp_passes``,
    ``moe_rows_half``. ``reserved_gib``: memory outside torch's allocator (CUDA context, NCCL buffers) and
    ``fragmentation``: the allocator's slack, both added to the predicted peak before comparing with the GPU.
    """

    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_tbps: float
    gpus_per_node: int
    nvlink_gbps: float
    inter_node_gbps: float
    gemm_efficiency: float
    attention_efficiency_max: float
    attention_half_seq: float
    optimizer_bytes_per_param: float
    nccl_busbw: Tuple[Tuple[float, float], ...]
    nccl_small: float
    fp8_gemm_speedup: float
    elementwise_passes: float
    step_overhead_ms: float
    tp_bandwidth_gbps: float
    dp_overlap: float
    cp_passes: float
    moe_rows_half: float
    reserved_gib: float = 2.0
    fragmentation: float = 0.05

    def attention_efficiency(self, seq: float) -> float:
        """Fraction of the bf16 peak the fused attention reaches on blocks of ``seq`` queries."""
        return self.attention_efficiency_max * seq / (seq + self.attention_half_seq)

    def moe_efficiency(self, rows: float) -> float:
        """Speed of the routed experts' grouped GEMMs (with their permutation) relative to the dense GEMMs, for
        ``rows`` tokens per local expert: ``rows / (rows + moe_rows_half)``."""
        return rows / (rows + self.moe_rows_half)

    def fits(self, peak_gib: float) -> bool:
        """Whether an allocator peak of ``peak_gib`` fits on this GPU with the reserve and slack."""
        return peak_gib * (1.0 + self.fragmentation) + self.reserved_gib <= self.memory_gib


def _read(path: Optional[Path] = None) -> Dict[str, Any]:
    return json.loads((path or CALIBRATION_FILE).read_text())


def load_hardware(name: str = "h200", memory_gib: Optional[float] = None, path: Optional[Path] = None) -> Hardware:
    """The profile ``name`` (``"h100"`` or ``"h200"``) with the measured and fitted constants;
    ``memory_gib`` overrides the GPU memory (e.g. the CLI's ``--gpu-memory``)."""
    data = _read(path)
    if name not in data["hardware"]:
        raise ValueError(f"hardware={name!r} is not one of {tuple(data['hardware'])} (profiles in {CALIBRATION_FILE})")
    hw, measured, fitted = data["hardware"][name], data["measured"], data["fitted"]
    table: List[Tuple[float, float]] = [(float(a), float(b)) for a, b in measured["nccl_busbw_gbps"]]
    return Hardware(
        name=hw["name"], memory_gib=float(memory_gib if memory_gib is not None else hw["memory_gib"]),
        bf16_tflops=hw["bf16_tflops"], hbm_tbps=hw["hbm_tbps"], gpus_per_node=int(hw["gpus_per_node"]),
        nvlink_gbps=hw["nvlink_gbps"], inter_node_gbps=hw["inter_node_gbps"],
        gemm_efficiency=measured["gemm_efficiency"], attention_efficiency_max=measured["attention_efficiency_max"],
        attention_half_seq=measured["attention_half_seq"],
        optimizer_bytes_per_param=measured["optimizer_bytes_per_param"], nccl_busbw=tuple(table),
        nccl_small=measured["nccl_busbw_small_gbps"], fp8_gemm_speedup=measured["fp8_gemm_speedup"],
        elementwise_passes=fitted["elementwise_passes"], step_overhead_ms=fitted["step_overhead_ms"],
        tp_bandwidth_gbps=fitted["tp_bandwidth_gbps"], dp_overlap=fitted["dp_overlap"],
        cp_passes=fitted["cp_passes"], moe_rows_half=fitted["moe_rows_half"],
    )
