"""Which layers each pipeline stage holds, and the model chunks of one rank.

Global stage s = c * p + r (chunk c of pipeline rank r) holds layers
[s * L / (p v), (s + 1) * L / (p v)). Stage 0 also holds the embedding, the
last stage the final norm and output layer.
"""
from __future__ import annotations

from megatron.core.models.gpt_model import GPTModel


def stage_layer_ids(num_layers: int, pp: int, virtual: int, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each local chunk of `pp_rank`."""
    stages = pp * virtual
    if num_layers % stages:
        raise ValueError(f"--num-layers ({num_layers}) must be divisible by pipeline stages ({stages})")
    per_stage = num_layers // stages
    return [list(range((c * pp + pp_rank) * per_stage, (c * pp + pp_rank + 1) * per_stage)) for c in range(virtual)]


def build_model_chunks(config, mesh, virtual: int, rng_tracker, device=None) -> list[GPTModel]:
    chunks = []
    for c, layer_ids in enumerate(stage_layer_ids(config.num_layers, mesh.pp_size, virtual, mesh.pp_rank)):
        chunks.append(GPTModel(
            config, tp_group=mesh.tp_group, rng_tracker=rng_tracker, layer_ids=layer_ids,
            pre_process=mesh.is_first_stage and c == 0, post_process=mesh.is_last_stage and c == virtual - 1,
            device=device))
    return chunks
