"""The layout planner: enumerate the layouts the library accepts for a model on N GPUs, predict each one's peak
memory per GPU and step time, rank them, and hand the best to ``MegatronStrategy`` (docs/planner.md).

``python -m lightning_megatron.planner --model llama3_70b --gpus 64 --gpu-memory 80 --seq-length 8192
--global-batch-size 512`` prints the ranked table (:mod:`lightning_megatron.planner`)."""
from lightning_megatron.planner.calibration import Hardware, load_hardware
from lightning_megatron.planner.layout import Layout, enumerate_layouts
from lightning_megatron.planner.memory import StateBytes, rank_parameters, state_bytes
from lightning_megatron.planner.model import Prediction, Workload, predict
from lightning_megatron.planner.planner import Plan, PlanRow, format_table, plan

__all__ = ["Hardware", "load_hardware", "Layout", "enumerate_layouts", "StateBytes", "rank_parameters",
           "state_bytes", "Prediction", "Workload", "predict", "Plan", "PlanRow", "format_table", "plan"]
