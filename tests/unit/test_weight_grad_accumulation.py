"""Gradient accumulation fusion of bf16 weights (tensor_parallel/weight_grads.py): the weight gradient's
products are summed in the fp32 main_grad, never rounded to bf16; unfused, the product is rounded first."""

import torch

from megatron.core.tensor_parallel.weight_grads import WeightGrad


def _accumulate(fuse: bool, grad_out, x):
    param = torch.nn.Parameter(torch.zeros(grad_out.shape[1], x.shape[1], dtype=torch.bfloat16))
    param.main_grad = torch.full(param.shape, 0.5)  # a gradient already there: added to, not replaced
    WeightGrad(param, grad_out, x, None, fuse).accumulate()
    return param.main_grad


def test_bf16_weight_gradient_is_summed_in_fp32():
    generator = torch.Generator().manual_seed(0)
    grad_out, x = (torch.randn(257, n, generator=generator).to(torch.bfloat16) for n in (12, 20))
    exact = 0.5 + grad_out.double().t() @ x.double()
    scale = exact.abs().max()
    fused, unfused = _accumulate(True, grad_out, x), _accumulate(False, grad_out, x)
    assert fused.dtype == torch.float32
    assert (fused - exact).abs().max() <= 1e-6 * scale  # fp32 sums of exact bf16 x bf16 products
    assert (unfused - exact).abs().max() > 1e-4 * scale  # the bf16 rounding of the product
