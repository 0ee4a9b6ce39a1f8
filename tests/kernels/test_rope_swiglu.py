"""RoPE and SwiGLU: the Triton kernels (run by the interpreter, TRITON_INTERPRET=1 from conftest)
against their torch references evaluated in float64, forward and backward.

Odd shapes: head dims 80 and 96 (tile 128), a quarter and a half of the channels rotating,
grouped-query heads (6 q, 2 k, over two head blocks of q), q and k strided views of one fused
QKV tensor; SwiGLU widths that are not a multiple of the column block, with and without bias.
Every kernel output starts as NaN (conftest), so an element left unwritten fails.
"""

import pytest
import torch

from kernels import rope as rp
from kernels import swiglu as sg
from megatron.core.transformer.rotary import rotary_frequencies
from tests.kernels.checks import TOL, assert_close

pytest.importorskip("triton")
DTYPES = [torch.float32, torch.bfloat16]


def _grads(outs, leaves, out_grads):
    return torch.autograd.grad(sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, out_grads)), leaves)


def _qk(s, b, q_heads, k_heads, head_dim, dtype):
    """q and k as the attention layer makes them: views of one [s, b, groups, heads + 2, d] QKV output."""
    per_group = q_heads // k_heads
    qkv = torch.randn(s, b, k_heads, per_group + 2, head_dim, dtype=dtype, requires_grad=True)
    return qkv, qkv[:, :, :, :per_group].reshape(s, b, q_heads, head_dim), qkv[:, :, :, -2]


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(80, 80), (96, 48), (80, 20)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_matches_float64_reference(dtype, head_dim, rotary_dim, interleaved, seed):
    s, b = 7, 3
    qkv, q, k = _qk(s, b, 12, 2, head_dim, dtype)
    # Llama-3 scaled frequencies of positions that are not 0..s-1 (a context-parallel rank's chunks)
    table = rotary_frequencies(4 * s, rotary_dim, 500000.0, interleaved=interleaved, scaling_factor=8.0)
    angles = table[torch.randperm(4 * s)[:s]]
    q_out, k_out = rp.rope(q, k, angles, interleaved, impl="triton")
    assert q_out.dtype == k_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    out_grads = [torch.randn(t.shape, dtype=torch.float64) for t in (q_out, k_out)]
    (grad,) = _grads((q_out, k_out), [qkv], out_grads)

    ref_qkv = qkv.detach().double().requires_grad_()
    ref_q = ref_qkv[:, :, :, :6].reshape(s, b, 12, head_dim)
    ref_outs = rp.rope_torch(ref_q, ref_qkv[:, :, :, -2], angles.double(), interleaved)
    (ref_grad,) = _grads(ref_outs, [ref_qkv], out_grads)
    for name, actual, expected in (("q", q_out, ref_outs[0]), ("k", k_out, ref_outs[1]), ("dqkv", grad, ref_grad)):
        assert_close(f"rope {name}", actual, expected, TOL[dtype], seed)


def test_rope_per_sample_angles_and_one_output_used(seed):
    """angles [s, b, 1, r] (--reset-position-ids: each sample its own positions); a gradient for q only."""
    q, k = torch.randn(5, 2, 4, 16, requires_grad=True), torch.randn(5, 2, 4, 16, requires_grad=True)
    angles = rotary_frequencies(9, 16, 10000.0)[torch.randint(0, 9, (5, 2)), 0]
    q_out, _ = rp.rope(q, k, angles, impl="triton")
    (grad,) = torch.autograd.grad(q_out.sum(), [q])
    ref_q = q.detach().double().requires_grad_()
    ref_out = rp.apply_rotary(ref_q, angles.double())
    (ref_grad,) = torch.autograd.grad(ref_out.sum(), [ref_q])
    assert_close("q", q_out, ref_out, TOL[torch.float32], seed)
    assert_close("dq", grad, ref_grad, TOL[torch.float32], seed)


def test_rope_refuses_bad_shapes_and_routes_unsupported_to_torch():
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="angles"):
        rp.rope(q, q, torch.zeros(3, 1, 1, 8))
    with pytest.raises(ValueError, match="rotary dim 5"):
        rp.rope(q, q, torch.zeros(4, 1, 1, 5), impl="triton")
    double = q.double()  # no kernel for float64: 'auto' runs the reference
    torch.testing.assert_close(
        rp.rope(double, double, torch.ones(4, 1, 1, 8).double())[0],
        rp.apply_rotary(double, torch.ones(4, 1, 1, 8).double()),
    )


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("width", [80, 1500], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_matches_float64_reference(dtype, width, with_bias, seed):
    """Width 1500: two column blocks of 1024, the second ragged; 3 x 7 rows."""
    h = torch.randn(3, 7, 2 * width, dtype=dtype, requires_grad=True)
    bias = torch.randn(2 * width, dtype=dtype, requires_grad=True) if with_bias else None
    leaves = [h] + ([bias] if with_bias else [])
    out = sg.swiglu(h, bias, impl="triton")
    assert out.dtype == dtype and out.shape == (3, 7, width)
    out_grad = torch.randn(out.shape, dtype=torch.float64)
    grads = _grads([out], leaves, [out_grad])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = sg.swiglu_torch(*ref_leaves) if with_bias else sg.swiglu_torch(ref_leaves[0])
    ref_grads = _grads([ref_out], ref_leaves, [out_grad])
    assert_close("swiglu out", out, ref_out, TOL[dtype], seed)
    for name, actual, expected in zip(("dh", "dbias"), grads, ref_grads):
        assert_close(f"swiglu {name}", actual, expected, TOL[dtype], seed)


def test_swiglu_refuses_bad_shapes():
    with pytest.raises(ValueError, match="even width"):
        sg.swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="bias"):
        sg.swiglu(torch.randn(2, 6), torch.randn(4))
