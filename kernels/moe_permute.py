"""Expert permutation in Triton, with its torch references: rows gathered by index, and each token's rows summed
back in a fixed order.

An MoE layer's dispatch copies each token once per expert it is routed to into rows grouped by expert (permute), and
its combine sums each token's expert outputs back into place (unpermute). Both are gathers here, never a scatter-add:

- `gather_rows(x, index)` -> y[r] = x[index[r]] (zero where index[r] < 0: padding rows);
- `sum_slots(rows, slots)` -> y[t] = sum over j of rows[slots[t, j]] (slots < 0 skipped), j in ascending order,
  accumulated in fp32 and rounded once to the rows' dtype.

Each is the other's backward (the permute's input gradient sums each token's row gradients; the unpermute's
gradient of a row is its token's), so forward and backward are deterministic on every device: no atomics, the same
order of additions every run (a scatter-add's order on CUDA is not fixed once a token has 3 or more rows).

Memory passes: each kernel is one pass, the gather reading every row it writes once, the sum reading a token's k
rows and writing the token once; the output is allocated empty (padding rows written as zeros by the kernel, no
separate zero fill). Kernels: a program takes several rows (tokens) and a tile of up to TILE_ELEMENTS values, the
whole hidden row when it fits; the row indices (int32, or int64) are loaded once per program and turned into int64
offsets outside the loop over column tiles; the sum issues SLOT_UNROLL rows' loads before adding them, in slot
order. Tile and warps are a rule (16 values per thread), not yet tuned on a GPU.
"""

import torch

from . import triton_support
from .triton_support import jit, tl

TILE_ELEMENTS = 4096  # values one program moves per column step
VALUES_PER_THREAD = 16
SLOT_UNROLL = 8  # slots whose loads are issued together: all of them up to 8, else groups of 4 (fp16 spills at 8)


# ----------------------------------------------------------------------------- Triton kernels
@jit
def _gather_rows_kernel(X, INDEX, Y, n_rows, n_cols, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    source = tl.load(INDEX + rows, mask=in_range, other=-1)
    present = (source >= 0)[:, None]  # a padding row (source < 0) reads nothing and is written zero
    source_offset = tl.maximum(source, 0).to(tl.int64)[:, None] * n_cols
    target_offset = rows.to(tl.int64)[:, None] * n_cols
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        inside = cols < n_cols
        x = tl.load(X + source_offset + cols, mask=present & inside, other=0.0)
        tl.store(Y + target_offset + cols, x, mask=in_range[:, None] & inside)


@jit
def _sum_slots_kernel(
    X, SLOTS, Y, n_tokens, n_cols, K: tl.constexpr, UNROLL: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    in_range = tokens < n_tokens
    slots = SLOTS + tokens.to(tl.int64) * K
    target_offset = tokens.to(tl.int64)[:, None] * n_cols
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        inside = cols < n_cols
        acc = tl.zeros((TOKENS, BLOCK_N), dtype=tl.float32)
        for first in range(0, K, UNROLL):
            for j in tl.static_range(UNROLL):  # loads issued together, added in slot order
                row = tl.load(slots + first + j, mask=in_range & (first + j < K), other=-1)
                present = (row >= 0)[:, None] & inside  # an empty slot (row < 0) adds nothing
                offset = tl.maximum(row, 0).to(tl.int64)[:, None] * n_cols
                acc += tl.load(X + offset + cols, mask=present, other=0.0).to(tl.float32)
        tl.store(Y + target_offset + cols, acc.to(Y.dtype.element_ty), mask=in_range[:, None] & inside)


def launch_config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK_N, num_warps): the whole row in one tile up to TILE_ELEMENTS values, as many rows
    as fill the tile (narrow rows), VALUES_PER_THREAD values per thread."""
    block_n = min(TILE_ELEMENTS, max(16, 1 << (n_cols - 1).bit_length()))
    rows = max(1, min(TILE_ELEMENTS // block_n, 1 << max(n_rows - 1, 0).bit_length()))
    return rows, block_n, max(1, min(16, rows * block_n // (32 * VALUES_PER_THREAD)))


def _unroll(k: int) -> int:
    return max(1, k) if k <= SLOT_UNROLL else SLOT_UNROLL // 2


def _gather_rows_triton(x, index):
    y = triton_support.empty((index.shape[0], x.shape[1]), x.dtype, x.device)
    if not triton_support.shape_only(x) and y.numel():
        rows, block, warps = launch_config(index.shape[0], x.shape[1])
        grid = (-(-index.shape[0] // rows),)
        _gather_rows_kernel[grid](
            x.contiguous(), index.contiguous(), y, index.shape[0], x.shape[1], ROWS=rows, BLOCK_N=block,
            num_warps=warps,
        )  # fmt: skip
    return y


def _sum_slots_triton(rows, slots):
    y = triton_support.empty((slots.shape[0], rows.shape[1]), rows.dtype, rows.device)
    if not triton_support.shape_only(rows) and y.numel():
        tokens, block, warps = launch_config(slots.shape[0], rows.shape[1])
        k = slots.shape[1]
        grid = (-(-slots.shape[0] // tokens),)
        _sum_slots_kernel[grid](
            rows.contiguous(), slots.contiguous(), y, slots.shape[0], rows.shape[1], K=k,
            UNROLL=_unroll(k), TOKENS=tokens, BLOCK_N=block, num_warps=warps,
        )  # fmt: skip
    return y


# ----------------------------------------------------------------------------- torch references
def gather_rows_torch(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    y = x.index_select(0, index.clamp_min(0))
    return torch.where((index >= 0).unsqueeze(1), y, 0)


def sum_slots_torch(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    acc = rows.new_zeros((slots.shape[0], rows.shape[1]), dtype=torch.float32)
    for j in range(slots.shape[1]):  # slot by slot: the kernel's order of additions
        acc += gather_rows_torch(rows, slots[:, j]).float()
    return acc.to(rows.dtype)


# ----------------------------------------------------------------------------- the ops
def unsupported_reason(dtype) -> str | None:
    if dtype not in triton_support.TRITON_DTYPES:
        return f"dtype {dtype} (the permutation kernels take float16, bfloat16, float32)"
    return None


def permute_path(impl: str, device) -> str:
    """The start-up log's line for the expert permutation."""
    return triton_support.kernel_path(impl, device)


def _gather(x, index, impl):
    if triton_support.use_triton(impl, x, unsupported_reason(x.dtype)):
        return _gather_rows_triton(x, index)
    return gather_rows_torch(x, index)


def _sum(rows, slots, impl):
    if triton_support.use_triton(impl, rows, unsupported_reason(rows.dtype)):
        return _sum_slots_triton(rows, slots)
    return sum_slots_torch(rows, slots)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, token_of_row, slots, impl):
        ctx.save_for_backward(slots)
        ctx.impl = impl
        return _gather(tokens, token_of_row, impl)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        return _sum(grad.contiguous(), slots, ctx.impl), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, token_of_row, slots, impl):
        ctx.save_for_backward(token_of_row)
        ctx.impl = impl
        return _sum(rows, slots, impl)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return _gather(grad.contiguous(), token_of_row, ctx.impl), None, None, None


def permute_rows(tokens, token_of_row, slots, impl: str = "auto") -> torch.Tensor:
    """tokens [T, h] -> rows [R, h], row r = tokens[token_of_row[r]] (zero where < 0); `slots` [T, k]: the rows of
    each token (< 0: none), which the backward sums."""
    return _Permute.apply(tokens, token_of_row, slots, impl)


def unpermute_rows(rows, token_of_row, slots, impl: str = "auto") -> torch.Tensor:
    """rows [R, h] -> tokens [T, h], token t = the sum of rows[slots[t, j]] over j in order; the backward gives each
    row its token's gradient (`token_of_row`, zero where < 0)."""
    return _Unpermute.apply(rows, token_of_row, slots, impl)
