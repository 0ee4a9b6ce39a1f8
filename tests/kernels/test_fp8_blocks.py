"""The FP8 block quantisation kernel (kernels/fp8_blocks.py, run by the interpreter) against its torch
reference: the same FP8 bytes, transposes and scale grids, exactly; and against the per-element block
cast of megatron/core/fp8/scaling.py that the tensor-parallel pieces use (the same values where blocks
are whole).

Odd shapes (partial blocks at both edges), a transposed view read in place, an all-zero block, blocks
over many binades, saturating values; every kernel output starts as NaN (conftest)."""

import pytest
import torch

from kernels.fp8_blocks import BLOCK, power_of_two_scale, quantize_blocks, quantize_blocks_torch
from megatron.core.fp8 import scaling

pytest.importorskip("triton")
SHAPES = [(1, 1), (37, 130), (129, 256), (300, 200)]


def _tensor(shape, dtype):
    x = torch.randn(shape) * torch.exp2(torch.randint(-20, 10, (shape[0], 1)).float())
    x[: min(shape[0], 3), : min(shape[1], 128)] = 0.0  # a block (or rows) all zero: scale 1
    x.view(-1)[-1] = 3e4
    return x.to(dtype)


def _bytes(t):
    return None if t is None else t.view(torch.uint8)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_rows", [1, BLOCK], ids=["1x128", "128x128"])
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2)])
def test_block_quantize_matches_the_torch_reference(shape, block_rows, dtype, fp8, seed):
    x = _tensor(shape, dtype)
    columnwise = block_rows == BLOCK
    for view in (x, x.t()):  # a transposed view is read in place
        got = quantize_blocks(view, block_rows, fp8, "triton", columnwise=columnwise)
        want = quantize_blocks_torch(view, block_rows, fp8, columnwise=columnwise)
        assert torch.equal(_bytes(got[0]), _bytes(want[0])), f"seed {seed}"
        assert (got[1] is None) == (not columnwise) and (got[1] is None or torch.equal(_bytes(got[1]), _bytes(want[1])))
        assert torch.equal(got[2], want[2])
    # where blocks are whole pieces of the tensor, scaling.py's per-element block cast gives the same
    rows, cols = torch.arange(shape[0]), torch.arange(shape[1])
    data, scale_inv = scaling.quantize_blocks(x, rows, cols, (block_rows, BLOCK), shape, fp8)
    assert torch.equal(_bytes(data), _bytes(want_full := quantize_blocks_torch(x, block_rows, fp8)[0]))
    grid = quantize_blocks_torch(x, block_rows, fp8)[2]
    expanded = grid.repeat_interleave(block_rows, 0)[: shape[0]].repeat_interleave(BLOCK, 1)[:, : shape[1]]
    assert torch.equal(scale_inv, expanded) and want_full.dtype == fp8


def test_power_of_two_scale_is_the_largest_power_of_two_below_the_limit():
    amax = torch.rand(10000) * torch.exp2(torch.randint(-40, 40, (10000,)).float())
    scale = power_of_two_scale(amax, torch.float8_e4m3fn)
    assert (amax * scale <= 448.0).all() and (amax * scale * 2 > 448.0).all()
    special = power_of_two_scale(torch.tensor([0.0, float("inf"), float("nan"), 448.0]), torch.float8_e4m3fn)
    assert special.tolist() == [1.0, 1.0, 1.0, 1.0]
