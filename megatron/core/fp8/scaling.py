"""Scales and casts: a tensor to FP8 with its scale, per tensor or per block, and back.

A quantised tensor is (data in an FP8 dtype, scale_inv in fp32): data = saturate(x * scale) and
x ~ data * scale_inv. The scale rules follow Transformer Engine's recipes:
- delayed (DelayedScaling): scale = fp8_max / amax / 2^margin from the amax history (delayed.py);
  kept when the amax is 0 or not finite.
- tensorwise (Float8CurrentScaling): scale = fp8_max / amax of the tensor being cast (1 when amax is 0).
- blockwise (Float8BlockScaling, DeepSeek-V3): one power-of-two scale per block, the largest
  2^k <= fp8_max / amax of the block (1 for an all-zero block).
Casts saturate: values beyond the format's range become +-fp8_max (torch's cast alone would give
NaN for e4m3fn and inf for e5m2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.fp8_blocks import power_of_two_scale
from megatron.core.fp8.recipe import fp8_max

__all__ = ["power_of_two_scale"]  # the block scales' rule lives beside its kernel (kernels/fp8_blocks.py)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32 (a 0-d tensor)."""
    return x.detach().abs().amax().float()


def current_scale(amax_value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float8CurrentScaling's scale from this tensor's amax: fp8_max / amax, 1 where amax is 0 or not finite."""
    usable = (amax_value > 0) & torch.isfinite(amax_value)
    return torch.where(usable, fp8_max(dtype) / amax_value, torch.ones_like(amax_value))


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) in `dtype`; `scale` broadcasts against x."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """data * scale_inv in fp32 (scale_inv broadcasts against data)."""
    return data.float() * scale_inv


def all_reduce_max(x: torch.Tensor, *groups) -> torch.Tensor:
    """x reduced with max over each group in turn (None or single-rank groups skipped), in place."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def block_ids(global_index: torch.Tensor, block: int) -> torch.Tensor:
    """Global block of each local row/column given its index in the full (logical) tensor."""
    return torch.div(global_index, block, rounding_mode="floor")


def block_amax(
    x: torch.Tensor, row_index: torch.Tensor, col_index: torch.Tensor, blocks: tuple[int, int], shape, group=None
) -> torch.Tensor:
    """amax of every block of the full tensor (`shape`: its [rows, columns]) that this rank's 2-D piece
    `x` touches, blocks of `blocks` = (rows, columns) elements laid on the full tensor's grid. `row_index`
    and `col_index`: the full tensor's index of each local row and column. With `group` (the ranks that
    hold the other pieces), the block amaxes are reduced over it, so a block split across ranks gets the
    scale one process would give it; a block held whole by every rank needs no group. Returns [row
    blocks, column blocks] of the full grid (zero where this rank holds nothing of a block)."""
    rows, cols = (-(-n // b) for n, b in zip(shape, blocks))
    r, c = block_ids(row_index, blocks[0]), block_ids(col_index, blocks[1])
    per_row = torch.zeros(x.shape[0], cols, dtype=torch.float32, device=x.device)
    per_row.scatter_reduce_(1, c.expand(x.shape[0], -1), x.detach().abs().float(), "amax")
    grid = torch.zeros(rows, cols, dtype=torch.float32, device=x.device)
    grid.scatter_reduce_(0, r[:, None].expand(-1, cols), per_row, "amax")
    return all_reduce_max(grid, group)


def quantize_blocks(
    x: torch.Tensor, row_index, col_index, blocks: tuple[int, int], shape, dtype, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8BlockScaling's cast of a 2-D piece: (FP8 data, fp32 scale_inv of each element's block, [rows,
    cols] of the local piece, broadcast-ready). See `block_amax` for the arguments."""
    grid = block_amax(x, row_index, col_index, blocks, shape, group)
    scale = power_of_two_scale(grid, dtype)
    local = scale[block_ids(row_index, blocks[0])][:, block_ids(col_index, blocks[1])]
    return cast(x, local, dtype), local.reciprocal()
