"""Parameter shapes on every pipeline rank and model chunk, read from our modules (trace.py).

All tp ranks of a stage hold the same shapes (every split is even), and all ep x etp ranks the
same number of experts of the same shapes. Shapes come in the order of the chunk's
`named_parameters()`, which the gradient buffers' bucket layouts (and so the distributed
optimizer's padding) depend on; experts' parameters apart from the others, as their buffer holds them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from megatron.core.transformer.config import TransformerConfig, padded_vocab_size
from megatron.planning.trace import chunk_parameter_shapes, config_key

Shape = tuple[int, ...]


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
    chunks, par = [], layout.parallel
    for c, layer_ids in enumerate(par.layer_ids(config.num_layers, pp_rank)):
        first, last = par.chunk_position(pp_rank, c)
        chunks.append(ModelChunk(c, tuple(layer_ids), first, last))
    return chunks


def chunk_shapes(config, tp: int, chunk: ModelChunk, expert: bool = False) -> list[Shape]:
    """Shapes of the chunk's parameters outside experts, or (`expert`) of its experts' (local experts,
    split over etp)."""
    parameters = chunk_parameter_shapes(config, tp, chunk.pre_process, chunk.post_process, chunk.layer_ids)
    return [p.shape for p in parameters if p.is_expert == expert]


def weight_gradient_shapes(config, tp: int, chunk: ModelChunk) -> list[Shape]:
    """Shapes of the chunk's parameters (experts' too) that have a whole gradient tensor in backward
    before it is added to main_grad: autograd's, for all but the linear layers' own weights; those
    add grad^T x into main_grad themselves, by one addmm with gradient accumulation fusion (no FP8),
    else through a product of the weight's size (tensor_parallel/weight_grads.py)."""
    parameters = chunk_parameter_shapes(config, tp, chunk.pre_process, chunk.post_process, chunk.layer_ids)
    products = not config.gradient_accumulation_fusion or config.fp8 is not None
    return [p.shape for p in parameters if products or not p.linear_weight]


def shared_embedding_index(config, layout, chunk: ModelChunk) -> int | None:
    """Index in `chunk_shapes` of the embedding tied across pipeline stages (the first stage's word
    embedding or the last stage's output-layer copy), which our buffers put in a bucket of its own."""
    if config.untie_embeddings_and_output_weights or chunk.pre_process == chunk.post_process:
        return None
    return 0 if chunk.pre_process else len(chunk_shapes(config, layout.parallel.tp, chunk)) - 1


def numel(shape: Shape) -> int:
    return math.prod(shape)


def _whole_model_parameters(config, tp: int, expert: bool | None = None) -> int:
    """Parameters of the one-rank model with the vocabulary padded for `tp` (tp shards summed, every
    expert, norms and replicated biases once, no tied output-layer copy): all, or only the experts'
    (`expert` True) or the others' (False)."""
    return _counted_parameters(config_key(config), tp, expert)


@functools.lru_cache(maxsize=1024)
def _counted_parameters(key: tuple, tp: int, expert: bool | None) -> int:
    """`_whole_model_parameters` of the config `key` holds (trace.config_key): once per config, tp and
    part (a search asks for it per layout)."""
    config = TransformerConfig(*key)
    whole = dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        context_parallel_size=1,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by * tp,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
    )

    def count(layer_ids: list[int]) -> int:
        parameters = chunk_parameter_shapes(whole, 1, True, True, layer_ids)
        return sum(numel(p.shape) for p in parameters if expert in (None, p.is_expert))

    kinds = [config.is_moe_layer(i) for i in range(config.num_layers)]
    ends = count([])
    per_layer = {moe: count([kinds.index(moe)]) - ends for moe in set(kinds)}  # layers of a kind are alike
    return ends + sum(per_layer[moe] for moe in kinds)


def total_parameters(config, tp: int = 1) -> int:
    """Parameters of one model replica, each counted once (`_whole_model_parameters`)."""
    return _whole_model_parameters(config, tp)


def expert_parameters(config) -> int:
    """The routed experts' share of `total_parameters`."""
    return _whole_model_parameters(config, 1, expert=True)
