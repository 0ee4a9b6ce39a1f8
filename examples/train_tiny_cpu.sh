#!/usr/bin/env bash
# Quick start: a tiny Llama trained on CPU by 16 gloo ranks, composing all four
# dimensions: tensor parallelism with sequence parallelism (TP=2), context
# parallelism (CP=2, ring attention), interleaved pipeline parallelism (PP=2,
# 2 virtual stages per rank) and data parallelism (DP=2), on the shipped corpus
# tokenized with the shipped SentencePiece model (preprocessed on first use into
# runs/data/). Installs what it needs first. Extra flags are passed through, e.g.
# `--log-interval 1`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
source tools/python_env.sh
export OMP_NUM_THREADS=1
TOKENIZER=(--tokenizer-type Llama2Tokenizer --tokenizer-model data/tokenizers/spm/tokenizer.model)
PREFIX=runs/data/stories-spm
if [ ! -f "${PREFIX}_text_document.idx" ]; then
  mkdir -p runs/data
  "$PYTHON" tools/preprocess_data.py --input data/corpus/stories.jsonl --output-prefix "$PREFIX" \
    "${TOKENIZER[@]}" --append-eod --workers 2
fi
"$PYTHON" -m torch.distributed.run --nproc-per-node 16 pretrain_llama.py \
  --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
  --num-layers 4 --hidden-size 64 --ffn-hidden-size 172 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 --seq-length 64 \
  --micro-batch-size 2 --global-batch-size 16 --train-iters 30 --log-interval 5 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 3 --lr-decay-style cosine \
  --data-path "${PREFIX}_text_document" "${TOKENIZER[@]}" --split 98,2,0 \
  --eval-interval 10 --eval-iters 2 "$@"
