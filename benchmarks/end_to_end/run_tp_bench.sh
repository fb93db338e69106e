#!/usr/bin/env bash
# The bench entry point for 1-2 GPUs (nvidia-h200-x2): runs the named arms in one device call. Output lines are
# JSON; everything is also written to $OUT/tp_bench.log. What each arm measured is in benchmarks/RESULTS.md.
#   ARMS="check ours peers" bash benchmarks/end_to_end/run_tp_bench.sh      # the default arms
# Arms:
#   check     NCCL numerics: 5 fp32 steps, tp=2 and tp=2+SP against 1 GPU
#   ours      1.3B benchmark model: tp=1 (1 GPU), tp=2+SP, tp=2+SP with the input re-gathered, tp=2
#   tp2       tp=2+SP, tp=2 and Lightning's ModelParallelStrategy DTensor tp=2 in one call
#   peers     the peer baselines: plain PyTorch eager (1 GPU), Lightning DTensor tp=2
#   ppcheck   NCCL numerics: pp=2 (1F1B, interleaved) against 1 GPU, 2 micro-batches per step
#   pp        pp=2 1F1B and interleaved against 1 GPU, 8 micro-batches per step
#   cpcheck   fused-vs-math attention kernels, cp=2 attention against full SDPA, 5 bf16 model steps cp=2 vs 1 GPU
#   cp        seq 16384: cp=2 p2p and a2a against 1 GPU (CHECK=1: check_cp.py first)
#   cpkernels attention kernels alone, check_cp.py, then the cp arm's runs
#   cpdelay   the a2a default (delayed weight-gradient GEMMs) against --no-delay-wgrad-compute, p2p, with
#             1 GPU measured first and last
#   moe       Mixtral-shaped model: NCCL numerics ep=2 vs 1 GPU, then tokens/s of ep=1 and ep=2
#   pretrain  examples/pretrain_gpt.py on preprocessed data: MFUMonitor against an independent timer
#   compile   1 GPU: plain PyTorch eager and compiled (the peers), ours eager and with compile=True
#   distopt   distributed optimizer at dp=2: NCCL numerics against 1 GPU, speed and memory with and without
#   fsdp      FSDP sharding levels at dp=2: NCCL numerics of optim_grads_params against 1 GPU, then tokens/s and
#             memory of no_shard, optim_grads, optim_grads_params and Lightning's FSDP2 peer (peer_x2.py fsdp2)
#   fsdp8b    the llama3_8b model on 2 GPUs: optim_grads_params with full recompute (uniform 1), mbs 1
#   recompute 1 GPU: no activation recompute, selective (core_attn; core_attn+layernorm+mlp), full (uniform 1,
#             block 8): tokens/s, peak and activation memory
#   overlap   the three overlaps on and off, NCCL numerics of each first: 1 GPU baseline; dp=2 with
#             --no-overlap-grad-reduce / the default (DDP's 25 MiB buckets) / 40M-element buckets; dp=2 distributed
#             optimizer with and without --overlap-param-gather; tp=2+SP with and without --tp-comm-overlap (also
#             with --recompute-gather, and with --compile). The pipeline path's overlapped reduction needs dp > 1
#             beside pp=2, i.e. 4 GPUs (not in this 2-GPU arm).
# Environment: WATCHDOG (seconds before a hung run dumps its stacks and exits, default 240), ARM_TIMEOUT
# (seconds per command, default 330), OUT (where the log goes, default /tmp).
LOG_NAME=tp_bench
source "$(dirname "$0")/_common.sh"
ARMS=${ARMS:-"check ours peers"}
C16K="ours --seq 16384 --mbs 1 --watchdog $WD"  # the context-parallel speed runs: 1.3B model, seq 16384
for arm in $ARMS; do
  case $arm in
    check)
      run python3 benchmarks/end_to_end/bench_tp.py check
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --tp 2
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --tp 2 --sp ;;
    ours)
      run python3 benchmarks/end_to_end/bench_tp.py ours
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp --recompute-gather
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 ;;
    tp2)
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2
      run python3 benchmarks/peers/peer_x2.py tp2 ;;
    compile)
      run python3 benchmarks/peers/peer_baseline.py eager compile
      run python3 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --compile --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --compile --accumulate 8 --watchdog $WD ;;
    peers)
      run python3 benchmarks/peers/peer_baseline.py eager
      run python3 benchmarks/peers/peer_x2.py tp2 ;;
    ppcheck)
      run python3 benchmarks/end_to_end/bench_tp.py check --accumulate 2 --mbs 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --pp 2 --accumulate 2 --mbs 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --pp 2 --vp 2 --accumulate 2 --mbs 2 --watchdog $WD ;;
    pp)
      run python3 benchmarks/end_to_end/bench_tp.py ours --accumulate 8
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --pp 2 --accumulate 8 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --pp 2 --vp 2 --accumulate 8 --watchdog $WD ;;
    cpcheck)
      run torchrun --nproc_per_node=2 benchmarks/checks/check_cp.py
      run python3 benchmarks/end_to_end/bench_tp.py check --precision bf16-mixed --seq 4096 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --cp 2 --precision bf16-mixed --seq 4096 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --cp 2 --cp-comm-type a2a --precision bf16-mixed --seq 4096 --watchdog $WD ;;
    cp)
      [ "${CHECK:-0}" = 1 ] && run torchrun --nproc_per_node=2 benchmarks/checks/check_cp.py
      run python3 benchmarks/end_to_end/bench_tp.py $C16K
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2 --cp-comm-type a2a ;;
    cpkernels)  # the cp=2 results name the block kernel that ran (cp_block_kernel: cudnn, or flash after cuDNN refused)
      run python3 benchmarks/kernels/bench_attention.py
      run torchrun --nproc_per_node=2 benchmarks/checks/check_cp.py
      run python3 benchmarks/end_to_end/bench_tp.py $C16K
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2 --cp-comm-type a2a ;;
    cpdelay)
      run python3 benchmarks/end_to_end/bench_tp.py $C16K
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2 --cp-comm-type a2a
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2 --cp-comm-type a2a --no-delay-wgrad-compute
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py $C16K --cp 2 --cp-comm-type a2a
      run python3 benchmarks/end_to_end/bench_tp.py $C16K ;;
    moe)
      run python3 benchmarks/end_to_end/bench_tp.py check --model moe --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --model moe --ep 2 --mbs 2 --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --model moe --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --model moe --moe-loop --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --model moe --ep 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --model moe --ep 2 --dispatcher allgather --watchdog $WD ;;
    pretrain)
      run python3 benchmarks/checks/check_pretrain_mfu.py ;;
    distopt)
      run python3 benchmarks/end_to_end/bench_tp.py check --watchdog $WD --mbs 2
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --use-distributed-optimizer --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --use-distributed-optimizer --watchdog $WD ;;
    fsdp)
      run python3 benchmarks/end_to_end/bench_tp.py check --watchdog $WD --mbs 2
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --data-parallel-sharding-strategy optim_grads_params --mbs 1 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --data-parallel-sharding-strategy optim_grads --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --data-parallel-sharding-strategy optim_grads_params --watchdog $WD
      run python3 benchmarks/peers/peer_x2.py fsdp2 ;;
    fsdp8b)
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --model llama3_8b --mbs 1 --data-parallel-sharding-strategy optim_grads_params --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --watchdog $WD ;;
    recompute)
      run python3 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --recompute-granularity selective --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --recompute-granularity selective --recompute-modules core_attn layernorm mlp --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --recompute-granularity full --recompute-method block --recompute-num-layers 8 --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD ;;
    overlap)
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --no-overlap-grad-reduce --mbs 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --use-distributed-optimizer --overlap-param-gather --mbs 2 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --tp 2 --sp --tp-comm-overlap --watchdog $WD
      run python3 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --no-overlap-grad-reduce --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --ddp-bucket-size 40000000 --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --use-distributed-optimizer --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --use-distributed-optimizer --overlap-param-gather --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp --tp-comm-overlap --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp --tp-comm-overlap --recompute-gather --watchdog $WD
      run torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 --sp --tp-comm-overlap --compile --watchdog $WD ;;
    *)
      echo "unknown arm '$arm': expected one of check ours tp2 peers compile ppcheck pp cpcheck cp cpkernels cpdelay moe pretrain distopt fsdp fsdp8b recompute overlap" >&2
      exit 2 ;;
  esac
done
