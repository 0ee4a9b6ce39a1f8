"""The model chunks of one rank: one GPTModel per virtual stage, each with its own dropout streams.

Layers per stage come from `pipeline_parallel.layer_split`, the stage of each chunk from
`pipeline_parallel.placement` (`placement`: 'loop', or 'v' for zbv). Stage 0 also holds
the embedding, the last stage the final norm and output layer.
"""

from __future__ import annotations

from megatron.core.models.gpt_model import GPTModel
from megatron.core.pipeline_parallel.layer_split import stage_layer_ids
from megatron.core.pipeline_parallel.placement import Placement
from megatron.core.tensor_parallel.initialization import use_init_method
from megatron.core.tensor_parallel.random import RNGTracker


def build_model_chunks(
    config,
    mesh,
    virtual: int,
    seed: int,
    device=None,
    first_stage_layers=None,
    last_stage_layers=None,
    placement: str = "loop",
) -> list[GPTModel]:
    chunks = []
    where = Placement(mesh.pp_size, virtual, placement)
    layer_ids = stage_layer_ids(
        config.num_layers, mesh.pp_size, virtual, mesh.pp_rank, first_stage_layers, last_stage_layers, placement
    )
    for c, ids in enumerate(layer_ids):
        stage = where.stage(mesh.pp_rank, c)
        tracker = RNGTracker(device or "cpu", seed, stage=stage, cp_rank=mesh.cp_rank, tp_rank=mesh.tp_rank)
        chunks.append(
            GPTModel(
                config,
                tp_group=mesh.tp_group,
                rng_tracker=tracker,
                layer_ids=ids,
                pre_process=stage == 0,
                post_process=stage == where.num_stages - 1,
                cp_group=mesh.cp_group,
                expert_groups=mesh.expert_groups if config.num_moe_experts is not None else None,
                device=device,
            )
        )
        use_init_method(chunks[-1], config.init_method)
    return chunks
