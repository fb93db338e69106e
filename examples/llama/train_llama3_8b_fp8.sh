#!/bin/bash
# LLaMA-3 8B with FP8 GEMMs on one node of 8 GPUs (TP 1, CP 1, data parallel 8), laid out as Megatron-LM's
# examples/llama/train_llama3_8b_h100_fp8.sh, run by examples/pretrain_gpt.py (Lightning starts the 8 processes).
#
#   bash examples/llama/train_llama3_8b_fp8.sh [CHECKPOINT_DIR] [TENSORBOARD_DIR] [TOKENIZER|MOCK] [DATA_PREFIX|MOCK] \
#       [-- extra flags, which override the ones below]
#
# With MOCK (the default) the run trains on random tokens (--mock-data, NullTokenizer, vocabulary 128256).
# A quick check on CPU with a tiny shape (what tests/test_examples.py runs):
#   bash examples/llama/train_llama3_8b_fp8.sh /tmp/ckpt /tmp/tb MOCK MOCK -- --accelerator cpu --devices 2 \
#       --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2 \
#       --kv-channels 16 --seq-length 64 --max-position-embeddings 64 --vocab-size 512 --global-batch-size 4 \
#       --train-samples 24 --lr-decay-samples 24 --lr-warmup-samples 4
#
# Flags of the original left out here (docs/megatron_flags.md):
#   --fp8-param-gather                            refused: FP8 parameters and their all-gather have not landed
set -euo pipefail

CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b_fp8"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_8b_fp8"}
TOKENIZER_ARG=${3:-"MOCK"}
DATA_ARG=${4:-"MOCK"}
shift $(( $# < 4 ? $# : 4 ))
if [[ "${1:-}" == "--" ]]; then shift; fi
EXTRA_ARGS=("$@")

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python}
DATA_CACHE_PATH="${PWD}/benchmark_cache_llama3_8b_fp8"
mkdir -p "$CHECKPOINT_PATH"   # --load of an empty directory starts fresh

LAUNCH_ARGS=(--accelerator gpu --devices 8 --num-nodes 1)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --train-samples 1953125000
    --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

FP8_ARGS=(
    --fp8-format hybrid
    --fp8-amax-history-len 1024
    --fp8-amax-compute-algo max
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --sequence-parallel
)

if [[ "$TOKENIZER_ARG" == "MOCK" || "$DATA_ARG" == "MOCK" || -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 128256
        --data-cache-path "$DATA_CACHE_PATH"
        --tiktoken-pattern v2
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
else
    DATA_ARGS=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --data-cache-path "$DATA_CACHE_PATH"
        --split 99,1,0
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
        --vocab-size 128256
    )
fi

LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 32
    --eval-interval 100
    --save-interval 1000
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
)

exec "$PYTHON" "$HERE/../pretrain_gpt.py" \
    "${LAUNCH_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${FP8_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "${EXTRA_ARGS[@]}"
