"""SwiGLU, optionally with the bias of the projection before it, in Triton, with its torch reference.

`swiglu(h, bias, impl)`: h [..., 2f] holds [gate | up] (the stacked fc1 output, each tp rank its
own matching halves), `bias` [2f] or None; returns silu(gate + b_gate) * (up + b_up) [..., f] in
h's dtype. Megatron fuses the same (its bias-SwiGLU fusion) so the biased input and silu(gate)
are never stored: the kernel's backward recomputes them from h and the bias, the only tensors it
saves.

Reference (`swiglu_torch`): the plain torch ops, each rounded to h's dtype. Kernel: fp32
arithmetic, one rounding per output. Each program takes a tile of rows and up to 1024 columns; backward
writes d[gate | up] per row, and the bias gradient is its sum over rows (in fp32, by torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_support
from .triton_support import jit, tl

BLOCK_COLUMNS = 1024
TILE_ELEMENTS = 4096  # a program's [rows, columns] tile; not yet tuned on a GPU


def unsupported_reason(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take inputs of `dtype`, or None (any width: columns are tiled)."""
    if dtype not in triton_support.TRITON_DTYPES:
        return f"dtype {dtype} (the SwiGLU kernel takes fp16, bf16, fp32)"
    return None


def swiglu_torch(h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of h (+ bias), in h's dtype."""
    if bias is not None:
        h = h + bias
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- Triton kernels
@jit
def _tile(n_rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows and columns of the output [rows, width], and their mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows[:, None], cols[None, :], (rows < n_rows)[:, None] & (cols < width)[None, :]


@jit
def _load_halves(H, BIAS, rows, cols, mask, width, HAS_BIAS: tl.constexpr):
    """The tile's gate and up columns, bias added, in fp32."""
    offs = rows * 2 * width + cols
    gate = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(H + offs + width, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        col_mask = cols < width
        gate += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
        up += tl.load(BIAS + width + cols, mask=col_mask, other=0.0).to(tl.float32)
    return gate, up


@jit
def _swiglu_fwd_kernel(H, BIAS, Y, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows, cols, mask = _tile(n_rows, width, BLOCK_R, BLOCK_C)
    gate, up = _load_halves(H, BIAS, rows, cols, mask, width, HAS_BIAS)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + rows * width + cols, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(
    H, BIAS, DY, DH, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """d gate = dy * up * silu'(gate), silu'(g) = sig(g) (1 + g (1 - sig(g))); d up = dy * silu(gate)."""
    rows, cols, mask = _tile(n_rows, width, BLOCK_R, BLOCK_C)
    gate, up = _load_halves(H, BIAS, rows, cols, mask, width, HAS_BIAS)
    dy = tl.load(DY + rows * width + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dy * gate * sig
    offs = rows * 2 * width + cols
    tl.store(DH + offs, d_gate.to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + offs + width, d_up.to(DH.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side
def _launch(kernel, n_rows, width, *args):
    """Tiles of up to TILE_ELEMENTS: up to BLOCK_COLUMNS columns, as many rows as fill the rest."""
    cdiv, next_power_of_2 = triton_support.triton.cdiv, triton_support.triton.next_power_of_2
    block_c = min(BLOCK_COLUMNS, next_power_of_2(width))
    block_r = max(1, min(TILE_ELEMENTS // block_c, next_power_of_2(n_rows)))
    grid = (cdiv(n_rows, block_r), cdiv(width, block_c))
    kernel[grid](*args, n_rows, width, BLOCK_R=block_r, BLOCK_C=block_c, HAS_BIAS=args[1] is not None)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias):
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        width = h.shape[-1] // 2
        y = triton_support.empty((*h.shape[:-1], width), h.dtype, h.device)
        ctx.save_for_backward(h2, bias)
        ctx.input_shape = h.shape
        if not triton_support.shape_only(h) and h2.shape[0]:
            _launch(_swiglu_fwd_kernel, h2.shape[0], width, h2, bias, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        h2, bias = ctx.saved_tensors
        width = h2.shape[1] // 2
        dh = triton_support.empty(h2.shape, h2.dtype, h2.device)
        if not triton_support.shape_only(h2) and h2.shape[0]:
            _launch(_swiglu_bwd_kernel, h2.shape[0], width, h2, bias, dy.reshape(-1, width).contiguous(), dh)
        d_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            d_bias = dh.sum(0, dtype=torch.float32).to(bias.dtype)
        return dh.view(ctx.input_shape), d_bias


def swiglu(h: torch.Tensor, bias: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """silu(gate + b_gate) * (up + b_up) (module docstring); the Triton kernel or `swiglu_torch` by `impl`."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu needs [gate | up] of even width, got {h.shape[-1]}")
    if bias is not None and bias.shape != (h.shape[-1],):
        raise ValueError(f"swiglu bias {tuple(bias.shape)} must be [{h.shape[-1]}]")
    if not triton_support.use_triton(impl, h, unsupported_reason(h.dtype)):
        return swiglu_torch(h, bias)
    return _SwiGLU.apply(h, bias)
