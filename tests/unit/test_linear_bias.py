"""tensor_parallel/layers.py `add_bias`: the bias added to the rounded product (megatron-core's order), in place
where that changes no dtype, with the values and gradients of the out-of-place sum."""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import add_bias, linear


def _inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((6, 2, 16), (12, 16), (12,)))
    return x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()


def test_bias_in_place_matches_the_out_of_place_sum():
    for dtype in (torch.float32, torch.bfloat16):
        x, weight, bias = _inputs(dtype)
        expected = F.linear(x, weight) + bias
        grad = torch.randn(expected.shape).to(dtype)
        expected_grads = torch.autograd.grad(expected, (x, weight, bias), grad)
        y = linear(x, weight, bias)
        assert torch.equal(y, expected)
        for got, want in zip(torch.autograd.grad(y, (x, weight, bias), grad), expected_grads):
            assert torch.equal(got, want)


def test_bias_reuses_the_product_unless_the_dtype_or_a_view_forbids_it():
    x, weight, bias = _inputs(torch.bfloat16)
    product = F.linear(x, weight)
    assert add_bias(product, bias).data_ptr() == product.data_ptr()
    product = F.linear(x, weight)
    promoted = add_bias(product, bias.float())  # a bf16 product with an fp32 bias: the sum is fp32, as `+` makes it
    assert promoted.dtype == torch.float32 and torch.equal(promoted, product + bias.float())
    view = F.linear(x, weight).view(12, 12)
    assert add_bias(view, bias).data_ptr() != view.data_ptr()
    assert add_bias(product, None) is product
