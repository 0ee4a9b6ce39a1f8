"""Formulas of the model variants Megatron's GPT/Llama scripts use: Llama-3.1 rope scaling,
interleaved and partial rotary, zero-centred norm weights (--apply-layernorm-1p), QK norm and
QKV bias, and the flags that select them (aliases included)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from kernels.rope import apply_rotary
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.norm import Norm
from megatron.core.transformer.rotary import llama3_scaled, rotary_frequencies
from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from tests.distributed import run_distributed

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "2",
    "--mock-data",
    "--vocab-size",
    "100",
]


def test_llama3_rope_scaling_hand_computed():
    """Wavelength < 8192/4: unchanged; > 8192/1: divided by the factor; between: the blend
    (1 - s) f / factor + s f with s = (8192 / wavelength - 1) / (4 - 1)."""
    freqs = torch.tensor([2 * math.pi / 100.0, 2 * math.pi / 4096.0, 2 * math.pi / 20000.0], dtype=torch.float64)
    out = llama3_scaled(freqs, 8.0)
    s = (8192 / 4096 - 1) / 3
    expected = [freqs[0].item(), (1 - s) * freqs[1].item() / 8 + s * freqs[1].item(), freqs[2].item() / 8]
    assert out.tolist() == pytest.approx(expected)


def test_rotary_interleaved_rotates_neighbour_pairs():
    angles = rotary_frequencies(3, 4, 10000.0, interleaved=True)
    x = torch.randn(3, 1, 1, 4)
    out = apply_rotary(x, angles, interleaved=True)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 4, 2) / 4)
    for pos in range(3):
        for pair in range(2):
            theta = pos * inv[pair]
            a, b = x[pos, 0, 0, 2 * pair], x[pos, 0, 0, 2 * pair + 1]
            rotated = [a * math.cos(theta) - b * math.sin(theta), b * math.cos(theta) + a * math.sin(theta)]
            assert out[pos, 0, 0, 2 * pair : 2 * pair + 2].tolist() == pytest.approx(
                [r.item() for r in rotated], abs=1e-6
            )


def test_rotary_percent_rotates_only_the_first_channels():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        vocab_size=10,
        seq_length=4,
        position_embedding_type="rope",
        rotary_percent=0.5,
    )
    assert config.rotary_dim == 8
    x = torch.randn(4, 1, 2, 16)
    out = apply_rotary(x, rotary_frequencies(4, config.rotary_dim, 10000.0))
    assert torch.equal(out[..., 8:], x[..., 8:]) and not torch.allclose(out[1:, ..., :8], x[1:, ..., :8])
    with pytest.raises(ValueError, match="even number of rotated channels"):
        TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            vocab_size=10,
            seq_length=4,
            position_embedding_type="rope",
            rotary_percent=0.2,
        )  # int(16 x 0.2) = 3


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_scales_by_one_plus_weight(kind):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        vocab_size=10,
        seq_length=4,
        normalization=kind,
        layernorm_zero_centered_gamma=True,
        normalization_impl="torch",
    )
    norm = Norm(config, 8)
    assert norm.weight.init_spec.kind == "zeros"
    with torch.no_grad():  # parameters are created empty and filled by initialize_parameters
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        if norm.bias is not None:
            norm.bias.zero_()
    x = torch.randn(3, 8)
    plain = (
        torch.nn.functional.layer_norm(x, (8,), eps=1e-5)
        if kind == "LayerNorm"
        else torch.nn.functional.rms_norm(x, (8,), eps=1e-5)
    )
    assert torch.allclose(norm(x), plain * (1 + norm.weight.detach()), atol=1e-5)


def test_variant_flags_reach_the_model():
    run = parse_run_config(
        TINY
        + [
            "--apply-layernorm-1p",
            "--qk-layernorm",
            "--add-qkv-bias",
            "--rotary-percent",
            "0.5",
            "--rotary-interleaved",
            "--rope-scaling",
            "--rope-scaling-factor",
            "4",
            "--recompute-activations",
            "--attention-backend",
            "flash",
        ],
        LLAMA_DEFAULTS,
        1,
    )
    m = run.model
    assert (
        m.layernorm_zero_centered_gamma,
        m.qk_layernorm,
        m.add_qkv_bias,
        m.rotary_percent,
        m.rotary_interleaved,
        m.rope_scaling,
        m.rope_scaling_factor,
    ) == (True, True, True, 0.5, True, True, 4.0)
    assert m.recompute_granularity == "selective" and m.attention_backend == "auto" and not m.add_bias_linear
    gpt = parse_run_config(TINY + ["--no-position-embedding"], GPT_DEFAULTS, 1).model
    assert gpt.position_embedding_type == "none"
    assert (
        parse_run_config(TINY + ["--use-rotary-position-embeddings"], GPT_DEFAULTS, 1).model.position_embedding_type
        == "rope"
    )
    assert (
        parse_run_config(TINY + ["--attention-backend", "unfused"], GPT_DEFAULTS, 1).model.attention_backend
        == "unfused"
    )
    with pytest.raises(ValueError, match="--recompute-activations \\(selective\\) contradicts"):
        parse_run_config(TINY + ["--recompute-activations", "--recompute-granularity", "full"], GPT_DEFAULTS, 1)


def _attention_parameters(rank):
    from megatron.core.transformer.attention import SelfAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=10,
        seq_length=4,
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    attention = SelfAttention(config, tp_group=dist.group.WORLD, rng_tracker=None)
    return ({n for n, _ in attention.named_parameters()}, attention.q_layernorm.weight.sequence_parallel)


def test_qk_layernorm_and_qkv_bias_parameters():
    ((names, q_norm_summed_over_tp),) = run_distributed(1, _attention_parameters)
    assert names == {
        "linear_qkv.weight",
        "linear_qkv.bias",
        "linear_proj.weight",
        "q_layernorm.weight",
        "k_layernorm.weight",
    }
    assert q_norm_summed_over_tp  # summed over tp: each rank normalises other heads
