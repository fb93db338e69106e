#!/usr/bin/env bash
# 8 GPUs (nvidia-h200-x8), one device call: NCCL numerics of a 5D dense layout and of ep=4 x tp=2 (SP)
# on a MoE model against 1 GPU (5 bf16 steps), then the LLaMA-3-8B preset at seq 8192 with tp=1, cp=2, dp=4
# (Megatron's reference layout): tokens/s per GPU and MFU. FP8 is not implemented yet, so only bf16 runs.
#   bash benchmarks/end_to_end/run_x8.sh            # ARMS="check speed" by default
# Without the distributed optimizer every GPU holds the 8B model's fp32 weights, gradients and Adam states
# (~128 GB, more than fits with activations); with it (dp x cp = 8) the Adam states shrink to 1/8 (~72 GB in all).
LOG_NAME=x8
source "$(dirname "$0")/_common.sh"
B="benchmarks/end_to_end/bench_tp.py"
T="torchrun --nproc_per_node=8 $B"
P="--precision bf16-mixed --watchdog $WD"
for arm in ${ARMS:-check speed}; do
  case $arm in
    check)
      # tp=2 x pp=2 x cp=2 (dp=1): 2 micro-batches of 2 per step
      run python3 $B check --accumulate 2 --mbs 2 $P
      run $T check --tp 2 --pp 2 --cp 2 --sp --accumulate 2 --mbs 2 $P
      # MoE ep=4 x tp=2 with SP (dense dp=4, etp=2): 1 per rank = 4 global
      run python3 $B check --model moe --mbs 4 $P
      run $T check --model moe --ep 4 --tp 2 --sp --mbs 1 $P ;;
    speed)
      run $T ours --model llama3_8b --cp 2 --seq 8192 --mbs 1 --use-distributed-optimizer --watchdog $WD ;;
  esac
done
