"""Fused attention (FlashAttention-2 style) in Triton, with its torch reference.

Layout: q [b, s_q, h, d]; k, v [b, s_k, h_kv, d] with h a multiple of h_kv (grouped-query
attention: query head i reads K/V head i // (h / h_kv); K/V are never repeated in memory).
`causal` masks key j for query i when j > i (top-left aligned, as
`scaled_dot_product_attention(is_causal=True)`), so every query row sees at least key 0.

Kernels (each program owns one tile and loops over the other axis):
  * forward: per (query block, head) an online softmax over key blocks; writes the output and
    the log-sum-exp `lse` [b, h, s_q] (fp32, natural log) that the backward pass reuses.
  * backward: `delta = rowsum(dO * O) - dlse` per query row, then one kernel for dK/dV per
    (key block, kv head), looping over the query heads of its group, so the group sum needs
    no atomics, and one kernel for dQ per (query block, head).
Scores are computed in base 2 (the softmax scale folded with log2(e)) so exp2 can be used.
Each loop runs in up to three ranges: blocks that need the causal/bounds mask and the blocks
between them that do not, so the mask costs nothing away from the diagonal and the ragged end.
"""
# ruff: noqa: E741 (the kernels name their tensors O, as the FlashAttention papers do)

import math

import torch

from . import triton_support
from .triton_support import jit, tl

SUPPORTED_HEAD_DIMS = (64, 128)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


# ----------------------------------------------------------------------------- Triton helpers
@jit
def _row_base(b, head, n_rows, n_heads, HEAD_DIM: tl.constexpr):
    """Offset of row 0 of (batch b, head) in a contiguous [batch, rows, heads, HEAD_DIM] tensor."""
    return (b.to(tl.int64) * n_rows * n_heads + head) * HEAD_DIM


@jit
def _query_block(s_q, s_k, n_heads, n_kv_heads, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's query block of one (batch, head): its first row, batch index, head, the
    offsets of the q rows and of its K/V head, row indices and head-dim indices."""
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // (n_heads // n_kv_heads)
    q_base = _row_base(b, head, s_q, n_heads, HEAD_DIM)
    kv_base = _row_base(b, kv_head, s_k, n_kv_heads, HEAD_DIM)
    return start_m, b, head, q_base, kv_base, start_m + tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)


@jit
def _load_tile(base, rows, row_stride, cols, n_rows, MASK: tl.constexpr, COMPUTE: tl.constexpr):
    """Load a [rows, cols] tile (rows past n_rows read as 0 when MASK) and convert it to COMPUTE."""
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    if MASK:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile.to(COMPUTE)


@jit
def _store_tile(base, rows, row_stride, cols, n_rows, tile):
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=rows[:, None] < n_rows)


@jit
def _visible(q_idx, k_idx, loop_idx, loop_len, CAUSAL: tl.constexpr):
    """Score mask: the looped-over index is in bounds and, if causal, the key is not after the query."""
    keep = loop_idx < loop_len
    if CAUSAL:
        keep = keep & (k_idx <= q_idx)
    return keep


@jit
def _key_ranges(start_m, s_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key loop of query block [start_m, start_m + BLOCK_M): blocks in [0, full_hi) need no mask,
    blocks in [full_hi, hi) do (the causal diagonal and the ragged end)."""
    full_hi = (s_k // BLOCK_N) * BLOCK_N
    hi = s_k
    if CAUSAL:
        full_hi = tl.minimum(full_hi, ((start_m + 1) // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, start_m + BLOCK_M)
    return full_hi, hi


@jit
def _query_ranges(start_n, s_q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query loop of key block [start_n, start_n + BLOCK_N): masked [lo, mid_lo), unmasked
    [mid_lo, mid_hi), masked [mid_hi, hi). Under causal, query blocks before `lo` see none of
    these keys and those from `full_lo` on see all of them."""
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    mid_lo = tl.minimum(full_lo, s_q)
    mid_hi = tl.maximum((s_q // BLOCK_M) * BLOCK_M, mid_lo)
    return lo, mid_lo, mid_hi, s_q


# ----------------------------------------------------------------------------- forward
@jit
def _fwd_inner(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    kv_stride,
    offs_m,
    offs_d,
    s_k,
    lo,
    hi,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi); m_i is the running row max in base-2 units."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, kv_stride, offs_d, s_k, MASK, COMPUTE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASK:
            s = tl.where(_visible(offs_m[:, None], offs_n[None, :], offs_n[None, :], s_k, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, offs_n, kv_stride, offs_d, s_k, MASK, COMPUTE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@jit
def _attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    s_q,
    s_k,
    n_heads,
    n_kv_heads,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m, b, head, q_base, kv_base, offs_m, offs_d = _query_block(s_q, s_k, n_heads, n_kv_heads, HEAD_DIM, BLOCK_M)
    q = _load_tile(Q + q_base, offs_m, n_heads * HEAD_DIM, offs_d, s_q, True, COMPUTE)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    full_hi, hi = _key_ranges(start_m, s_k, BLOCK_M, BLOCK_N, CAUSAL)
    inner_args = (K + kv_base, V + kv_base, n_kv_heads * HEAD_DIM, offs_m, offs_d, s_k)
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, *inner_args, 0, full_hi, qk_scale, BLOCK_N, False, CAUSAL, COMPUTE, PRECISION
    )
    acc, m_i, l_i = _fwd_inner(
        acc, m_i, l_i, q, *inner_args, full_hi, hi, qk_scale, BLOCK_N, True, CAUSAL, COMPUTE, PRECISION
    )

    _store_tile(O + q_base, offs_m, n_heads * HEAD_DIM, offs_d, s_q, acc / l_i[:, None])
    lse_rows = (b.to(tl.int64) * n_heads + head) * s_q + offs_m
    tl.store(LSE + lse_rows, (m_i + tl.math.log2(l_i)) * _LN2, mask=offs_m < s_q)


# ----------------------------------------------------------------------------- backward
@jit
def _bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, s_q, n_heads, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr
):
    """delta = rowsum(dO * O) - dlse: with it dS = P * (dP - delta) also carries the lse gradient."""
    b = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = _row_base(b, head, s_q, n_heads, HEAD_DIM)
    o = _load_tile(O + base, offs_m, n_heads * HEAD_DIM, offs_d, s_q, True, tl.float32)
    do = _load_tile(DO + base, offs_m, n_heads * HEAD_DIM, offs_d, s_q, True, tl.float32)
    delta = tl.sum(o * do, 1)
    rows = (b.to(tl.int64) * n_heads + head) * s_q + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows, mask=offs_m < s_q, other=0.0)
    tl.store(DELTA + rows, delta, mask=offs_m < s_q)


@jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    stat_base,
    q_stride,
    offs_n,
    offs_d,
    s_q,
    lo,
    hi,
    qk_scale,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi) of one query head.
    Works on transposed scores [BLOCK_N, BLOCK_M] so no tile is transposed twice."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_base, offs_m, q_stride, offs_d, s_q, MASK, COMPUTE)
        do = _load_tile(do_base, offs_m, q_stride, offs_d, s_q, MASK, COMPUTE)
        in_bounds = offs_m < s_q
        lse2 = tl.load(stat_base[0] + offs_m, mask=in_bounds, other=0.0) * _LOG2E
        delta = tl.load(stat_base[1] + offs_m, mask=in_bounds, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :])
        if MASK:
            p_t = tl.where(_visible(offs_m[None, :], offs_n[:, None], offs_m[None, :], s_q, CAUSAL), p_t, 0.0)
        dv += tl.dot(p_t.to(COMPUTE), do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(COMPUTE), q, input_precision=PRECISION)
    return dk, dv


@jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    s_q,
    s_k,
    n_heads,
    n_kv_heads,
    qk_scale,
    softmax_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1) // n_kv_heads
    kv_head = tl.program_id(1) % n_kv_heads
    group = n_heads // n_kv_heads
    kv_base = _row_base(b, kv_head, s_k, n_kv_heads, HEAD_DIM)
    kv_stride = n_kv_heads * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_tile(K + kv_base, offs_n, kv_stride, offs_d, s_k, True, COMPUTE)
    v = _load_tile(V + kv_base, offs_n, kv_stride, offs_d, s_k, True, COMPUTE)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_ranges(start_n, s_q, BLOCK_M, BLOCK_N, CAUSAL)
    for head in range(kv_head * group, (kv_head + 1) * group):
        q_base = _row_base(b, head, s_q, n_heads, HEAD_DIM)
        stat_row = (b.to(tl.int64) * n_heads + head) * s_q
        args = (Q + q_base, DO + q_base, (LSE + stat_row, DELTA + stat_row), n_heads * HEAD_DIM, offs_n, offs_d, s_q)
        dk, dv = _dkdv_inner(dk, dv, k, v, *args, lo, mid_lo, qk_scale, BLOCK_M, True, CAUSAL, COMPUTE, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, *args, mid_lo, mid_hi, qk_scale, BLOCK_M, False, CAUSAL, COMPUTE, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, *args, mid_hi, hi, qk_scale, BLOCK_M, True, CAUSAL, COMPUTE, PRECISION)
    _store_tile(DK + kv_base, offs_n, kv_stride, offs_d, s_k, dk * softmax_scale)
    _store_tile(DV + kv_base, offs_n, kv_stride, offs_d, s_k, dv)


@jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    kv_stride,
    offs_m,
    offs_d,
    s_k,
    lo,
    hi,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, kv_stride, offs_d, s_k, MASK, COMPUTE)
        v = _load_tile(v_base, offs_n, kv_stride, offs_d, s_k, MASK, COMPUTE)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse2[:, None])
        if MASK:
            p = tl.where(_visible(offs_m[:, None], offs_n[None, :], offs_n[None, :], s_k, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(COMPUTE), k, input_precision=PRECISION)
    return dq


@jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    s_q,
    s_k,
    n_heads,
    n_kv_heads,
    qk_scale,
    softmax_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m, b, head, q_base, kv_base, offs_m, offs_d = _query_block(s_q, s_k, n_heads, n_kv_heads, HEAD_DIM, BLOCK_M)
    q_stride = n_heads * HEAD_DIM
    q = _load_tile(Q + q_base, offs_m, q_stride, offs_d, s_q, True, COMPUTE)
    do = _load_tile(DO + q_base, offs_m, q_stride, offs_d, s_q, True, COMPUTE)
    stat_rows = (b.to(tl.int64) * n_heads + head) * s_q + offs_m
    lse2 = tl.load(LSE + stat_rows, mask=offs_m < s_q, other=0.0) * _LOG2E
    delta = tl.load(DELTA + stat_rows, mask=offs_m < s_q, other=0.0)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_hi, hi = _key_ranges(start_m, s_k, BLOCK_M, BLOCK_N, CAUSAL)
    args = (K + kv_base, V + kv_base, n_kv_heads * HEAD_DIM, offs_m, offs_d, s_k)
    dq = _dq_inner(dq, q, do, lse2, delta, *args, 0, full_hi, qk_scale, BLOCK_N, False, CAUSAL, COMPUTE, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, *args, full_hi, hi, qk_scale, BLOCK_N, True, CAUSAL, COMPUTE, PRECISION)
    _store_tile(DQ + q_base, offs_m, q_stride, offs_d, s_q, dq * softmax_scale)


# ----------------------------------------------------------------------------- host side
# (kernel, head dim) -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for fp16/bf16 on SM90.
# FlashAttention-2-style starting points, not yet timed on a GPU; the ahead-of-time compile
# test checks that each fits SM90 shared memory and compiles without register spills (which
# is why dK/dV at head dim 128 uses BLOCK_M = 16). The interpreter uses the same tiles.
_CONFIGS = {
    ("fwd", 64): (128, 64, 4, 3),
    ("fwd", 128): (128, 64, 8, 3),
    ("dkdv", 64): (32, 128, 8, 3),
    ("dkdv", 128): (16, 128, 8, 3),
    ("dq", 64): (128, 32, 4, 3),
    ("dq", 128): (128, 32, 8, 3),
}
_PREPROCESS_BLOCK_M, _PREPROCESS_WARPS = 64, 4


def _launch_options(kernel, head_dim, dtype):
    block_m, block_n, num_warps, num_stages = _CONFIGS[kernel, head_dim]
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        COMPUTE=triton_support.compute_dtype(dtype),
        PRECISION=triton_support.dot_precision(dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _cdiv(a, b):
    return -(-a // b)


def _attn_forward(q, k, v, causal, softmax_scale):
    """Launch the forward kernel on contiguous q, k, v; returns (out, lse)."""
    batch, s_q, n_heads, head_dim = q.shape
    s_k, n_kv_heads = k.shape[1], k.shape[2]
    out = triton_support.empty(q.shape, q.dtype, q.device)
    lse = triton_support.empty((batch, n_heads, s_q), torch.float32, q.device)
    opts = _launch_options("fwd", head_dim, q.dtype)
    grid = (_cdiv(s_q, opts["BLOCK_M"]), batch * n_heads)
    if triton_support.shape_only(q):
        return out, lse
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, s_q, s_k, n_heads, n_kv_heads, softmax_scale * math.log2(math.e), CAUSAL=causal, **opts
    )
    return out, lse


def _attn_backward(q, k, v, out, lse, dout, dlse, causal, softmax_scale):
    """Launch the backward kernels on contiguous tensors; dlse may be None. Returns (dq, dk, dv)."""
    batch, s_q, n_heads, head_dim = q.shape
    s_k, n_kv_heads = k.shape[1], k.shape[2]
    delta = triton_support.empty((batch, n_heads, s_q), torch.float32, q.device)
    if triton_support.shape_only(q):
        return tuple(triton_support.empty(t.shape, t.dtype, t.device) for t in (q, k, v))
    _bwd_preprocess_kernel[(_cdiv(s_q, _PREPROCESS_BLOCK_M), batch * n_heads)](
        out,
        dout,
        dlse,
        delta,
        s_q,
        n_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=_PREPROCESS_BLOCK_M,
        HAS_DLSE=dlse is not None,
        num_warps=_PREPROCESS_WARPS,
    )

    dq, dk, dv = (triton_support.empty(t.shape, t.dtype, t.device) for t in (q, k, v))
    scalars = (s_q, s_k, n_heads, n_kv_heads, softmax_scale * math.log2(math.e), softmax_scale)
    opts = _launch_options("dkdv", head_dim, q.dtype)
    _attn_bwd_dkdv_kernel[(_cdiv(s_k, opts["BLOCK_N"]), batch * n_kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, *scalars, CAUSAL=causal, **opts
    )
    opts = _launch_options("dq", head_dim, q.dtype)
    _attn_bwd_dq_kernel[(_cdiv(s_q, opts["BLOCK_M"]), batch * n_heads)](
        q, k, v, dout, lse, delta, dq, *scalars, CAUSAL=causal, **opts
    )
    return dq, dk, dv


class _FlashAttentionFn(torch.autograd.Function):
    """(q, k, v) -> (out, lse) through the Triton kernels; gradients flow from both outputs."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = _attn_forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        ctx.set_materialize_grads(False)  # dlse stays None when only `out` is used
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.contiguous()
        dq, dk, dv = _attn_backward(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None


def _check_inputs(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"expected q [b, s, h, d] and k, v [b, s, h_kv, d]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} need the same batch and head dim, "
            "and query heads a multiple of kv heads"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must share dtype and device")


def unsupported_reason(head_dim, dtype, device):
    """Why the Triton kernel cannot take this head dim / dtype / device, or None if it can.

    fp32 runs only under the interpreter: on a GPU an exact ('ieee') fp32 tl.dot has no tensor
    core path and spills registers at every tile size tried, so CUDA fp32 goes to torch.
    """
    if dtype not in triton_support.TRITON_DTYPES or (dtype == torch.float32 and torch.device(device).type == "cuda"):
        return f"flash_attention Triton kernel runs fp16 and bf16 on GPU (fp32 only in the interpreter), got {dtype}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return (
            f"flash_attention Triton kernel supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}; "
            "use impl='torch' (or 'auto', which falls back to it)"
        )
    return None


def attention_path(impl, device, head_dim, dtype):
    """Start-up log line: which attention path runs for this model."""
    return triton_support.kernel_path(impl, device, unsupported_reason(head_dim, dtype, device))


def _default_scale(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


def flash_attention_torch(q, k, v, causal=True, softmax_scale=None):
    """Reference: torch's scaled_dot_product_attention on the same layout."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def flash_attention(q, k, v, causal=True, softmax_scale=None, impl="auto"):
    """softmax(q k^T * scale) v per head; q [b, s_q, h, d], k/v [b, s_k, h_kv, d] -> [b, s_q, h, d]."""
    _check_inputs(q, k, v)
    if triton_support.use_triton(impl, q, unsupported_reason(q.shape[-1], q.dtype, q.device)):
        return _FlashAttentionFn.apply(q, k, v, causal, _default_scale(q, softmax_scale))[0]
    return flash_attention_torch(q, k, v, causal, softmax_scale)


def flash_attention_block_torch(q, k, v, causal, softmax_scale=None):
    """Reference for `flash_attention_block`, computed explicitly in (at least) fp32."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[2] // k.shape[2]
    k, v = (t.to(compute).repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(compute), k) * _default_scale(q, softmax_scale)
    if causal:
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v)
    return out.to(q.dtype), lse


def flash_attention_block(q, k, v, causal, softmax_scale=None, impl="auto"):
    """Attention of a query block against one K/V block: returns (out [b, s_q, h, d], lse [b, h, s_q]
    fp32). Both outputs are differentiable, so context parallelism can merge blocks with
    `merge_attention_blocks` and backpropagate through the merge."""
    _check_inputs(q, k, v)
    if triton_support.use_triton(impl, q, unsupported_reason(q.shape[-1], q.dtype, q.device)):
        return _FlashAttentionFn.apply(q, k, v, causal, _default_scale(q, softmax_scale))
    return flash_attention_block_torch(q, k, v, causal, softmax_scale)


def flash_attention_block_backward_torch(q, k, v, out, lse, dout, causal, softmax_scale=None):
    """Reference for `flash_attention_block_backward`, computed explicitly in (at least) fp32."""
    compute = torch.promote_types(q.dtype, torch.float32)
    scale = _default_scale(q, softmax_scale)
    batch, s_k, n_kv_heads, head_dim = k.shape
    group = q.shape[2] // n_kv_heads
    q_c, out_c, dout_c = (t.to(compute) for t in (q, out, dout))
    k_c, v_c = (t.to(compute).repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q_c, k_c) * scale
    if causal:
        future = torch.ones(q.shape[1], s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    p = torch.exp(scores - lse.to(compute)[..., None])
    delta = (dout_c * out_c).sum(-1).transpose(1, 2)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout_c, v_c) - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_c) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q_c) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout_c)
    dk, dv = (t.view(batch, s_k, n_kv_heads, group, head_dim).sum(3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_attention_block_backward(q, k, v, out, lse, dout, causal, softmax_scale=None, impl="auto"):
    """dq, dk, dv of one (query block, K/V block) pair, given the query rows' `out` and `lse` over
    ALL their keys (not just this block's): then P = exp(q k^T * scale - lse) is this block's share
    of the global softmax and delta = rowsum(dout * out) the global one, so the per-block gradients
    of a context-parallel ring add up to the exact gradients without keeping any block's output."""
    _check_inputs(q, k, v)
    if triton_support.use_triton(impl, q, unsupported_reason(q.shape[-1], q.dtype, q.device)):
        q, k, v, out, lse, dout = (t.contiguous() for t in (q, k, v, out, lse, dout))
        return _attn_backward(q, k, v, out, lse, dout, None, causal, _default_scale(q, softmax_scale))
    return flash_attention_block_backward_torch(q, k, v, out, lse, dout, causal, softmax_scale)


def merge_attention_blocks(out1, lse1, out2, lse2):
    """Combine attention over two disjoint key sets into attention over their union.

    out: [b, s, h, d]; lse: [b, h, s]. A block with lse = -inf (no visible key) gets weight 0,
    so an empty accumulator (zeros, -inf) is a valid starting point.
    """
    lse = torch.logaddexp(lse1, lse2)
    finite_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # no inf - inf = nan

    def weight(block_lse):
        return torch.exp(block_lse - finite_lse).transpose(1, 2).unsqueeze(-1)

    out = weight(lse1) * out1.float() + weight(lse2) * out2.float()
    return out.to(out1.dtype), lse
