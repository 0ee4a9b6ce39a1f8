"""Rotary position embedding (RoPE) of a layer's queries and keys in one Triton launch, with its
torch reference.

`rope(q, k, angles, interleaved, impl)`: q [s, b, h_q, d] and k [s, b, h_k, d] (grouped-query
attention: h_k divides h_q; both may be strided views of the fused QKV output, the last dim
contiguous), `angles` [s, b or 1, 1, r] fp32: each token's rotation angle per channel (the caller
builds them: base, Llama-3 scaling and the token's position, e.g. a context-parallel rank's own
chunks, are all in the angles). The first r <= d channels of each head rotate, the rest pass
unchanged (--rotary-percent < 1). Channels pair as halves (c with c + r/2) or, `interleaved`, as
neighbours (2i with 2i + 1): out[c] = x[c] cos(a_c) - x[c + r/2] sin(a_c) for the first half,
x[c] cos(a_c) + x[c - r/2] sin(a_c) for the second, and alike for (2i, 2i + 1).

Reference (`rope_torch`): megatron-core's unfused rotary, rounding cos, sin and each product to
x's dtype. Kernel: fp32 arithmetic, one rounding (as fused RoPE kernels do). Each program takes a
block of (token, head) rows, of q and, past q's blocks, of k; backward is the same kernel
rotating the output gradient back (its own angles at the partner channel), so only the angles
are saved for it.
"""

from __future__ import annotations

import torch

from . import triton_support
from .triton_support import jit, tl

TILE_ELEMENTS = 2048  # a program's [rows, head dim] tile; not yet tuned on a GPU


def unsupported_reason(head_dim: int, rotary_dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if dtype not in triton_support.TRITON_DTYPES:
        return f"dtype {dtype} (the RoPE kernel takes fp16, bf16, fp32)"
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        return f"rotary dim {rotary_dim} (must be even and at most the head dim {head_dim})"
    return None


# ----------------------------------------------------------------------------- torch reference
def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([-odd, even], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first angles.shape[-1] channels of x [s, b, h, d] by angles [s, b or 1, 1, r]; the
    other channels pass unchanged. As megatron-core's unfused path: cos and sin (of fp32 angles) are
    rounded to x's dtype and the rotation is computed in x's dtype."""
    rotary_dim = angles.shape[-1]
    rotated = x[..., :rotary_dim]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    out = rotated * cos + _rotate(rotated, interleaved) * sin
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rotary_dim:]], dim=-1)


def rope_torch(q, k, angles, interleaved=False):
    """The reference: `apply_rotary` on q and on k."""
    return apply_rotary(q, angles, interleaved), apply_rotary(k, angles, interleaved)


# ----------------------------------------------------------------------------- Triton kernel
@jit
def _rotate_rows(
    X,
    Y,
    ANG,
    row_start,
    n_heads,
    n_rows,
    x_stride_s,
    x_stride_b,
    x_stride_h,
    a_stride_s,
    a_stride_b,
    batch,
    head_dim,
    rotary_dim,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rows [row_start, row_start + BLOCK_R) of X's (token, head) rows: Y (contiguous) = rotated X."""
    rows = row_start + tl.arange(0, BLOCK_R)  # int32 division (int64 would call a slow subroutine) ...
    cols = tl.arange(0, BLOCK_D)
    token, head = rows // n_heads, rows % n_heads
    s_idx, b_idx = (token // batch).to(tl.int64), (token % batch).to(tl.int64)  # ... int64 offsets
    head = head.to(tl.int64)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < head_dim)[None, :]
    rotates = (cols < rotary_dim)[None, :] & row_mask[:, None]
    half = rotary_dim // 2
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    partner = tl.where(cols < rotary_dim, partner, cols)
    a_rows = ANG + (s_idx * a_stride_s + b_idx * a_stride_b)[:, None]
    angle = tl.load(a_rows + cols[None, :], mask=rotates, other=0.0).to(tl.float32)
    if BACKWARD:  # dx[c] = g[c] cos(a_c) - sign_c g[p] sin(a_p): the partner's angle
        partner_angle = tl.load(a_rows + partner[None, :], mask=rotates, other=0.0).to(tl.float32)
        coef = tl.where(rotates, -sign[None, :] * tl.sin(partner_angle), 0.0)
    else:
        coef = tl.where(rotates, sign[None, :] * tl.sin(angle), 0.0)
    cos = tl.where(rotates, tl.cos(angle), 1.0)
    x_rows = X + (s_idx * x_stride_s + b_idx * x_stride_b + head * x_stride_h)[:, None]
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * cos + x_partner * coef
    tl.store(Y + rows.to(tl.int64)[:, None] * head_dim + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    ANG,
    q_heads,
    k_heads,
    q_stride_s,
    q_stride_b,
    q_stride_h,
    k_stride_s,
    k_stride_b,
    k_stride_h,
    a_stride_s,
    a_stride_b,
    tokens,
    batch,
    head_dim,
    rotary_dim,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Program i: a block of BLOCK_R (token, head) rows of q, or past q's blocks, of k."""
    block = tl.program_id(0)
    q_rows, k_rows = tokens * q_heads, tokens * k_heads
    q_blocks = tl.cdiv(q_rows, BLOCK_R)
    if block < q_blocks:
        _rotate_rows(
            Q,
            QO,
            ANG,
            block * BLOCK_R,
            q_heads,
            q_rows,
            q_stride_s,
            q_stride_b,
            q_stride_h,
            a_stride_s,
            a_stride_b,
            batch,
            head_dim,
            rotary_dim,
            BLOCK_R,
            BLOCK_D,
            INTERLEAVED,
            BACKWARD,
        )
    else:
        _rotate_rows(
            K,
            KO,
            ANG,
            (block - q_blocks) * BLOCK_R,
            k_heads,
            k_rows,
            k_stride_s,
            k_stride_b,
            k_stride_h,
            a_stride_s,
            a_stride_b,
            batch,
            head_dim,
            rotary_dim,
            BLOCK_R,
            BLOCK_D,
            INTERLEAVED,
            BACKWARD,
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, angles, interleaved, backward):
    """Rotated (or, `backward`, rotated back) copies of q and k, contiguous."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    angles = _last_dim_contiguous(angles)
    q_out = triton_support.empty(q.shape, q.dtype, q.device)
    k_out = triton_support.empty(k.shape, k.dtype, k.device)
    if triton_support.shape_only(q):
        return q_out, k_out
    s, b, q_heads, head_dim = q.shape
    k_heads, rotary_dim = k.shape[2], angles.shape[-1]
    cdiv, next_power_of_2 = triton_support.triton.cdiv, triton_support.triton.next_power_of_2
    block_d = next_power_of_2(head_dim)
    block_r = max(1, min(TILE_ELEMENTS // block_d, next_power_of_2(s * b * q_heads)))
    a_stride_b = 0 if angles.shape[1] == 1 else angles.stride(1)
    grid = (cdiv(s * b * q_heads, block_r) + cdiv(s * b * k_heads, block_r),)
    _rope_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        angles,
        q_heads,
        k_heads,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        angles.stride(0),
        a_stride_b,
        s * b,
        b,
        head_dim,
        rotary_dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        INTERLEAVED=interleaved,
        BACKWARD=backward,
    )
    return q_out, k_out


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, angles, interleaved):
        ctx.interleaved = interleaved
        ctx.shapes = ((q.shape, q.dtype), (k.shape, k.dtype))
        ctx.save_for_backward(angles)
        return _launch(q, k, angles, interleaved, backward=False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        (angles,) = ctx.saved_tensors
        grad_q, grad_k = (
            torch.zeros(shape, dtype=dtype, device=angles.device) if g is None else g
            for g, (shape, dtype) in zip((grad_q, grad_k), ctx.shapes)
        )
        grad_q, grad_k = _launch(grad_q, grad_k, angles, ctx.interleaved, backward=True)
        return grad_q, grad_k, None, None


def _check(q, k, angles):
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [s, b, heads, head_dim] alike")
    if angles.dim() != 4 or angles.shape[0] != q.shape[0] or angles.shape[1] not in (1, q.shape[1]):
        raise ValueError(f"angles {tuple(angles.shape)} must be [s, b or 1, 1, rotary_dim] for q {tuple(q.shape)}")


def rope(q, k, angles, interleaved=False, impl="auto"):
    """(q, k) rotated by `angles` (module docstring); the Triton kernel or `rope_torch` by `impl`."""
    _check(q, k, angles)
    unsupported = unsupported_reason(q.shape[-1], angles.shape[-1], q.dtype)
    if k.dtype != q.dtype:
        unsupported = f"q and k of different dtypes ({q.dtype}, {k.dtype})"
    if q.shape[:3].numel() >= 2**31:
        unsupported = f"{q.shape[:3].numel()} (token, head) rows of q (the kernel indexes them in int32)"
    if not triton_support.use_triton(impl, q, unsupported):
        return rope_torch(q, k, angles, interleaved)
    return _RoPE.apply(q, k, angles, bool(interleaved))
