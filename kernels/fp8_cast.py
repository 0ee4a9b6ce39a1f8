"""FP8 casts with a per-tensor scale, fused, in Triton, with their torch references (megatron/core/fp8/).

`tensor_amax(x, impl)`: max |x| in fp32 (a 0-d tensor), one read of x (current scaling's first pass).
`quantize(x, scale, dtype, impl, rowwise=, columnwise=, amax_out=)`: one read of the 2-D x [rows, cols]:
saturate(x * scale) in the FP8 `dtype` written row-major (`rowwise`, the [rows, cols] operand) and/or
transposed (`columnwise`, [cols, rows] contiguous: the operand the backward's GEMMs take, so no
transposing copy follows), and with `amax_out` (a 1-element fp32 tensor) max |x| folded into it
(delayed scaling's record of the tensor's amax for the history), all in the same pass. `scale` is a
1-element fp32 tensor on x's device (no host sync).

Reference: the torch ops of megatron/core/fp8/scaling.py (`amax`, `cast`), the transposed copy by
`.t().contiguous()`. The kernels compute the same fp32 product x * scale, clamp it to +-fp8_max and round
to nearest even once, so their FP8 bytes equal the reference's (tests/kernels/test_fp8_cast.py); a max is
exact in any order, so the amaxes are equal too.
"""

from __future__ import annotations

import torch

from . import triton_support
from .triton_support import jit, tl

AMAX_BLOCK = 4096  # elements per program of the amax reduction; not yet tuned on a GPU
TILE = 64  # a cast program's [TILE, TILE] tile (square so the transposed store is a tile too); not tuned
# each FP8 format's (mantissa bits, smallest normal exponent)
FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
FP8_DTYPES = tuple(FORMATS)


def unsupported_reason(dtype: torch.dtype) -> str | None:
    """Why the kernels cannot cast inputs of `dtype`, or None."""
    if dtype not in triton_support.TRITON_DTYPES:
        return f"dtype {dtype} (the FP8 cast kernels take fp16, bf16, fp32)"
    return None


# ----------------------------------------------------------------------------- torch references
def tensor_amax_torch(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float()


def quantize_torch(x, scale, dtype, *, rowwise=True, columnwise=False, amax_out=None):
    """(FP8 x or None, its transpose or None), as the module docstring says, by torch ops."""
    if amax_out is not None:
        torch.maximum(amax_out, tensor_amax_torch(x), out=amax_out)
    limit = torch.finfo(dtype).max
    data = (x.detach().float() * scale).clamp(-limit, limit).to(dtype)
    return (data if rowwise else None), (data.t().contiguous() if columnwise else None)


# ----------------------------------------------------------------------------- Triton kernels
@jit
def _round_to_fp8(y, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """y (fp32, within the format's range) rounded to nearest even on the FP8 format's grid, in fp32: the
    cast after it is exact, so every backend converts the same way (the interpreter's own fp8 conversion
    does not round to nearest even)."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step_exponent = tl.maximum(exponent, MIN_EXPONENT) - MANTISSA  # the grid's spacing at y: 2^step_exponent
    quantum = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(y) * ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)  # exact: powers of two
    steps = (steps + 12582912.0) - 12582912.0  # round to nearest even (steps < 2^22): 1.5 x 2^23 added
    magnitude = (steps * quantum).to(tl.int32, bitcast=True)
    return (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign, -0 included


@jit
def _amax_kernel(X, AMAX, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(AMAX, tl.max(tl.abs(x), axis=0))


@jit
def _quantize_kernel(
    X,
    SCALE,
    Q,
    QT,
    AMAX,
    n_rows,
    n_cols,
    limit,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    RECORD: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(1).to(tl.int64) * TILE_C + tl.arange(0, TILE_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if RECORD:
        tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    y = tl.minimum(tl.maximum(x * tl.load(SCALE), -limit), limit)
    y = _round_to_fp8(y, MANTISSA, MIN_EXPONENT)
    if ROWWISE:
        tl.store(Q + rows[:, None] * n_cols + cols[None, :], y.to(Q.dtype.element_ty), mask=mask)
    if COLUMNWISE:
        tl.store(QT + cols[None, :] * n_rows + rows[:, None], y.to(QT.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side
def _tensor_amax_triton(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    flat = x.detach().contiguous().view(-1)
    if flat.numel() and not triton_support.shape_only(x):
        _amax_kernel[(triton_support.triton.cdiv(flat.numel(), AMAX_BLOCK),)](flat, out, flat.numel(), BLOCK=AMAX_BLOCK)
    return out


def _quantize_triton(x, scale, dtype, rowwise, columnwise, amax_out):
    rows, cols = x.shape
    q = triton_support.empty((rows, cols), dtype, x.device) if rowwise else None
    qt = triton_support.empty((cols, rows), dtype, x.device) if columnwise else None
    if rows and cols and not triton_support.shape_only(x):
        cdiv = triton_support.triton.cdiv
        _quantize_kernel[(cdiv(rows, TILE), cdiv(cols, TILE))](
            x.detach(),
            scale,
            q,
            qt,
            amax_out,
            rows,
            cols,
            torch.finfo(dtype).max,
            TILE_R=TILE,
            TILE_C=TILE,
            ROWWISE=rowwise,
            COLUMNWISE=columnwise,
            RECORD=amax_out is not None,
            MANTISSA=FORMATS[dtype][0],
            MIN_EXPONENT=FORMATS[dtype][1],
        )
    return q, qt


def tensor_amax(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """max |x| in fp32, a 0-d tensor on x's device: the Triton reduction or the torch ops by `impl`."""
    if triton_support.use_triton(impl, x, unsupported_reason(x.dtype)):
        return _tensor_amax_triton(x)
    return tensor_amax_torch(x)


def quantize(x, scale, dtype, impl="auto", *, rowwise=True, columnwise=False, amax_out=None):
    """(FP8 x or None, FP8 x^T contiguous or None) in one pass (module docstring); `impl` picks the kernel
    or `quantize_torch`."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"quantize takes a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantize casts to {FP8_DTYPES}, got {dtype}")
    if triton_support.use_triton(impl, x, unsupported_reason(x.dtype)):
        return _quantize_triton(x, scale.reshape(1), dtype, rowwise, columnwise, amax_out)
    return quantize_torch(x, scale, dtype, rowwise=rowwise, columnwise=columnwise, amax_out=amax_out)
