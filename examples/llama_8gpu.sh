#!/usr/bin/env bash
# Llama-2-7B-shaped model on one node of 8 GPUs (NCCL).
# Layout: TP=2 (+SP) inside NVLink pairs, PP=2 with 2 virtual stages per rank, DP=2.
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=8
TP=2            # tensor parallel: splits every layer; keep within a node (tp varies fastest in the mesh)
PP=2            # pipeline stages; --num-layers must divide by PP x virtual stages
VPP_LAYERS=8    # layers per virtual stage: 32 layers / PP 2 / 8 = 2 chunks per rank (interleaved 1F1B)
MBS=1           # micro batch per rank
GBS=64          # global batch = MBS x DP x microbatches (here 1 x 2 x 32)

MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
  --seq-length 4096 --max-position-embeddings 4096 --rotary-base 10000 --norm-epsilon 1e-5
  --vocab-size 32000 --make-vocab-size-divisible-by 128
)
PARALLEL=(
  --tensor-model-parallel-size $TP --sequence-parallel
  --pipeline-model-parallel-size $PP --num-layers-per-virtual-pipeline-stage $VPP_LAYERS
)
TRAINING=(
  --micro-batch-size $MBS --global-batch-size $GBS --train-iters 1000 --log-interval 10
  --bf16                                   # bf16 weights, fp32 master weights and grad reduction
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --recompute-granularity selective        # recompute attention only; 'full' saves more memory
  --mock-data                              # synthetic tokens until indexed datasets land
)
torchrun --nproc-per-node $GPUS_PER_NODE pretrain_llama.py "${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "$@"
