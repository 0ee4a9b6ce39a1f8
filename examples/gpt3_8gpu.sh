#!/usr/bin/env bash
# GPT-3 XL-shaped model (1.3B: 24 layers, hidden 2048) on one node of 8 GPUs (NCCL).
# Layout: TP=2 (+SP), PP=1, DP=4.
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=8
TP=2      # tensor parallel size; heads (16) must divide by it
MBS=4     # micro batch per rank
GBS=256   # global batch = MBS x DP (4) x microbatches (16)

MODEL=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --vocab-size 50257 --make-vocab-size-divisible-by 128
  --attention-dropout 0.1 --hidden-dropout 0.1 --init-method-std 0.02
)
TRAINING=(
  --tensor-model-parallel-size $TP --sequence-parallel
  --micro-batch-size $MBS --global-batch-size $GBS --train-iters 1000 --log-interval 10
  --bf16 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 100
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
  --mock-data
)
torchrun --nproc-per-node $GPUS_PER_NODE pretrain_gpt.py "${MODEL[@]}" "${TRAINING[@]}" "$@"
