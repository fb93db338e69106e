#!/usr/bin/env bash
# 4 GPUs (nvidia-h200-x4), one device call: NCCL numerics of four layouts against 1 GPU (5 steps of a
# 4-layer / hidden-512 model, bf16-mixed: "bf16 tolerance"), then tokens/s per GPU and MFU of tp=2 x pp=2 on
# the 1.3B benchmark model against 1 GPU in the same call.
#   bash benchmarks/end_to_end/run_x4.sh            # ARMS="check speed" by default
# The 1-GPU reference of each check uses the same global batch and micro-batch grouping as the layout.
LOG_NAME=x4
source "$(dirname "$0")/_common.sh"
B="benchmarks/end_to_end/bench_tp.py"
T="torchrun --nproc_per_node=4 $B"
P="--precision bf16-mixed --watchdog $WD"
for arm in ${ARMS:-check speed}; do
  case $arm in
    check)
      # tp=2 x pp=2 (dp=1): 2 micro-batches of 2 per step
      run python3 $B check --accumulate 2 --mbs 2 $P
      run $T check --tp 2 --pp 2 --sp --accumulate 2 --mbs 2 $P
      # tp=2 x cp=2 with SP (dp=1)
      run python3 $B check --mbs 4 $P
      run $T check --tp 2 --cp 2 --sp --mbs 4 $P
      # dp=2 x tp=2: 2 per data-parallel rank = 4 global
      run $T check --tp 2 --sp --mbs 2 $P
      # MoE with ep=4 (dense dp=4): 1 per rank = 4 global, against 4 on 1 GPU
      run python3 $B check --model moe --mbs 4 $P
      run $T check --model moe --ep 4 --mbs 1 $P ;;
    speed)
      run python3 $B ours --accumulate 8 --watchdog $WD
      run $T ours --tp 2 --pp 2 --sp --accumulate 8 --watchdog $WD ;;
  esac
done
