"""The FP8 cast kernels (kernels/fp8_cast.py, run by the interpreter) against their torch references: the
same FP8 bytes, transposes and amaxes, exactly; and an FP8 linear layer's three products equal on both paths.

Odd shapes (1 x 1, widths and heights not multiples of the 64-element tile), values that saturate, that
fall in the FP8 formats' subnormal range, ties of the rounding, -0; every kernel output starts as NaN
(conftest), so an element left unwritten fails.
"""

import pytest
import torch

from kernels.fp8_cast import FP8_DTYPES, quantize, quantize_torch, tensor_amax, tensor_amax_torch
from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.tensor_parallel.initialization import InitSpec
from megatron.core.tensor_parallel.layers import linear

pytest.importorskip("triton")
SHAPES = [(1, 1), (37, 130), (65, 64), (128, 3)]


def _tensor(shape, dtype):
    """Normal values over many binades, a saturating one, FP8-subnormal ones, exact ties, -0."""
    x = torch.randn(shape) * torch.exp2(torch.randint(-12, 6, shape).float())
    flat = x.view(-1)
    specials = torch.tensor([3e4, -1e-3, 2.0**-9 * 1.5, -(2.0**-17), 17.0, -0.0, 0.0, 1e-7])
    count = min(flat.numel(), specials.numel())
    flat[:count] = specials[:count]
    return x.to(dtype)


def _bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_quantize_matches_the_torch_cast_byte_for_byte(shape, dtype, fp8, seed):
    x = _tensor(shape, dtype)
    for scale in (torch.tensor(1.0), torch.tensor(37.5), torch.tensor(2.0**-3)):
        amax, amax_ref = torch.full((1,), 0.25), torch.full((1,), 0.25)
        q, qt = quantize(x, scale, fp8, "triton", columnwise=True, amax_out=amax)
        r, rt = quantize_torch(x, scale, fp8, columnwise=True, amax_out=amax_ref)
        assert torch.equal(_bytes(q), _bytes(r)), f"scale {scale} (seed {seed})"
        assert torch.equal(_bytes(qt), _bytes(rt)) and qt.is_contiguous()
        assert torch.equal(amax, amax_ref)
    assert torch.equal(tensor_amax(x, "triton"), tensor_amax_torch(x))
    only_t = quantize(x, torch.tensor(3.0), fp8, "triton", rowwise=False, columnwise=True)
    assert only_t[0] is None and torch.equal(_bytes(only_t[1]), _bytes(quantize_torch(x, 3.0, fp8)[0].t()))


def test_quantize_refuses_what_it_cannot_cast():
    with pytest.raises(ValueError, match="contiguous 2-D"):
        quantize(torch.zeros(4, 6).t(), torch.tensor(1.0), torch.float8_e4m3fn, "triton")
    with pytest.raises(ValueError, match="casts to"):
        quantize(torch.zeros(4, 6), torch.tensor(1.0), torch.bfloat16, "triton")


class _Owner(torch.nn.Module):
    def __init__(self, out_features, in_features):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features) * 0.05)
        self.weight.init_spec = InitSpec((out_features, in_features))


def _products(recipe, impl, x, g):
    torch.manual_seed(0)
    owner = _Owner(48, 80)
    owner.fp8 = Fp8Gemms(recipe, owner, weight_group=None, activation_groups=(), expert=False, cast_impl=lambda _: impl)
    if recipe.delayed:  # past calibration: scales from amaxes, as delayed.py derives them
        owner.fp8.has_history = True
        owner.fp8_scale.copy_(torch.tensor([448.0 / 3, 448.0 / 0.2, 57344.0 / 0.01]))
        owner.fp8_scale_inv.copy_(owner.fp8_scale.reciprocal())
    x = x.clone().requires_grad_()
    y = linear(x, owner.weight, None, fp8=owner.fp8)
    y.backward(g)
    pending = owner.fp8_amax_pending.clone() if recipe.delayed else None
    return y, x.grad, owner.weight.grad, pending


@pytest.mark.parametrize("name", ["delayed", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_a_linear_layer_is_the_same_on_the_fused_casts(name, fmt):
    """Forward, dgrad and wgrad (and delayed scaling's recorded amaxes) equal on the Triton and torch casts."""
    recipe = Fp8Recipe(format=fmt, recipe=name)
    x, g = torch.randn(2, 37, 80), torch.randn(2, 37, 48) * 1e-3
    for got, want in zip(_products(recipe, "triton", x, g), _products(recipe, "torch", x, g)):
        assert (got is None and want is None) or torch.equal(got, want)
