#!/usr/bin/env bash
# One device call on nvidia-h200-x2: NCCL numerics check (tp=2 vs tp=1) and throughput of every arm on the
# 1.3B benchmark model. Output lines are JSON; everything is also written to $OUT/tp_bench.log.
LOG_NAME=tp_bench
source "$(dirname "$0")/_common.sh"
ARMS=${ARMS:-"check ours peers"}
for arm in $ARMS; do
  case $arm in
    check)
      run python3 benchmarks/bench_tp.py check
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --tp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --tp 2 --sp ;;
    ours)
      run python3 benchmarks/bench_tp.py ours
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --tp 2 --sp
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --tp 2 --sp --recompute-gather
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --tp 2 ;;
    tp2)
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --tp 2 --sp
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --tp 2
      run python3 benchmarks/peer_x2.py tp2 ;;
    pp)
      run python3 benchmarks/bench_tp.py ours --accumulate 8
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --pp 2 --accumulate 8 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --pp 2 --vp 2 --accumulate 8 --watchdog $WD ;;
    ppcheck)  # NCCL numerics: 5 fp32 steps, 2 micro-batches per step, pp=2 (1f1b, interleaved) vs 1 GPU
      run python3 benchmarks/bench_tp.py check --accumulate 2 --mbs 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --pp 2 --accumulate 2 --mbs 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --pp 2 --vp 2 --accumulate 2 --mbs 2 --watchdog $WD ;;
    cpcheck)  # fused-vs-math kernels, cp=2 attention vs full SDPA, and 5 bf16 model steps cp=2 vs 1 GPU
      run torchrun --nproc_per_node=2 benchmarks/check_cp.py
      run python3 benchmarks/bench_tp.py check --precision bf16-mixed --seq 4096 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --cp 2 --precision bf16-mixed --seq 4096 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --cp 2 --cp-comm-type a2a --precision bf16-mixed --seq 4096 --watchdog $WD ;;
    cp)  # 1.3B model, seq 16384, micro-batch 1: cp=2 (p2p, a2a) vs 1 GPU (with CHECK=1: attention numerics first)
      [ "${CHECK:-0}" = 1 ] && run torchrun --nproc_per_node=2 benchmarks/check_cp.py
      run python3 benchmarks/bench_tp.py ours --seq 16384 --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --cp 2 --seq 16384 --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --cp 2 --cp-comm-type a2a --seq 16384 --mbs 1 --watchdog $WD ;;
    pretrain)  # issue 6: pretrain_gpt.py on preprocessed data with MFUMonitor vs an independent timer
      run python3 benchmarks/check_pretrain_mfu.py ;;
    moe)  # Mixtral-shaped (8 experts, top-2, hidden 2048, 8 layers): NCCL numerics ep=2 vs 1 GPU, then tokens/s
      run python3 benchmarks/bench_tp.py check --model moe --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --model moe --ep 2 --mbs 2 --watchdog $WD
      run python3 benchmarks/bench_tp.py ours --model moe --watchdog $WD
      run python3 benchmarks/bench_tp.py ours --model moe --moe-loop --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --model moe --ep 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --model moe --ep 2 --dispatcher allgather --watchdog $WD ;;
    cpkernels)  # attention kernels alone, the fused-kernel checks, then cp=2 with the cuDNN block kernel vs 1 GPU
      run python3 benchmarks/bench_attention.py
      run torchrun --nproc_per_node=2 benchmarks/check_cp.py
      run python3 benchmarks/bench_tp.py ours --seq 16384 --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --cp 2 --cp-attention-kernel cudnn --seq 16384 --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --cp 2 --cp-comm-type a2a --cp-attention-kernel cudnn --seq 16384 --mbs 1 --watchdog $WD ;;
    cpprofile)  # one profiled optimizer step of cp=2 p2p at seq 16384 (top device ops of rank 0)
      timeout -k 10 ${ARM_TIMEOUT:-330} torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --cp 2 --seq 16384 --mbs 1 --profile --watchdog $WD 2>&1 | grep -vE "Warning|warn|^ *$" | tail -45 | tee -a "$LOG" ;;
    cpdiff)  # kernel probe (native GQA, strided inputs), then profiles of cp=1 / cp=2 p2p / cp=2 a2a written to
             # $OUT/profile-*.json (top ops, busy time), then 4 micro-batches per step (fixed costs amortised)
      run python3 benchmarks/probe_cp_kernels.py
      P="ours --seq 16384 --mbs 1 --watchdog $WD --profile"
      run python3 benchmarks/bench_tp.py $P --profile-json ${OUT:-/tmp}/profile-cp1.json
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $P --cp 2 --profile-json ${OUT:-/tmp}/profile-cp2-p2p.json
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $P --cp 2 --cp-comm-type a2a --profile-json ${OUT:-/tmp}/profile-cp2-a2a.json
      run python3 benchmarks/bench_tp.py ours --seq 16384 --mbs 1 --accumulate 4 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --cp 2 --seq 16384 --mbs 1 --accumulate 4 --watchdog $WD ;;
    cpprof3)  # attention numerics (fused kernels, NCCL), then cp=1, and cp=2 p2p / a2a with profiles in $OUT
      run torchrun --nproc_per_node=2 benchmarks/check_cp.py
      P="ours --seq 16384 --mbs 1 --watchdog $WD --profile"
      run python3 benchmarks/bench_tp.py ours --seq 16384 --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $P --cp 2 --profile-json ${OUT:-/tmp}/profile-cp2-p2p.json
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $P --cp 2 --cp-comm-type a2a --profile-json ${OUT:-/tmp}/profile-cp2-a2a.json ;;
    cpbf16)  # NCCL transfer probe, then cp=1 / cp=2 (p2p, a2a) with fp32 and with bf16 gradient reduction
      run torchrun --nproc_per_node=2 benchmarks/probe_nccl_p2p.py
      C="ours --seq 16384 --mbs 1 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $C
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --grad-reduce-in-bf16
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a --grad-reduce-in-bf16 ;;
    cpfinal)  # attention + model numerics (NCCL, bf16), then cp=1 vs cp=2 p2p / a2a (profiles of the cp=2 runs in $OUT)
      run torchrun --nproc_per_node=2 benchmarks/check_cp.py
      run python3 benchmarks/bench_tp.py check --precision bf16-mixed --seq 4096 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --cp 2 --precision bf16-mixed --seq 4096 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --cp 2 --cp-comm-type a2a --precision bf16-mixed --seq 4096 --watchdog $WD
      P="ours --seq 16384 --mbs 1 --watchdog $WD --profile"
      run python3 benchmarks/bench_tp.py ours --seq 16384 --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $P --cp 2 --profile-json ${OUT:-/tmp}/profile-cp2-p2p.json
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $P --cp 2 --cp-comm-type a2a --profile-json ${OUT:-/tmp}/profile-cp2-a2a.json ;;
    cpa2a)  # a2a (grouped point-to-point exchanges) against 1 GPU and p2p, after the numerics; a2a profile in $OUT
      run torchrun --nproc_per_node=2 benchmarks/check_cp.py
      C="ours --seq 16384 --mbs 1 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $C
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a --profile --profile-json ${OUT:-/tmp}/profile-cp2-a2a.json ;;
    cpquick)  # 1 GPU, then cp=2 a2a, p2p, a2a again (no numerics: after cpa2a on the same code)
      C="ours --seq 16384 --mbs 1 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $C
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a ;;
    cpdelay)  # the a2a default (delayed weight-gradient GEMMs, 16 SMs left to NCCL) against the plain backward,
              # p2p, and 1 GPU measured first and last
      C="ours --seq 16384 --mbs 1 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $C
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a --no-delay-wgrad-compute
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run python3 benchmarks/bench_tp.py $C ;;
    cphook)  # DDP's averaging hook: NCCL numerics (dp=2 fp32, cp=2 a2a bf16) against 1 GPU, then 1 GPU, cp=2 a2a
             # and p2p, and a profiled a2a step ($OUT)
      run python3 benchmarks/bench_tp.py check --watchdog $WD --mbs 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --mbs 1 --watchdog $WD
      K="check --precision bf16-mixed --seq 4096 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $K
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $K --cp 2 --cp-comm-type a2a
      C="ours --seq 16384 --mbs 1 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $C
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a --profile --profile-json ${OUT:-/tmp}/profile-cp2-a2a.json ;;
    cpbracket)  # 1 GPU, cp=2 a2a, p2p, a2a again, then 1 GPU again (the baseline measured before and after)
      C="ours --seq 16384 --mbs 1 --watchdog $WD"
      run python3 benchmarks/bench_tp.py $C
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py $C --cp 2 --cp-comm-type a2a
      run python3 benchmarks/bench_tp.py $C ;;
    cpwait)  # does an NCCL wait block the host? then one profiled cp=2 a2a step (host CUDA API calls in $OUT)
      run torchrun --nproc_per_node=2 benchmarks/probe_nccl_wait.py
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --seq 16384 --mbs 1 --watchdog $WD --cp 2 --cp-comm-type a2a --profile --profile-json ${OUT:-/tmp}/profile-cp2-a2a.json ;;
    distopt)  # distributed optimizer on 2 GPUs (dp=2): NCCL numerics against 1 GPU, then speed and memory with and without
      run python3 benchmarks/bench_tp.py check --watchdog $WD --mbs 2
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py check --use-distributed-optimizer --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/bench_tp.py ours --use-distributed-optimizer --watchdog $WD ;;
    peers)
      run python3 benchmarks/peer_baseline.py eager
      run python3 benchmarks/peer_x2.py tp2 ;;
  esac
done
