"""The fused LM head + cross-entropy: its Triton reductions (interpreter) against the torch reference and
float64, and the chunked pass against the unfused output layer + vocab-parallel cross-entropy at odd
shapes (vocabulary not a multiple of 128, tokens not a multiple of the chunk), per-token losses and
gradients, with a loss mask, a target outside this rank's columns, and the weight gradient both through
autograd and added into an fp32 `main_grad` (with and without gradient accumulation fusion)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cross_entropy as ce
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import chunk_tokens, fused_output_cross_entropy
from tests.kernels.checks import TOL, assert_close

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,vocab", [(7, 77), (5, 1500)])  # one vocabulary block, and two (BLOCK_V 1024)
def test_reductions_match_float64(tokens, vocab, dtype, seed):
    logits = (3 * torch.randn(tokens, vocab)).to(dtype)
    vocab_start = 40  # targets below it belong to another rank: target logit 0, no one-hot
    target = torch.randint(0, vocab_start + vocab, (tokens,))
    target[0] = vocab_start - 1
    exact = logits.double()
    expected = ce.logit_statistics_torch(exact, target, vocab_start)
    for impl in ("triton", "torch"):
        for name, got, want in zip(
            ("max", "sum_exp", "target_logit"), ce.logit_statistics(logits, target, 40, impl), expected
        ):
            assert got.dtype == torch.float32
            assert_close(f"{impl} {name}", got, want, 1e-6, seed)
    lse = (expected[1].log() + expected[0]).float()
    grad_loss = torch.rand(tokens)
    grad_loss[1] = 0.0  # a masked token
    want = ce.logit_gradient_torch(exact.clone(), target, vocab_start, lse.double(), grad_loss.double())
    for impl in ("triton", "torch"):
        got = ce.logit_gradient(logits.clone(), target, vocab_start, lse, grad_loss, impl)
        assert got.dtype == dtype and not got[1].any()
        assert_close(f"{impl} gradient", got, want, TOL[dtype] if dtype != torch.float32 else 1e-6, seed)


def _unfused(x, weight, target):
    return vocab_parallel_cross_entropy(F.linear(x, weight), target, None, 0)


def _grads(loss_fn, x, weight, target, mask):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = loss_fn(x, weight, target)
    return (loss, *torch.autograd.grad((loss * mask).sum(), (x, weight)))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("chunk", [None, 8, 64])  # the rule (4 tokens), 39 = 4 x 8 + 7 tokens, one chunk
def test_fused_pass_equals_unfused(impl, chunk, seed):
    s, b, h, vocab = 13, 3, 24, 200
    x, weight = torch.randn(s, b, h), 0.3 * torch.randn(vocab, h)
    target = torch.randint(0, vocab, (s, b))
    mask = (torch.rand(s, b) > 0.3).float()
    expected = _grads(_unfused, x, weight, target, mask)

    def fused(x, weight, target):
        return fused_output_cross_entropy(x, weight, target, tp_group=None, impl=impl, chunk=chunk)

    for name, got, want in zip(("loss", "dx", "dweight"), _grads(fused, x, weight, target, mask), expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert_close(name, got, want.double(), 1e-5, seed)


@pytest.mark.parametrize("fuse", [True, False])
def test_weight_gradient_into_main_grad(fuse, seed):
    """The weight's main_grad receives the gradient (added to what it held); autograd gets the placeholder."""
    s, b, h, vocab = 9, 2, 16, 130
    x, target = torch.randn(s, b, h, requires_grad=True), torch.randint(0, vocab, (s, b))
    weight = torch.nn.Parameter(0.3 * torch.randn(vocab, h))
    weight.main_grad = torch.full((vocab, h), 0.5)
    loss = fused_output_cross_entropy(x, weight, target, tp_group=None, impl="triton", param=weight, fuse=fuse, chunk=5)
    loss.sum().backward()
    assert weight.grad_added_to_main_grad
    _, _, want = _grads(_unfused, x, weight, target, torch.ones(s, b))
    assert_close("main_grad", weight.main_grad - 0.5, want.double(), 1e-5, seed)


def test_bf16_tracks_unfused(seed):
    s, b, h, vocab = 11, 2, 32, 300
    x, weight = torch.randn(s, b, h).bfloat16(), (0.3 * torch.randn(vocab, h)).bfloat16()
    target, mask = torch.randint(0, vocab, (s, b)), torch.ones(s, b)
    expected = _grads(_unfused, x, weight, target, mask)

    def fused(x, weight, target):
        return fused_output_cross_entropy(x, weight, target, tp_group=None, impl="triton", chunk=6)

    for name, got, want in zip(("loss", "dx", "dweight"), _grads(fused, x, weight, target, mask), expected):
        assert got.dtype == want.dtype, name
        assert_close(name, got, want.double(), TOL[torch.bfloat16], seed)


def test_chunk_rule():
    assert chunk_tokens(8192, 4096, 128256) == 256  # Llama-3-8B, tp 1: 261 rounded down to whole 128-row tiles
    assert chunk_tokens(39, 24, 200) == 4
    assert chunk_tokens(10, 8, 1000) == 1
    assert chunk_tokens(10, 1000, 8) == 10  # never more than the tokens
