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

Kernels: one program per output row and block of columns, int64 offsets.
"""

import torch

from . import triton_support
from .triton_support import jit, tl

BLOCK_COLUMNS = 1024


# ----------------------------------------------------------------------------- Triton kernels
@jit
def _gather_rows_kernel(X, INDEX, Y, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    source = tl.load(INDEX + row).to(tl.int64)
    present = cols < tl.where(source >= 0, n_cols, 0)  # a padding row (source < 0) reads nothing
    x = tl.load(X + tl.maximum(source, 0) * n_cols + cols, mask=present, other=0.0)
    tl.store(Y + row * n_cols + cols, x, mask=mask)


@jit
def _sum_slots_kernel(ROWS, SLOTS, Y, n_slots, n_cols, BLOCK_N: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, n_slots):
        row = tl.load(SLOTS + token * n_slots + j).to(tl.int64)
        present = cols < tl.where(row >= 0, n_cols, 0)  # an empty slot (row < 0) adds nothing
        acc += tl.load(ROWS + tl.maximum(row, 0) * n_cols + cols, mask=present, other=0.0).to(tl.float32)
    tl.store(Y + token * n_cols + cols, acc.to(Y.dtype.element_ty), mask=mask)


def _grid(rows: int, n_cols: int):
    block = min(BLOCK_COLUMNS, max(16, 1 << (n_cols - 1).bit_length()))
    return (rows, -(-n_cols // block)), block


def _gather_rows_triton(x, index):
    y = triton_support.empty((index.shape[0], x.shape[1]), x.dtype, x.device)
    if not triton_support.shape_only(x) and y.numel():
        grid, block = _grid(index.shape[0], x.shape[1])
        _gather_rows_kernel[grid](x.contiguous(), index.contiguous(), y, x.shape[1], BLOCK_N=block)
    return y


def _sum_slots_triton(rows, slots):
    y = triton_support.empty((slots.shape[0], rows.shape[1]), rows.dtype, rows.device)
    if not triton_support.shape_only(rows) and y.numel():
        grid, block = _grid(slots.shape[0], rows.shape[1])
        _sum_slots_kernel[grid](rows.contiguous(), slots.contiguous(), y, slots.shape[1], rows.shape[1], BLOCK_N=block)
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
