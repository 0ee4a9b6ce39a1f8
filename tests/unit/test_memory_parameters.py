"""Parameter counts: published model sizes, and exact agreement with our own model on every rank."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt_model import GPTModel
from megatron.core.parallel_config import ParallelConfig
from megatron.core.transformer.config import TransformerConfig
from megatron.planning import MemoryLayout, estimate_memory
from megatron.planning.parameters import chunk_shapes, expert_parameters, numel, rank_chunks, total_parameters
from tests.distributed import run_distributed

LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    params_dtype=torch.bfloat16,
    seq_length=4096,
    make_vocab_size_divisible_by=128,
)
LLAMA2_7B = TransformerConfig(
    num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, vocab_size=32000, **LLAMA
)
LLAMA3_8B = TransformerConfig(
    num_layers=32,
    hidden_size=4096,
    ffn_hidden_size=14336,
    num_attention_heads=32,
    num_query_groups=8,
    vocab_size=128256,
    **LLAMA,
)
GPT_SMALL = TransformerConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=32, max_position_embeddings=48
)
LLAMA_SMALL = TransformerConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=8,
    num_query_groups=2,
    vocab_size=1000,
    **{**LLAMA, "seq_length": 32},
)


def test_llama2_7b_total():
    assert total_parameters(LLAMA2_7B) == 6_738_415_616
    assert estimate_memory(LLAMA2_7B, MemoryLayout()).ranks[0].parameters == 6_738_415_616


def test_llama3_8b_total():
    assert total_parameters(LLAMA3_8B) == 8_030_261_248
    assert estimate_memory(LLAMA3_8B, MemoryLayout()).ranks[0].parameters == 8_030_261_248


MIXTRAL_8X7B = dataclasses.replace(LLAMA3_8B, vocab_size=32000, num_moe_experts=8, moe_router_topk=2)


def test_mixtral_total_and_experts_per_rank():
    """Mixtral-8x7B's published 46.7B parameters, 45.1B of them experts'; under ep 4 a rank holds 2
    experts per layer (split over etp 2 when tp 2 splits them), in a buffer of their own."""
    experts = 32 * 8 * 3 * 4096 * 14336
    assert total_parameters(MIXTRAL_8X7B) == 46_702_792_704 and expert_parameters(MIXTRAL_8X7B) == experts
    for tp, ep in ((1, 4), (2, 4)):
        config = dataclasses.replace(
            MIXTRAL_8X7B, tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep
        )
        config = dataclasses.replace(config, expert_tensor_parallel_size=tp)
        rank = estimate_memory(config, MemoryLayout(ParallelConfig(tp=tp, dp=8 // tp, ep=ep))).ranks[0]
        dense = total_parameters(MIXTRAL_8X7B, tp) - experts
        replicated = 32 * (2 + 8) * 4096 + 4096  # norms and the router (tp ranks hold it whole), the final norm
        assert rank.parameters == (dense - replicated) // tp + replicated + experts // (ep * tp)


def test_vocabulary_is_padded_per_tp():
    """Padded to a multiple of 128 x tp, as our embedding is; tied, so counted once."""
    assert total_parameters(GPT_SMALL) == 4 * 49_984 + 2 * 64 + 1024 * 64 + 48 * 64
    odd = dataclasses.replace(GPT_SMALL, vocab_size=1030)
    assert total_parameters(odd, tp=2) - total_parameters(odd, tp=1) == (1280 - 1152) * 64


def test_pipeline_ranks_sum_to_total_plus_tied_copy():
    """Untied: pipeline ranks add up to the model. Tied across stages: the last stage holds a copy."""
    for config in (LLAMA2_7B, GPT_SMALL):
        layout = MemoryLayout(ParallelConfig(pp=4, virtual_stages=1))
        per_rank = [r.parameters for r in estimate_memory(config, layout).ranks]
        tied_copy = 0 if config.untie_embeddings_and_output_weights else config.padded_vocab_size * 64
        assert sum(per_rank) == total_parameters(config) + tied_copy


def _model_numels(rank, cases):
    """On meta tensors: p.numel() in named_parameters() order of the chunks our own code builds
    for each (config, pp, v, first, last)."""
    from megatron.core.models.stages import stage_layer_ids

    tp = dist.get_world_size()
    out = []
    for config, pp, v, first, last in cases:
        config = dataclasses.replace(config, tensor_model_parallel_size=tp)
        ranks = []
        for pp_rank in range(pp):
            chunks = []
            for c, layer_ids in enumerate(stage_layer_ids(config.num_layers, pp, v, pp_rank, first, last)):
                model = GPTModel(
                    config,
                    tp_group=dist.group.WORLD,
                    rng_tracker=None,
                    layer_ids=layer_ids,
                    pre_process=pp_rank == 0 and c == 0,
                    post_process=pp_rank == pp - 1 and c == v - 1,
                    device="meta",
                )
                chunks.append([p.numel() for p in model.parameters()])
            ranks.append(chunks)
        out.append(ranks)
    return out


QWEN_SMALL = dataclasses.replace(LLAMA_SMALL, add_qkv_bias=True, qk_layernorm=True)
CASES = [
    (LLAMA2_7B, 1, 1, None, None),
    (LLAMA3_8B, 2, 2, None, None),
    (GPT_SMALL, 1, 1, None, None),
    (GPT_SMALL, 2, 2, None, None),
    (LLAMA_SMALL, 4, 1, None, None),
    (QWEN_SMALL, 2, 1, 1, None),
    (GPT_SMALL, 3, 1, None, 2),
]


@pytest.mark.parametrize("tp", [1, 2])
def test_shapes_equal_our_model_on_every_rank(tp):
    """Every parameter, in named_parameters() order (the buffers' bucket layout depends on it),
    also with --add-qkv-bias, --qk-layernorm and uneven pipeline splits."""
    built = run_distributed(tp, _model_numels, CASES)
    for index, (config, pp, v, first, last) in enumerate(CASES):
        layout = MemoryLayout(
            ParallelConfig(tp=tp, pp=pp, virtual_stages=v, first_stage_layers=first, last_stage_layers=last)
        )
        config = dataclasses.replace(config, tensor_model_parallel_size=tp)
        estimated = [
            [[numel(s) for s in chunk_shapes(config, tp, c)] for c in rank_chunks(config, layout, r)] for r in range(pp)
        ]
        for rank_numels in built:  # every tp rank holds the same shapes
            assert rank_numels[index] == estimated, (config.num_layers, pp, v, tp)


def test_chunks_follow_stage_layout():
    layout = MemoryLayout(ParallelConfig(pp=2, virtual_stages=2))
    chunks = rank_chunks(GPT_SMALL, layout, 1)
    assert [c.layer_ids for c in chunks] == [(1,), (3,)]
    assert [(c.pre_process, c.post_process) for c in chunks] == [(False, False), (False, True)]
    with pytest.raises(ValueError, match="divisible"):
        rank_chunks(GPT_SMALL, MemoryLayout(ParallelConfig(pp=3)), 0)
    uneven = MemoryLayout(ParallelConfig(pp=3, first_stage_layers=2))
    assert [[c.layer_ids for c in rank_chunks(GPT_SMALL, uneven, r)] for r in range(3)] == [[(0, 1)], [(2,)], [(3,)]]
