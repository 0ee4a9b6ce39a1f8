"""Saved activations traced from our modules: closed forms per layer, the paper's Llama form, kernels,
recomputation, on CUDA (traced as CUDA dispatches) and CPU.

The exact agreement with measured saved tensors is in tests/parallel/test_memory_measured.py;
these tests pin what the trace finds against closed forms derived by hand from the code.
"""

import dataclasses

import pytest
import torch

from megatron.core.transformer.block import layer_groups
from megatron.core.transformer.config import TransformerConfig
from megatron.planning.inflight import peaks
from megatron.planning.kernels import resolve_kernels
from megatron.planning.trace import Setting, chunk_saved

S, B, H, A, G, D, F = 4096, 2, 4096, 32, 8, 128, 14336
LLAMA = TransformerConfig(
    num_layers=4,
    hidden_size=H,
    ffn_hidden_size=F,
    num_attention_heads=A,
    num_query_groups=G,
    vocab_size=128256,
    seq_length=S,
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    params_dtype=torch.bfloat16,
)
GPT = TransformerConfig(
    num_layers=4,
    hidden_size=1024,
    num_attention_heads=16,
    vocab_size=50257,
    seq_length=1024,
    params_dtype=torch.bfloat16,
)


def _saved(config, pre=False, post=False, n_layers=1, tp=1, cp=1, device="cuda"):
    config = dataclasses.replace(
        config, tensor_model_parallel_size=tp, sequence_parallel=tp > 1, context_parallel_size=cp
    )
    setting = Setting(tp, cp, B, device, resolve_kernels(config, device).attention)
    return chunk_saved(config, setting, pre, post, range(n_layers))


def layer_bytes(config, tp=1, device="cuda", cp=1):
    """What one more layer in a chunk adds: its own saved tensors and its input when it saves that."""
    two, one = (_saved(config, n_layers=n, tp=tp, cp=cp, device=device).bytes for n in (2, 1))
    return two - one


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_llama_layer_on_cuda_against_the_paper(t):
    """Paper (Fujii et al., bf16, flash, SP, no dropout): s b h (12 + 4k/a + 8 f/h) / t bytes per layer.
    With our Triton kernels (attention, norms, RoPE, SwiGLU) our layer keeps what the code really keeps:
    RMSNorm's fp32 rstd and the attention kernel's fp32 log-sum-exp besides, and 2 s b f / t less, as the
    SwiGLU kernel recomputes silu(gate) from its input (the paper counts it stored); the RoPE kernel saves
    only the angles, the block's input shared by all layers. The torch paths of RoPE and SwiGLU (the
    --no-rope-fusion / --no-bias-swiglu-fusion flags) keep cos and sin rounded to bf16 as megatron-core
    does, once for q and once for k, and silu(gate) (the projection saves its input, a reshaped view of
    the kernel's output, as it is)."""
    assert resolve_kernels(LLAMA, "cuda").describe() == "attention triton, norms triton, rope triton, swiglu triton"
    sbh = S * B * H
    paper = sbh * (12 + 4 * G / A + 8 * F / H) / t
    rstd = 2 * 4 * S * B / t
    lse = 4 * B * A * S / t
    silu = 2 * S * B * F / t
    assert layer_bytes(LLAMA, t) == paper + rstd + lse - silu
    unfused = dataclasses.replace(LLAMA, rope_impl="torch", swiglu_impl="torch")
    assert resolve_kernels(unfused, "cuda").describe() == "attention triton, norms triton, rope torch, swiglu torch"
    rope = 4 * S * D * 2
    assert layer_bytes(unfused, t) == paper + rstd + lse + rope


def test_llama_layer_with_torch_sdpa_on_cuda():
    """--attention-backend torch: SDPA flash keeps q, k, v as views, so the whole QKV output stays
    alive (through v) next to the rotated q and k; the projection input is a view of its output, as it is
    of the Triton kernel's output."""
    torch_attention = dataclasses.replace(LLAMA, attention_backend="torch")
    assert resolve_kernels(torch_attention, "cuda").attention == "flash"
    sb = S * B
    rotated = 2 * sb * (A + G) * D  # q_rot, k_rot
    qkv = 2 * sb * (A + 2 * G) * D
    copies = 2 * sb * (A + 2 * G) * D  # Triton: contiguous q, k, v
    assert layer_bytes(torch_attention) - layer_bytes(LLAMA) == rotated + qkv - copies


def test_gpt_layer_on_cuda_closed_form():
    """GPT (LayerNorm with fp32 stats, GELU, biases, dropout 0.1 -> bool masks on CUDA, flash):
    2sbh (LN1 in) + 2sbh (QKV in) + 6sbh (QKV out: q, k, v views) + 2sbh (attention out) + sbh (mask)
    + 2sbh (LN2 in) + 2sbh (fc1 in) + 8sbh (fc1 out) + 8sbh (fc2 in) + sbh (mask) + 4 x 4sb (LN stats)
    + 4 b a s (lse)."""
    s, b, h, a = 1024, B, 1024, 16
    sbh = s * b * h
    assert layer_bytes(GPT) == 34 * sbh + 16 * s * b + 4 * b * a * s


def test_cpu_math_attention_keeps_s_squared_terms():
    """With dropout on CPU, SDPA runs the math path: softmax, dropout noise and dropped probabilities
    [b, a, s, s] in fp32 -- 12 b a s^2 bytes that grow quadratically."""
    fp32 = dataclasses.replace(GPT, params_dtype=torch.float32)  # no constant-size fp32 weight copies in the norms
    small = dataclasses.replace(fp32, seq_length=128, max_position_embeddings=256)
    double = dataclasses.replace(fp32, seq_length=256, max_position_embeddings=256)
    quad = lambda c: 12 * B * 16 * c.seq_length**2  # noqa: E731
    linear_small = layer_bytes(small, device="cpu") - quad(small)
    linear_double = layer_bytes(double, device="cpu") - quad(double)
    assert linear_double == 2 * linear_small
    assert resolve_kernels(small, "cpu").attention == "math"
    assert resolve_kernels(dataclasses.replace(small, attention_dropout=0.0), "cpu").attention == "flash"


def test_kernel_choices_by_device():
    """Following kernels/dispatch.py: Triton on CUDA where the kernel takes the shape and dtype
    (attention: no dropout, fp16/bf16, head dims it supports), torch otherwise; torch on CPU."""
    cpu, cuda = resolve_kernels(GPT, "cpu"), resolve_kernels(GPT, "cuda")
    assert (cpu.norm, cuda.norm) == ("torch", "triton")
    assert (cpu.attention, cuda.attention) == ("math", "flash")  # GPT has attention dropout
    assert resolve_kernels(LLAMA, "cpu").attention == "flash"
    fp32_gqa = dataclasses.replace(LLAMA, params_dtype=torch.float32)
    assert resolve_kernels(fp32_gqa, "cuda").attention == "math"
    assert (
        resolve_kernels(dataclasses.replace(GPT, params_dtype=torch.float32, attention_dropout=0.0), "cuda").attention
        == "efficient"
    )
    assert resolve_kernels(dataclasses.replace(LLAMA, normalization_impl="torch"), "cuda").norm == "torch"
    assert resolve_kernels(GPT, "cuda", attention="math").attention == "math"
    with pytest.raises(ValueError, match="attention implementation"):
        resolve_kernels(GPT, "cuda", attention="sdpa")


def _chunk_bytes(config):
    return _saved(config, n_layers=config.num_layers)


def test_full_recomputation_keeps_group_inputs_only():
    residual = S * B * H * 2
    uniform = dataclasses.replace(
        LLAMA, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
    )
    result = _chunk_bytes(uniform)
    assert result.bytes == 2 * residual  # two groups of two layers: their inputs (the first is the chunk input)
    angles = 4 * S * D  # the RoPE kernel saves the block's fp32 angles: held once in a recomputed group
    assert result.recompute_bytes == 2 * layer_bytes(LLAMA) - residual + angles  # the second layer's input recomputed
    block = dataclasses.replace(uniform, recompute_method="block", recompute_num_layers=1)
    plain = _chunk_bytes(LLAMA).bytes
    assert _chunk_bytes(block).bytes == plain - layer_bytes(LLAMA) + residual


def test_selective_recomputation_keeps_core_attention_inputs():
    """Selective: the checkpointed core attention keeps its inputs (q_rot, k_rot and v, a view that keeps
    the whole QKV output) and the projection input, nothing inside. With SDPA flash that saves the lse;
    with our Triton kernel it *costs* memory: the kernel alone keeps only contiguous q, k, v copies and the
    lse (its output stays either way, as the projection's input), while the checkpoint's inputs hold
    s b (a + g) d more (the rotated q and k next to the whole QKV output)."""
    lse = 4 * B * A * S
    for backend, saved in (("torch", lse), ("auto", lse - 2 * S * B * (A + G) * D)):
        plain = dataclasses.replace(LLAMA, attention_backend=backend)
        selective = dataclasses.replace(plain, recompute_granularity="selective")
        assert layer_bytes(plain) - layer_bytes(selective) == saved
    gpt_cpu = layer_bytes(GPT, device="cpu") - layer_bytes(
        dataclasses.replace(GPT, recompute_granularity="selective"), device="cpu"
    )
    assert gpt_cpu > 12 * B * 16 * 1024**2  # the s^2 probabilities are gone


def test_recompute_groups_follow_the_block():
    full = dataclasses.replace(LLAMA, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    assert layer_groups(full, 4) == [(0, 3, True), (3, 4, True)]
    block = dataclasses.replace(full, recompute_method="block", recompute_num_layers=1)
    assert layer_groups(block, 3) == [(0, 1, True), (1, 2, False), (2, 3, False)]
    assert layer_groups(LLAMA, 4) == [(0, 4, False)]


def test_first_and_last_stage_extras():
    """First stage: token ids. Last stage: the final norm (Triton: its input and fp32 rstd), the output
    layer's input, the cross entropy's fp32 softmax over the local vocabulary, its targets (int64) and
    out-of-range mask (bool), and the executor's fp32 loss mask."""
    middle = _saved(LLAMA).bytes
    assert _saved(LLAMA, pre=True).bytes - middle == B * S * 8
    sb, vocab = S * B, 128256
    final_norm = sb * H * 2 + sb * 4
    assert _saved(LLAMA, post=True).bytes - middle == final_norm + sb * H * 2 + sb * vocab * 4 + sb * 8 + sb + B * S * 4


@pytest.mark.parametrize("device,path", [("cuda", "triton"), ("cpu", "torch")])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_cross_entropy_keeps_no_logits(device, path, tp):
    """--cross-entropy-loss-fusion (gradients computed in the forward): the last stage keeps the output
    layer's input gradient in place of its input (the same size), the weight gradient [V/tp, h] in
    main_grad's fp32 (gradient accumulation fusion, the default) and the loss mask's fp32 weights, in
    place of the unfused path's fp32 softmax over the local vocabulary, its targets and out-of-range
    mask; both reduction paths keep the same. With the other fusions off the weight gradient is bf16."""
    fused = dataclasses.replace(LLAMA, cross_entropy_loss_fusion=True)
    assert resolve_kernels(fused, device).cross_entropy == path
    assert resolve_kernels(LLAMA, device).cross_entropy == "unfused"
    sb, vocab = S * B, 128256 // tp
    unfused = _saved(LLAMA, post=True, tp=tp, device=device).bytes
    for fusion, weight_grad_bytes in ((True, 4), (False, 2)):
        config = dataclasses.replace(fused, gradient_accumulation_fusion=fusion)
        kept = vocab * H * weight_grad_bytes + sb * 4
        assert unfused - _saved(config, post=True, tp=tp, device=device).bytes == sb * vocab * 4 + sb * 8 + sb - kept


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_under_cp(cp):
    """cp > 1, on any device or backend: the ring attention saves rotated q and k, a copy of v (not the
    view that would keep the whole QKV output alive), its own output (the projection's input is a view
    of it) and the fp32 lse of the local s/cp tokens: what torch SDPA flash keeps at s/cp, less the QKV
    output's (a + 2g) d columns, plus v's g d."""
    ring = dataclasses.replace(LLAMA, context_parallel_size=cp, attention_backend="torch")
    assert resolve_kernels(ring, "cuda").attention == "ring" == resolve_kernels(ring, "cpu").attention
    local = dataclasses.replace(LLAMA, seq_length=S // cp, attention_backend="torch")
    tokens = S // cp * B
    qkv_output, v = tokens * (A + 2 * G) * D * 2, tokens * G * D * 2
    assert layer_bytes(ring, cp=cp) == layer_bytes(local) - qkv_output + v


def test_positions_buffer_counts_once_per_rank():
    """Learned positions: the embedding saves a view of the model's positions buffer [s] (int64), the
    same storage for every microbatch, so it counts once however many microbatches are in flight."""
    chunk = _saved(GPT, pre=True)
    assert chunk.shared_bytes == 1024 * 8
    assert peaks(frozenset({((3,), 0)}), [chunk.bytes], 0, [chunk.shared_bytes]).activations_bytes == (
        3 * chunk.bytes + chunk.shared_bytes
    )
