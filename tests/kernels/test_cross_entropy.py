"""The fused LM head + cross-entropy: its Triton reductions (interpreter) against the torch reference and
float64, and the chunked pass against the unfused output layer + vocab-parallel cross-entropy at odd
shapes (vocabulary not a multiple of 128, tokens not a multiple of the chunk), per-token losses and
gradients, with a loss mask, a target outside this rank's columns, and the weight gradient both through
autograd and added into an fp32 `main_grad` (with and without gradient accumulation fusion)."""

import functools

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


def _unfused(x, weight, target, mask=None):
    return vocab_parallel_cross_entropy(F.linear(x, weight), target, None, 0)


def _grads(loss_fn, x, weight, target, mask, scale=1.0):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = loss_fn(x, weight, target, mask)
    return (loss, *torch.autograd.grad((loss * mask).sum() * scale, (x, weight)))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("chunk", [None, 8, 64])  # the rule (4 tokens), 39 = 4 x 8 + 7 tokens, one chunk
def test_fused_pass_equals_unfused(impl, chunk, seed):
    s, b, h, vocab = 13, 3, 24, 200
    x, weight = torch.randn(s, b, h), 0.3 * torch.randn(vocab, h)
    target = torch.randint(0, vocab, (s, b))
    mask = (torch.rand(s, b) > 0.3).float()
    expected = _grads(_unfused, x, weight, target, mask, scale=0.37)  # the executor's 1/tokens, loss scale

    def fused(x, weight, target, mask):
        return fused_output_cross_entropy(x, weight, target, tp_group=None, impl=impl, loss_mask=mask, chunk=chunk)

    for name, got, want in zip(("loss", "dx", "dweight"), _grads(fused, x, weight, target, mask, 0.37), expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert_close(name, got, want.double(), 1e-5, seed)


@pytest.mark.parametrize("fuse", [True, False])
def test_weight_gradient_into_main_grad(fuse, seed):
    """The weight's main_grad receives the gradient (added to what it held); autograd gets none."""
    s, b, h, vocab = 9, 2, 16, 130
    x, target = torch.randn(s, b, h, requires_grad=True), torch.randint(0, vocab, (s, b))
    weight = torch.nn.Parameter(0.3 * torch.randn(vocab, h))
    weight.main_grad = torch.full((vocab, h), 0.5)
    loss = fused_output_cross_entropy(x, weight, target, tp_group=None, impl="triton", param=weight, fuse=fuse, chunk=5)
    loss.sum().backward()
    assert weight.grad is None
    _, _, want = _grads(_unfused, x, weight, target, torch.ones(s, b))
    assert_close("main_grad", weight.main_grad - 0.5, want.double(), 1e-5, seed)


def test_main_grad_over_microbatches_and_recomputation(seed):
    """Two microbatches' forwards before their backwards (a pipeline's in-flight microbatches), one
    forward run twice (recomputation: nothing is added before backward), masked losses with different
    scales: main_grad holds the sum of the unfused weight gradients, in fp32 from bf16 weights too."""
    s, b, h, vocab = 7, 2, 16, 150
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.nn.Parameter((0.3 * torch.randn(vocab, h)).to(dtype))
        weight.main_grad = torch.zeros(vocab, h)
        want = torch.zeros(vocab, h, dtype=torch.float64)
        losses = []
        for scale in (0.5, 0.25):
            x, target = torch.randn(s, b, h).to(dtype).requires_grad_(), torch.randint(0, vocab, (s, b))
            mask = (torch.rand(s, b) > 0.4).float()
            want += _grads(_unfused, x.double(), weight.double(), target, mask, scale)[2]
            fused = functools.partial(
                fused_output_cross_entropy, x, weight, target, tp_group=None, impl="triton", loss_mask=mask
            )
            fused(param=weight, fuse=True, chunk=4)  # recomputed below: its gradients are dropped with it
            losses.append((fused(param=weight, fuse=True, chunk=4) * mask).sum() * scale)
        for loss in reversed(losses):
            loss.backward()
            assert weight.grad is None  # all of it in main_grad
        assert_close(f"{dtype} main_grad", weight.main_grad, want, 1e-5 if dtype == torch.float32 else 2e-2, seed)


def test_gradient_not_proportional_to_mask_is_refused():
    x, weight = torch.randn(4, 1, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    mask = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    loss = fused_output_cross_entropy(x, weight, torch.randint(0, 20, (4, 1)), tp_group=None, impl="torch")
    with pytest.raises(RuntimeError, match="one scalar times the loss_mask"):
        (loss * mask).sum().backward()  # the mask was not passed to the forward


def test_bf16_tracks_unfused(seed):
    s, b, h, vocab = 11, 2, 32, 300
    x, weight = torch.randn(s, b, h).bfloat16(), (0.3 * torch.randn(vocab, h)).bfloat16()
    target, mask = torch.randint(0, vocab, (s, b)), torch.ones(s, b)
    expected = _grads(_unfused, x, weight, target, mask)

    def fused(x, weight, target, mask):
        return fused_output_cross_entropy(x, weight, target, tp_group=None, impl="triton", chunk=6)

    for name, got, want in zip(("loss", "dx", "dweight"), _grads(fused, x, weight, target, mask), expected):
        assert got.dtype == want.dtype, name
        assert_close(name, got, want.double(), TOL[torch.bfloat16], seed)


def test_chunk_rule():
    assert chunk_tokens(8192, 4096, 128256) == 2048  # Llama-3-8B, tp 1: 2092 rounded down to whole 128-row tiles
    assert chunk_tokens(39, 24, 200) == 37
    assert chunk_tokens(10, 8, 1000) == 1
    assert chunk_tokens(10, 1000, 8) == 10  # never more than the tokens
