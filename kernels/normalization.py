"""Fused RMSNorm and LayerNorm in Triton, with their torch references.

x has any leading dims and is normalised over the last dim (hidden size up to 16384); the
output has x's dtype and all arithmetic is fp32. With `residual` given, the op first forms
h = x + residual (rounded to residual's dtype, as it is stored), normalises h and returns
(out, h): the pre-norm transformer's "add, then norm" in one pass.

Kernels: one forward kernel for both norms (IS_RMS switches off the mean) with one row per
program, and one backward kernel in which each program walks a contiguous run of rows,
writing dX per row and keeping its dW/dB partial sums in registers; the partials
[programs, hidden] are then summed by torch (the second stage of the weight-grad reduction).
"""

import torch

from . import triton_support
from .triton_support import jit, tl

MAX_HIDDEN = 16384


# ----------------------------------------------------------------------------- Triton kernels
@jit
def _norm_fwd_kernel(
    X,
    RES,
    W,
    B,
    Y,
    RES_OUT,
    MEAN,
    RSTD,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = (x + tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + offs, h, mask=mask)
        x = h.to(tl.float32)  # normalise the stored (rounded) sum, which backward reads again
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, 0) / n_cols
        tl.store(MEAN + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _norm_bwd_kernel(
    X,
    W,
    DY,
    DRES,
    DX,
    MEAN,
    RSTD,
    DW_PART,
    DB_PART,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK_N: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_DRES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """dX for rows [pid * rows_per_program, ...) and this program's partial dW (and dB).

    With xhat = (x - mean) * rstd and g = w * dy:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g)), the last term only for LayerNorm.
    DRES is the gradient reaching the returned residual h; it adds straight onto dx.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 loop counter: row * n_cols may pass 2**31
    for row in range(row_start, tl.minimum(row_start + rows_per_program, n_rows)):
        offs = row * n_cols + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        g = w * dy
        dx = g - xhat * (tl.sum(g * xhat, 0) / n_cols)
        if not IS_RMS:
            dx -= tl.sum(g, 0) / n_cols
        dx *= rstd
        if HAS_DRES:
            dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, db, mask=mask)


# ----------------------------------------------------------------------------- host side
def _launch_config(n_cols):
    """(BLOCK_N, num_warps): the whole row in one tile, 16-32 values per thread.
    Not yet tuned on a GPU; the ahead-of-time compile test reports register spills."""
    block_n = max(16, 1 << (n_cols - 1).bit_length())
    return block_n, min(max(block_n // 512, 1), 16)


def _backward_programs(n_rows, device):
    """How many programs share the rows in backward: enough to fill the GPU a few times over,
    few enough that the [programs, hidden] partial sums stay small."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # interpreter: several programs so the two-stage reduction is exercised
    rows_per_program = -(-n_rows // min(target, n_rows))
    return -(-n_rows // rows_per_program), rows_per_program


def _norm_forward(x, residual, weight, bias, eps, is_rms):
    """x, residual: contiguous [rows, hidden]. Returns (y, h or None, mean or None, rstd)."""
    n_rows, n_cols = x.shape
    y = triton_support.empty(x.shape, x.dtype, x.device)
    h = None if residual is None else triton_support.empty(x.shape, residual.dtype, x.device)
    mean = None if is_rms else triton_support.empty((n_rows,), torch.float32, x.device)
    rstd = triton_support.empty((n_rows,), torch.float32, x.device)
    if triton_support.shape_only(x):
        return y, h, mean, rstd
    block_n, num_warps = _launch_config(n_cols)
    _norm_fwd_kernel[(n_rows,)](
        x,
        residual,
        weight,
        bias,
        y,
        h,
        mean,
        rstd,
        n_cols,
        eps,
        BLOCK_N=block_n,
        IS_RMS=is_rms,
        HAS_RES=residual is not None,
        HAS_BIAS=bias is not None,
        num_warps=num_warps,
    )
    return y, h, mean, rstd


def _norm_backward(x, weight, has_bias, dy, dres, mean, rstd, is_rms):
    """x: the normalised input [rows, hidden] (h when a residual was added).
    Returns (dx, dw, db or None), the weight gradients in fp32."""
    n_rows, n_cols = x.shape
    n_programs, rows_per_program = _backward_programs(n_rows, x.device)
    dx = triton_support.empty(x.shape, x.dtype, x.device)
    dw_part = triton_support.empty((n_programs, n_cols), torch.float32, x.device)
    db_part = triton_support.empty((n_programs, n_cols), torch.float32, x.device) if has_bias else None
    block_n, num_warps = _launch_config(n_cols)
    if not triton_support.shape_only(x):
        _norm_bwd_kernel[(n_programs,)](
            x,
            weight,
            dy,
            dres,
            dx,
            mean,
            rstd,
            dw_part,
            db_part,
            n_rows,
            n_cols,
            rows_per_program,
            BLOCK_N=block_n,
            IS_RMS=is_rms,
            HAS_DRES=dres is not None,
            HAS_BIAS=has_bias,
            num_warps=num_warps,
        )
    return dx, dw_part.sum(0), db_part.sum(0) if has_bias else None


class _NormFn(torch.autograd.Function):
    """(x, weight, bias, residual) -> out, or (out, h) when residual is given."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1]).contiguous()
        res2d = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
        y, h, mean, rstd = _norm_forward(x2d, res2d, weight.contiguous(), bias, eps, is_rms)
        ctx.save_for_backward(x2d if h is None else h, weight, mean, rstd)
        ctx.is_rms, ctx.x_dtype, ctx.shape = is_rms, x.dtype, shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.set_materialize_grads(False)
        return y.view(shape) if h is None else (y.view(shape), h.view(shape))

    @staticmethod
    def backward(ctx, dy, dh=None):
        normed, weight, mean, rstd = ctx.saved_tensors
        n_cols = normed.shape[-1]
        dy2d = torch.zeros_like(normed) if dy is None else dy.reshape(-1, n_cols).contiguous()
        dh2d = None if dh is None else dh.reshape(-1, n_cols).contiguous()
        has_bias = ctx.bias_dtype is not None
        dx, dw, db = _norm_backward(normed, weight, has_bias, dy2d, dh2d, mean, rstd, ctx.is_rms)
        dx = dx.view(ctx.shape)
        dres = None if ctx.residual_dtype is None else dx.to(ctx.residual_dtype)
        db = db.to(ctx.bias_dtype) if has_bias else None
        return dx.to(ctx.x_dtype), dw.to(weight.dtype), db, dres, None, None


def unsupported_reason(hidden_size, dtype):
    """Why the Triton kernels cannot take this hidden size / dtype, or None if they can."""
    if dtype not in triton_support.TRITON_DTYPES:
        return f"normalization Triton kernels support fp16, bf16 and fp32, got {dtype}"
    if hidden_size > MAX_HIDDEN:
        return f"normalization Triton kernels support hidden sizes up to {MAX_HIDDEN}, got {hidden_size}"
    return None


def norm_path(impl, device, hidden_size, dtype):
    """Start-up log line: which normalization path runs for this model."""
    return triton_support.kernel_path(impl, device, unsupported_reason(hidden_size, dtype))


def _add_residual(x, residual):
    """Reference residual add: fp32 sum rounded to the residual's dtype, as the kernel stores it."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x.to(compute) + residual.to(compute)).to(residual.dtype)


def _reference(x, residual, normalise):
    h = x if residual is None else _add_residual(x, residual)
    out = normalise(h.to(torch.promote_types(h.dtype, torch.float32))).to(x.dtype)
    return out if residual is None else (out, h)


def rms_norm_torch(x, weight, eps, residual=None):
    """Reference RMSNorm in (at least) fp32."""
    return _reference(x, residual, lambda h: torch.nn.functional.rms_norm(h, h.shape[-1:], weight.to(h.dtype), eps))


def layer_norm_torch(x, weight, bias, eps, residual=None):
    """Reference LayerNorm in (at least) fp32. torch's own LayerNorm computes in fp32 inside and rounds
    its results once, so x and the weights of one dtype go to it as they are: megatron-core's local
    spec (torch.nn.LayerNorm) then gets the same gradients, rounded the same way."""
    if residual is None and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _reference(
        x,
        residual,
        lambda h: torch.nn.functional.layer_norm(
            h, h.shape[-1:], weight.to(h.dtype), None if bias is None else bias.to(h.dtype), eps
        ),
    )


def _norm(x, weight, bias, eps, impl, residual, is_rms):
    if weight.shape != x.shape[-1:] or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"weight/bias must have shape {tuple(x.shape[-1:])}, got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if triton_support.use_triton(impl, x, unsupported_reason(x.shape[-1], x.dtype)):
        return _NormFn.apply(x, weight, bias, residual, eps, is_rms)
    if is_rms:
        return rms_norm_torch(x, weight, eps, residual)
    return layer_norm_torch(x, weight, bias, eps, residual)


def rms_norm(x, weight, eps, impl="auto", residual=None):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim; with `residual`, returns (out, x + residual)."""
    return _norm(x, weight, None, eps, impl, residual, is_rms=True)


def layer_norm(x, weight, bias, eps, impl="auto", residual=None):
    """(x - mean) * rsqrt(var + eps) * weight + bias over the last dim (bias may be None);
    with `residual`, returns (out, x + residual)."""
    return _norm(x, weight, bias, eps, impl, residual, is_rms=False)
