"""Exact parameter shapes on every pipeline rank and model chunk, mirroring our modules.

Each function returns the local (this tp rank's) shapes of the parameters the
corresponding module creates, in the same way the module does:
- TransformerLayer: input norm, QKV (column-parallel, GQA rows (a + 2g) d; a bias
  also with --add-qkv-bias; --qk-layernorm adds a head-dim norm for q and one for k),
  output projection (row-parallel; its bias is replicated), pre-MLP norm, fc1
  (column-parallel, [gate; up] stacked for SwiGLU), fc2 (row-parallel, replicated bias);
- norms: weight (+ bias for LayerNorm), replicated across tp;
- embedding (first stage): vocab-parallel word embeddings over the padded
  vocabulary, learned absolute positions (replicated) if used;
- last stage: final norm and the output layer, which is absent when the embedding
  is tied and lives in the same chunk (one stage), and is a separate copy of the
  embedding (`shared_embedding`) when tied across pipeline stages.
All tp ranks of a stage hold the same shapes (every split is even). Shapes come in
the order of the chunk's `named_parameters()`, which the gradient buffer's bucket
layout (and so the distributed optimizer's padding) depends on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.pipeline_parallel.layer_split import stage_layer_ids
from megatron.core.transformer.config import padded_vocab_size

Shape = tuple[int, ...]


def _norm(config) -> list[Shape]:
    h = config.hidden_size
    return [(h,), (h,)] if config.normalization == "LayerNorm" else [(h,)]


def layer_shapes(config, tp: int) -> list[Shape]:
    h, d = config.hidden_size, config.kv_channels
    a, g, f = config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    stacked = 2 if config.swiglu else 1
    qkv_local = (a + 2 * g) * d // tp
    fc1_local = stacked * f // tp
    bias = config.add_bias_linear
    shapes = _norm(config) + [(qkv_local, h)] + ([(qkv_local,)] if bias or config.add_qkv_bias else [])
    if config.qk_layernorm:
        shapes += [(d,) for _ in _norm(config)] * 2
    shapes += [(h, a * d // tp)] + ([(h,)] if bias else [])
    shapes += _norm(config) + [(fc1_local, h)] + ([(fc1_local,)] if bias else [])
    shapes += [(h, f // tp)] + ([(h,)] if bias else [])
    return shapes


def embedding_shapes(config, tp: int) -> list[Shape]:
    h = config.hidden_size
    shapes = [(padded_vocab(config, tp) // tp, h)]
    if config.position_embedding_type == "learned_absolute":
        shapes.append((config.max_position_embeddings, h))
    return shapes


def head_shapes(config, tp: int, pre_process: bool) -> list[Shape]:
    """Final norm and output layer of the last stage."""
    tied = not config.untie_embeddings_and_output_weights
    shapes = _norm(config)
    if not (tied and pre_process):
        shapes.append((padded_vocab(config, tp) // tp, config.hidden_size))
    return shapes


def padded_vocab(config, tp: int) -> int:
    return padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp)


@dataclass(frozen=True)
class ModelChunk:
    """One local model chunk: its global layer indices and whether it is the first / last stage."""

    index: int
    layer_ids: tuple[int, ...]
    pre_process: bool
    post_process: bool


def rank_chunks(config, layout, pp_rank: int) -> list[ModelChunk]:
    """The model chunks of `pp_rank` (layers from pipeline_parallel.layer_split, as the model builds them)."""
    chunks = []
    for c, layer_ids in enumerate(stage_layer_ids(config.num_layers, layout.pp, layout.virtual_stages, pp_rank,
                                                  layout.first_stage_layers, layout.last_stage_layers)):
        first, last = layout.chunk_position(pp_rank, c)
        chunks.append(ModelChunk(c, tuple(layer_ids), first, last))
    return chunks


def chunk_shapes(config, tp: int, chunk: ModelChunk) -> list[Shape]:
    shapes = embedding_shapes(config, tp) if chunk.pre_process else []
    shapes += layer_shapes(config, tp) * len(chunk.layer_ids)
    if chunk.post_process:
        shapes += head_shapes(config, tp, chunk.pre_process)
    return shapes


def shared_embedding_index(config, layout, chunk: ModelChunk) -> int | None:
    """Index in `chunk_shapes` of the embedding tied across pipeline stages (the first stage's word
    embedding or the last stage's output-layer copy), which our buffers put in a bucket of its own."""
    if config.untie_embeddings_and_output_weights or chunk.pre_process == chunk.post_process:
        return None
    return 0 if chunk.pre_process else len(chunk_shapes(config, layout.tp, chunk)) - 1


def numel(shape: Shape) -> int:
    return math.prod(shape)


def total_parameters(config, tp: int = 1) -> int:
    """Parameters of one model replica, each counted once: tp shards summed, norms and
    replicated biases once, the tied output-layer copy not at all (vocabulary padded for `tp`)."""
    h = config.hidden_size
    full = layer_shapes(config, 1) * config.num_layers + _norm(config)
    vocab = padded_vocab(config, tp)
    total = sum(numel(s) for s in full) + vocab * h
    if config.position_embedding_type == "learned_absolute":
        total += config.max_position_embeddings * h
    if config.untie_embeddings_and_output_weights:
        total += vocab * h
    return total
