#!/usr/bin/env bash
# One device call on nvidia-h200-x2: send/recv bandwidth under NCCL settings (probe_nccl_p2p.py, one torchrun
# per setting: NCCL reads them at communicator creation), then 1 GPU, cp=2 a2a and cp=2 a2a under the setting
# with the best 32 MiB send/recv (only if it beats the default by 10%). JSON lines; also $OUT/nccl_sweep.log.
LOG_NAME=nccl_sweep
source "$(dirname "$0")/_common.sh"
SETTINGS=${SETTINGS:-"NONE=0 NCCL_MIN_P2P_NCHANNELS=16 NCCL_MIN_P2P_NCHANNELS=32 NCCL_NCHANNELS_PER_NET_PEER=16 NCCL_P2P_NVL_CHUNKSIZE=2097152 NCCL_MIN_NCHANNELS=32 NCCL_P2P_USE_CUDA_MEMCPY=1"}
best="NONE=0"; best_gbs=0; base_gbs=0
for s in $SETTINGS; do
  echo "### $s" | tee -a "$LOG"
  line=$(env "$s" timeout -k 5 40 torchrun --nproc_per_node=2 benchmarks/probe_nccl_p2p.py 2>&1 | grep '"sendrecv"' | tee -a "$LOG" | grep '"mib": 32')
  echo "$line"
  gbs=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['recv_gb_s'] if sys.argv[1] else 0)" "$line")
  [ "$s" = "NONE=0" ] && base_gbs=$gbs
  if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)" "$gbs" "$best_gbs"; then best=$s; best_gbs=$gbs; fi
done
echo "best $best $best_gbs GB/s (default $base_gbs)" | tee -a "$LOG"
if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) > 1.1 * float(sys.argv[2]) else 1)" "$best_gbs" "$base_gbs"; then
  C="ours --seq 16384 --mbs 1 --watchdog $WD"
  run python3 benchmarks/bench_tp.py $C
  run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
  echo "### with $best" | tee -a "$LOG"
  run env "$best" torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
fi
