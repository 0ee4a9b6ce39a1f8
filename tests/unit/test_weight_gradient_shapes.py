"""The estimate's weight-gradient temporary follows the model code: the parameters it counts as having
a whole gradient tensor in backward (planning/parameters.py `weight_gradient_shapes`) are those a real
backward hands autograd a gradient for, with gradient accumulation fusion; without it, every parameter
(linear layers make their weight gradient as a product before adding it into main_grad)."""

import dataclasses

import pytest
import torch

from megatron.core.models.gpt_model import GPTModel
from megatron.core.transformer.config import TransformerConfig
from megatron.planning.fake_dist import FakeGroup, fake_collectives
from megatron.planning.parameters import ModelChunk, weight_gradient_shapes

B, S, H = 2, 16, 32
GPT = TransformerConfig(  # tied embeddings: the output layer uses the embedding's weight
    num_layers=2,
    hidden_size=H,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=S,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
LLAMA = dataclasses.replace(
    GPT,
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _model(config) -> GPTModel:
    with fake_collectives():
        return GPTModel(config, tp_group=FakeGroup(1), rng_tracker=None)


def _autograd_gradient_shapes(config) -> list:
    """Shapes of the parameters a CPU backward gives `.grad` while every parameter has a main_grad."""
    model = _model(config)
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    tokens, labels = torch.randint(0, config.vocab_size, (B, S)), torch.randint(0, config.vocab_size, (B, S))
    with fake_collectives():
        model(tokens, labels).sum().backward()
    return sorted(tuple(p.shape) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt-tied", "llama-untied"])
def test_weight_gradient_shapes_are_the_gradients_backward_makes(config):
    chunk = ModelChunk(0, tuple(range(config.num_layers)), pre_process=True, post_process=True)
    fused = dataclasses.replace(config, gradient_accumulation_fusion=True)
    made = _autograd_gradient_shapes(fused)
    assert made and sorted(weight_gradient_shapes(fused, 1, chunk)) == made
    unfused = dataclasses.replace(config, gradient_accumulation_fusion=False)
    every = sorted(tuple(p.shape) for p in _model(config).parameters())
    assert sorted(weight_gradient_shapes(unfused, 1, chunk)) == every != made
