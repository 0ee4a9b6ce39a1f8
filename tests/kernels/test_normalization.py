"""RMSNorm / LayerNorm: the Triton kernels (run by the interpreter, TRITON_INTERPRET=1 from
conftest) against the torch reference in float64.

Inputs are fresh random tensors each run; the seed is in every failure message. Every kernel
output buffer, including the per-program weight-gradient partials, starts as NaN (the
allocator is patched), so an element a kernel fails to write fails the comparison.
"""

import pytest
import torch

from kernels import normalization as nm
from tests.kernels.checks import TOL, assert_close

pytest.importorskip("triton")
EPS = 1e-5


def run_norm(kind, impl, x, weight, bias, residual):
    """Call the op (impl given) or its torch reference (impl None); always returns a tuple of outputs."""
    if kind == "rms":
        out = (
            nm.rms_norm(x, weight, EPS, impl=impl, residual=residual)
            if impl
            else nm.rms_norm_torch(x, weight, EPS, residual=residual)
        )
    else:
        out = (
            nm.layer_norm(x, weight, bias, EPS, impl=impl, residual=residual)
            if impl
            else nm.layer_norm_torch(x, weight, bias, EPS, residual=residual)
        )
    return out if isinstance(out, tuple) else (out,)


def check_against_float64(kind, shape, dtype, residual_dtype, seed, weight_dtype=None):
    hidden = shape[-1]
    inputs = dict(
        x=torch.randn(shape, dtype=dtype, requires_grad=True),
        weight=(1 + 0.5 * torch.randn(hidden, dtype=weight_dtype or dtype)).requires_grad_(),
        bias=torch.randn(hidden, dtype=weight_dtype or dtype, requires_grad=True) if kind == "layer_bias" else None,
        residual=None if residual_dtype is None else torch.randn(shape, dtype=residual_dtype, requires_grad=True),
    )
    ref_inputs = {k: None if t is None else t.detach().double().requires_grad_() for k, t in inputs.items()}
    names = ["out", "residual_out"][: 1 + (residual_dtype is not None)]
    names += ["d" + k for k, t in inputs.items() if t is not None]

    outs = run_norm(kind, "triton", **inputs)
    out_grads = [torch.randn_like(o) for o in outs]
    leaves = [t for t in inputs.values() if t is not None]
    grads = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, out_grads)), leaves)
    ref_outs = run_norm(kind, None, **ref_inputs)
    ref_leaves = [t for t in ref_inputs.values() if t is not None]
    ref_grads = torch.autograd.grad(sum((o * g.double()).sum() for o, g in zip(ref_outs, out_grads)), ref_leaves)

    assert [o.dtype for o in outs] == [dtype, residual_dtype][: len(outs)]
    for name, actual, expected in zip(names, (*outs, *grads), (*ref_outs, *ref_grads)):
        assert actual.shape == expected.shape, name
        assert_close(f"{kind} {name}", actual, expected, TOL[dtype], seed)


KINDS = ["rms", "layer", "layer_bias"]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_norm_matches_float64_reference(dtype, kind, with_residual, seed):
    """Ragged hidden size (300, tile 512) and 111 rows over 4 backward programs of 28 rows."""
    check_against_float64(kind, (3, 37, 300), dtype, dtype if with_residual else None, seed)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_activations_with_fp32_residual_stream_and_weights(kind, seed):
    check_against_float64(kind, (2, 5, 1024), torch.bfloat16, torch.float32, seed, weight_dtype=torch.float32)


@pytest.mark.parametrize("shape", [(1, 16), (7, 1000)], ids=str)
def test_tiny_and_few_row_shapes(shape, seed):
    """Fewer rows than backward programs, and the smallest tile."""
    check_against_float64("layer_bias", shape, torch.float32, torch.float32, seed)


def test_residual_gradients_do_not_alias():
    x = torch.randn(4, 64, requires_grad=True)
    residual = torch.randn(4, 64, requires_grad=True)
    out, h = nm.rms_norm(x, torch.ones(64), EPS, impl="triton", residual=residual)
    (out.sum() + h.sum()).backward()
    torch.testing.assert_close(x.grad, residual.grad)
    before = residual.grad.clone()
    x.grad.add_(1.0)
    torch.testing.assert_close(residual.grad, before)


def test_unsupported_hidden_size_is_refused_by_triton_and_routed_to_torch_by_auto():
    x, w = torch.randn(2, nm.MAX_HIDDEN + 1), torch.ones(nm.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="up to 16384"):
        nm.rms_norm(x, w, EPS, impl="triton")
    assert nm.rms_norm(x, w, EPS, impl="auto").shape == x.shape
    assert "up to 16384" in nm.norm_path("auto", "cuda", nm.MAX_HIDDEN + 1, torch.bfloat16)
    assert nm.norm_path("auto", "cuda", 4096, torch.bfloat16) == "triton"


def test_impl_strings_and_shapes_are_validated():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="impl must be one of"):
        nm.layer_norm(x, torch.ones(8), None, EPS, impl="apex")
    with pytest.raises(ValueError, match="weight/bias must have shape"):
        nm.rms_norm(x, torch.ones(4), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        nm.rms_norm(x, torch.ones(8), EPS, residual=torch.randn(2, 4))
