"""SwiGLU, optionally with the bias of the projection before it, in Triton, with its torch reference.

`swiglu(h, bias, impl)`: h [..., 2f] holds [gate | up] (the stacked fc1 output, each tp rank its
own matching halves), `bias` [2f] or None; returns silu(gate + b_gate) * (up + b_up) [..., f] in
h's dtype. Megatron fuses the same (its bias-SwiGLU fusion) so the biased input and silu(gate)
are never stored: the kernel's backward recomputes them from h and the bias, the only tensors it
saves.

Reference (`swiglu_torch`): the plain torch ops, each rounded to h's dtype. Kernel: fp32
arithmetic, one rounding per output. One program per row and block of f columns; backward
writes d[gate | up] per row, and the bias gradient is its sum over rows (in fp32, by torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_support
from .triton_support import jit, tl

BLOCK_COLUMNS = 1024


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
def _load_halves(H, BIAS, row, cols, mask, width, HAS_BIAS: tl.constexpr):
    """One row's gate and up columns `cols`, bias added, in fp32."""
    offs = row * 2 * width + cols
    gate = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(H + offs + width, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(BIAS + width + cols, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@jit
def _swiglu_fwd_kernel(H, BIAS, Y, width, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate, up = _load_halves(H, BIAS, row, cols, mask, width, HAS_BIAS)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + row * width + cols, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(H, BIAS, DY, DH, width, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """d gate = dy * up * silu'(gate), silu'(g) = sig(g) (1 + g (1 - sig(g))); d up = dy * silu(gate)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate, up = _load_halves(H, BIAS, row, cols, mask, width, HAS_BIAS)
    dy = tl.load(DY + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dy * gate * sig
    offs = row * 2 * width + cols
    tl.store(DH + offs, d_gate.to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + offs + width, d_up.to(DH.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side
def _grid(rows, width):
    block = min(BLOCK_COLUMNS, triton_support.triton.next_power_of_2(width))
    return (rows, triton_support.triton.cdiv(width, block)), block


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias):
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        width = h.shape[-1] // 2
        y = triton_support.empty((*h.shape[:-1], width), h.dtype, h.device)
        ctx.save_for_backward(h2, bias)
        ctx.input_shape = h.shape
        if not triton_support.shape_only(h) and h2.shape[0]:
            grid, block = _grid(h2.shape[0], width)
            _swiglu_fwd_kernel[grid](h2, bias, y, width, BLOCK=block, HAS_BIAS=bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        h2, bias = ctx.saved_tensors
        width = h2.shape[1] // 2
        dh = triton_support.empty(h2.shape, h2.dtype, h2.device)
        if not triton_support.shape_only(h2) and h2.shape[0]:
            grid, block = _grid(h2.shape[0], width)
            dy = dy.reshape(-1, width).contiguous()
            _swiglu_bwd_kernel[grid](h2, bias, dy, dh, width, BLOCK=block, HAS_BIAS=bias is not None)
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
