"""FP8 block quantisation (Float8BlockScaling, DeepSeek-V3) in Triton, with its torch reference.

`quantize_blocks(x, block_rows, dtype, impl, rowwise=, columnwise=)`: x [rows, cols] (any strides: a
transposed view is read in place, no copy) cut into blocks of `block_rows` x 128 on its own grid (1 x 128
for activations and gradients, 128 x 128 for weights); each block gets the power-of-two scale of
megatron/core/fp8/scaling.py `power_of_two_scale` (the largest 2^k <= fp8_max / the block's amax, 1 for an
all-zero block) and is cast with it (saturating, round to nearest even). Returns (FP8 x or None, FP8 x^T
contiguous or None (128 x 128 blocks only: the transpose keeps their grid), scale_inv [row blocks, column
blocks] in fp32): one read of x, one write of each FP8 copy, the small grid.

Reference (`quantize_blocks_torch`): the block amaxes by torch reductions over the padded tensor, the same
scale rule and cast; the kernel's FP8 bytes and grid equal it (tests/kernels/test_fp8_blocks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_support
from .fp8_cast import FORMATS, _round_to_fp8, unsupported_reason
from .triton_support import jit, tl

BLOCK = 128  # a block's columns (the contraction dimension's 128)
ROW_TILE = 32  # rows per program for 1 x 128 blocks; not yet tuned on a GPU


MANTISSA_BITS = 0x7FFFFF  # an fp32's mantissa field
MAX_EXPONENT = 126  # scales and their inverses stay normal fp32: 2^-126 .. 2^126


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two <= fp8_max / amax (elementwise, fp32 amax; at most 2^126), 1 where amax is 0
    or not finite. Exact, without dividing: with amax = ma 2^ea and fp8_max = mf 2^ef (1 <= m < 2), the
    exponent is ef - ea, less one where mf < ma (the kernel computes it bit for bit the same way)."""
    usable = (amax > 0) & torch.isfinite(amax)
    bits = torch.where(usable, amax.float(), 1.0).view(torch.int32)
    limit = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32).view(torch.int32)
    exponent = ((limit >> 23) - (bits >> 23)) - ((limit & MANTISSA_BITS) < (bits & MANTISSA_BITS)).int()
    scale = ((exponent.clamp(-MAX_EXPONENT, MAX_EXPONENT) + 127) << 23).view(torch.float32)
    return torch.where(usable, scale, torch.ones_like(scale))


def _grid(n: int, block: int) -> int:
    return -(-n // block)


def quantize_blocks_torch(x, block_rows, dtype, *, rowwise=True, columnwise=False):
    """(FP8 x or None, FP8 x^T or None, scale_inv grid) by torch ops (module docstring)."""
    rows, cols = x.shape
    grid_r, grid_c = _grid(rows, block_rows), _grid(cols, BLOCK)
    padded = F.pad(x.detach().abs().float(), (0, grid_c * BLOCK - cols, 0, grid_r * block_rows - rows))
    scale = power_of_two_scale(padded.view(grid_r, block_rows, grid_c, BLOCK).amax(dim=(1, 3)), dtype)
    local = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    limit = torch.finfo(dtype).max
    data = (x.detach().float() * local).clamp(-limit, limit).to(dtype)
    return (data if rowwise else None), (data.t().contiguous() if columnwise else None), scale.reciprocal()


@jit
def _power_of_two_exponent(amax, LIMIT_EXPONENT: tl.constexpr, LIMIT_MANTISSA: tl.constexpr):
    """k of `power_of_two_scale`'s 2^k for an fp32 amax, bit for bit (0 where amax is 0 or not finite);
    LIMIT_*: fp8_max's exponent and mantissa fields."""
    usable = (amax > 0.0) & (amax <= 3.4028234663852886e38)  # finite (NaN compares false)
    bits = tl.where(usable, amax, 1.0).to(tl.int32, bitcast=True)
    smaller = ((bits & 0x7FFFFF) > LIMIT_MANTISSA).to(tl.int32)
    exponent = (LIMIT_EXPONENT - (bits >> 23)) - smaller
    return tl.where(usable, tl.minimum(tl.maximum(exponent, -126), 126), 0)  # MAX_EXPONENT


@jit
def _exp2(k):
    """2^k as fp32 for an integer -126 <= k <= 126 (exact: built from the exponent bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@jit
def _blocks_kernel(
    X,
    Q,
    QT,
    SCALE_INV,
    n_rows,
    n_cols,
    stride_r,
    stride_c,
    grid_cols,
    limit,
    TILE_R: tl.constexpr,
    SQUARE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    LIMIT_EXPONENT: tl.constexpr,
    LIMIT_MANTISSA: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
):
    """One program: TILE_R rows x 128 columns; SQUARE: one 128 x 128 block, else TILE_R 1 x 128 blocks."""
    rows = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(1).to(tl.int64) * 128 + tl.arange(0, 128)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    row_amax = tl.max(tl.abs(x), axis=1)
    if SQUARE:
        k = _power_of_two_exponent(tl.max(row_amax, axis=0), LIMIT_EXPONENT, LIMIT_MANTISSA)
        tl.store(SCALE_INV + tl.program_id(0) * grid_cols + tl.program_id(1), _exp2(-k))
        y = x * _exp2(k)
    else:
        k = _power_of_two_exponent(row_amax, LIMIT_EXPONENT, LIMIT_MANTISSA)
        tl.store(SCALE_INV + rows * grid_cols + tl.program_id(1), _exp2(-k), mask=rows < n_rows)
        y = x * _exp2(k)[:, None]
    y = _round_to_fp8(tl.minimum(tl.maximum(y, -limit), limit), MANTISSA, MIN_EXPONENT)
    if ROWWISE:
        tl.store(Q + rows[:, None] * n_cols + cols[None, :], y.to(Q.dtype.element_ty), mask=mask)
    if COLUMNWISE:
        tl.store(QT + cols[None, :] * n_rows + rows[:, None], y.to(QT.dtype.element_ty), mask=mask)


def _quantize_blocks_triton(x, block_rows, dtype, rowwise, columnwise):
    rows, cols = x.shape
    grid_r, grid_c = _grid(rows, block_rows), _grid(cols, BLOCK)
    data = triton_support.empty((rows, cols), dtype, x.device) if rowwise else None
    data_t = triton_support.empty((cols, rows), dtype, x.device) if columnwise else None
    scale_inv = triton_support.empty((grid_r, grid_c), torch.float32, x.device)
    if rows and cols and not triton_support.shape_only(x):
        tile = BLOCK if block_rows == BLOCK else ROW_TILE
        limit = torch.finfo(dtype).max
        limit_bits = int(torch.tensor(limit, dtype=torch.float32).view(torch.int32))
        _blocks_kernel[(_grid(rows, tile), grid_c)](
            x.detach(),
            data,
            data_t,
            scale_inv,
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            grid_c,
            limit,
            TILE_R=tile,
            SQUARE=block_rows == BLOCK,
            ROWWISE=rowwise,
            COLUMNWISE=columnwise,
            LIMIT_EXPONENT=limit_bits >> 23,
            LIMIT_MANTISSA=limit_bits & MANTISSA_BITS,
            MANTISSA=FORMATS[dtype][0],
            MIN_EXPONENT=FORMATS[dtype][1],
            num_warps=8 if tile == BLOCK else 4,  # a 128 x 128 fp32 tile over 256 threads
        )
    return data, data_t, scale_inv


def quantize_blocks(x, block_rows, dtype, impl="auto", *, rowwise=True, columnwise=False):
    """(FP8 x, FP8 x^T, scale_inv grid) of 1 x 128 (`block_rows` 1) or 128 x 128 blocks (module docstring)."""
    if x.dim() != 2 or block_rows not in (1, BLOCK) or (columnwise and block_rows != BLOCK):
        raise ValueError(
            f"quantize_blocks takes a 2-D tensor in 1x128 or 128x128 blocks (a transpose only of 128x128), "
            f"got shape {tuple(x.shape)}, {block_rows}x128, columnwise={columnwise}"
        )
    if dtype not in FORMATS:
        raise ValueError(f"quantize_blocks casts to {tuple(FORMATS)}, got {dtype}")
    if triton_support.use_triton(impl, x, unsupported_reason(x.dtype)):
        return _quantize_blocks_triton(x, block_rows, dtype, rowwise, columnwise)
    return quantize_blocks_torch(x, block_rows, dtype, rowwise=rowwise, columnwise=columnwise)
