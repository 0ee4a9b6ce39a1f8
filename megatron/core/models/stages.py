"""The model chunks of one rank: one GPTModel per virtual stage, each with its own dropout streams.

Layers per stage come from `pipeline_parallel.layer_split`. Stage 0 also holds
the embedding, the last stage the final norm and output layer.
"""

from __future__ import annotations

from megatron.core.models.gpt_model import GPTModel
from megatron.core.pipeline_parallel.layer_split import stage_layer_ids
from megatron.core.tensor_parallel.initialization import use_init_method
from megatron.core.tensor_parallel.random import RNGTracker


def build_model_chunks(
    config, mesh, virtual: int, seed: int, device=None, first_stage_layers=None, last_stage_layers=None
) -> list[GPTModel]:
    chunks = []
    layer_ids = stage_layer_ids(
        config.num_layers, mesh.pp_size, virtual, mesh.pp_rank, first_stage_layers, last_stage_layers
    )
    for c, ids in enumerate(layer_ids):
        tracker = RNGTracker(
            device or "cpu", seed, stage=c * mesh.pp_size + mesh.pp_rank, cp_rank=mesh.cp_rank, tp_rank=mesh.tp_rank
        )
        chunks.append(
            GPTModel(
                config,
                tp_group=mesh.tp_group,
                rng_tracker=tracker,
                layer_ids=ids,
                pre_process=mesh.is_first_stage and c == 0,
                post_process=mesh.is_last_stage and c == virtual - 1,
                cp_group=mesh.cp_group,
                expert_groups=mesh.expert_groups if config.num_moe_experts is not None else None,
                device=device,
            )
        )
        use_init_method(chunks[-1], config.init_method)
    return chunks
