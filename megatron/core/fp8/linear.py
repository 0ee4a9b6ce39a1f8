"""One linear layer's three GEMMs under an FP8 recipe: which tensor is quantised with which scale in which pass.

forward: the input and the weight in e4m3; dgrad: the output gradient (e5m2 under hybrid, else e4m3) and
the weight's transpose; wgrad: the output gradient and the input, or no quantisation at all with
--no-fp8-wgrad (the product in the model's precision, Transformer Engine's override_linear_precision).

Scales (scaling.py): delayed scaling reads the layer's `fp8_scale` buffer and records each cast's amax
into `fp8_amax_pending`, reduced and folded into the history once per iteration (delayed.py); current
(tensorwise) scaling reduces each tensor's amax over the ranks holding the other pieces of the same
logical tensor before casting (the weight over `weight_group`, activations and gradients over
`activation_groups`); block scaling lays its blocks on the full tensor's grid, reducing a block's amax
over `weight_group` only where tensor parallelism splits a block.

Casts: kernels/fp8_cast.py (per tensor: one pass writes the FP8 tensor and/or its transpose, and delayed
scaling's amax) and kernels/fp8_blocks.py (blocks whole on this rank), Triton or torch by `cast_impl`
(--kernel-impl). The output gradient is cast once for both backward GEMMs; the weight and the input are
cast-transposed for them with their forward scales. docs/fp8.md counts the passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels.fp8_blocks import quantize_blocks as quantize_whole_blocks
from kernels.fp8_cast import quantize, tensor_amax
from megatron.core.fp8.gemm import block_mm, fp8_mm
from megatron.core.fp8.recipe import BLOCK, GRAD, INPUT, WEIGHT, Fp8Recipe
from megatron.core.fp8.scaling import all_reduce_max, current_scale, quantize_blocks
from megatron.core.tensor_parallel.initialization import InitSpec, held_ranges

STATE_BUFFERS = ("fp8_amax_history", "fp8_scale")  # delayed scaling's state, saved in checkpoints


def is_fp8_state(name: str) -> bool:
    """Whether a checkpoint tensor is delayed scaling's state (optional on load, both ways)."""
    return name.rsplit(".", 1)[-1] in STATE_BUFFERS


class Saved(NamedTuple):
    """What the forward's per-tensor casts leave for backward: the input's and the weight's scales."""

    x_scale: torch.Tensor
    x_inv: torch.Tensor
    w_scale: torch.Tensor
    w_inv: torch.Tensor


class QuantizedGrad(NamedTuple):
    """The output gradient in FP8: row-major for dgrad, transposed for wgrad (None where not needed)."""

    rowwise: torch.Tensor | None
    columnwise: torch.Tensor | None
    scale_inv: torch.Tensor


def _global_index(shard, size: int, dim: int) -> tuple[list[tuple[int, int]], bool]:
    """(the full dimension's ranges this rank holds along `dim`, whether a block of BLOCK straddles ranks)."""
    ranges = held_ranges(shard if shard is not None and shard.dim == dim else None, size)
    straddles = any(start % BLOCK or (stop % BLOCK and stop != size) for start, stop in ranges)
    return ranges, straddles


def _arange(ranges, device) -> torch.Tensor:
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in ranges])


class Fp8Gemms:
    """The FP8 GEMMs of the linear layer `owner` (a module with a 2-D `weight` carrying its InitSpec)."""

    def __init__(
        self,
        recipe: Fp8Recipe,
        owner: torch.nn.Module,
        *,
        weight_group,
        activation_groups,
        expert: bool,
        cast_impl: Callable[[str], str] = lambda device_type: "auto",
    ):
        """`cast_impl`: device type -> the per-tensor casts' path (kernels/dispatch.py `fp8_cast`)."""
        self.recipe, self.owner, self.expert = recipe, owner, expert
        self.cast_impl, self._impls = cast_impl, {}
        self.weight_group, self.activation_groups = weight_group, tuple(activation_groups)
        spec = owner.weight.init_spec
        self.full_shape = tuple(spec.full_shape)
        self._out, out_straddles = _global_index(spec.shard, self.full_shape[0], 0)
        self._in, in_straddles = _global_index(spec.shard, self.full_shape[1], 1)
        # blocks cut by tensor parallelism are reduced over the ranks holding their pieces
        self._out_group = weight_group if out_straddles else None
        self._in_group = weight_group if in_straddles else None
        self._block_group = weight_group if (out_straddles or in_straddles) else None
        self.has_history = False  # delayed scaling: scales derived from recorded amaxes (see `calibrating`)
        if recipe.delayed:
            device = owner.weight.device
            owner.register_buffer("fp8_amax_history", torch.zeros(recipe.amax_history_len, 3, device=device))
            owner.register_buffer("fp8_scale", torch.ones(3, device=device))
            # saved in checkpoints (buffers with an InitSpec): equal on every rank holding the layer once reduced
            owner.fp8_amax_history.init_spec = InitSpec((recipe.amax_history_len, 3), kind="zeros")
            owner.fp8_scale.init_spec = InitSpec((3,), kind="ones")
            owner.register_buffer("fp8_amax_pending", torch.zeros(3, device=device), persistent=False)
            owner.register_buffer("fp8_scale_inv", torch.ones(3, device=device), persistent=False)

    # ---- per-tensor scales (delayed and tensorwise) and the fused casts (kernels/fp8_cast.py)
    def _impl(self, x: torch.Tensor) -> str:
        """The cast path ('triton' or 'torch') for tensors on x's device (kernels/dispatch.py's `fp8_cast`)."""
        impl = self._impls.get(x.device.type)
        if impl is None:
            impl = self._impls[x.device.type] = self.cast_impl(x.device.type)
        return impl

    def _record(self, x: torch.Tensor, tensor: int) -> None:
        """Delayed scaling while calibrating: fold x's amax into the iteration's pending amax (training only)."""
        if self.owner.training:
            pending = self.owner.fp8_amax_pending[tensor : tensor + 1]
            torch.maximum(pending, tensor_amax(x, self._impl(x)), out=pending)

    @property
    def calibrating(self) -> bool:
        """Delayed scaling before its first update: the GEMMs run in the model's precision and only record
        amaxes (a fixed first scale, TE's 1, would flush small gradients by a layout-dependent amount)."""
        return self.recipe.delayed and not self.has_history

    def _scale(self, x: torch.Tensor, tensor: int, groups) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, scale_inv) of x: delayed scaling's buffers (views, nothing computed), or the current
        scale from x's amax (one reduction pass, reduced over `groups`, derived on the device)."""
        if self.recipe.delayed:
            return self.owner.fp8_scale[tensor], self.owner.fp8_scale_inv[tensor]
        scale = current_scale(all_reduce_max(tensor_amax(x, self._impl(x)), *groups), self.recipe.dtype(tensor))
        return scale, scale.reciprocal()

    def _quantize(self, x, scale, tensor, *, rowwise=True, columnwise=False, record=False):
        """(FP8 x, FP8 x^T) in one pass; `record`: delayed scaling folds x's amax into the pending one."""
        record = record and self.recipe.delayed and self.owner.training
        pending = self.owner.fp8_amax_pending[tensor : tensor + 1] if record else None
        dtype = self.recipe.dtype(tensor)
        return quantize(
            x.contiguous(), scale, dtype, self._impl(x), rowwise=rowwise, columnwise=columnwise, amax_out=pending
        )

    # ---- block scaling: 1x128 along the contraction dimension for activations and gradients, 128x128 weights
    def _rows(self, x2d: torch.Tensor, tensor: int, cols, full_cols, group):
        """1x128 blocks of x2d on the full tensor's column grid (`cols`: each local column's full index)."""
        rows = torch.arange(x2d.shape[0], device=x2d.device)
        shape = (x2d.shape[0], full_cols)
        return quantize_blocks(x2d, rows, cols, (1, BLOCK), shape, self.recipe.dtype(tensor), group)

    def _whole_blocks(self, x2d, block_rows, tensor, *, rowwise=True, columnwise=False):
        """(FP8 x, FP8 x^T, scale_inv grid) of x on its own block grid (kernels/fp8_blocks.py): one pass."""
        dtype, impl = self.recipe.dtype(tensor), self._impl(x2d)
        return quantize_whole_blocks(x2d, block_rows, dtype, impl, rowwise=rowwise, columnwise=columnwise)

    def _weight_blocks(self, weight: torch.Tensor):
        out, inp = _arange(self._out, weight.device), _arange(self._in, weight.device)
        dtype = self.recipe.dtype(WEIGHT)
        return quantize_blocks(weight, out, inp, (BLOCK, BLOCK), self.full_shape, dtype, self._block_group)

    # ---- the three products
    def forward(self, x2d: torch.Tensor, weight: torch.Tensor):
        """(x W^T in x's dtype, what backward reuses: `Saved` (None calibrating or under block scaling))."""
        if self.calibrating:
            self._record(x2d, INPUT)
            self._record(weight, WEIGHT)
            return x2d.mm(weight.t()), None
        if self.recipe.recipe == "blockwise" and self._block_group is None:  # blocks whole on this rank
            x_data, _, x_inv = self._whole_blocks(x2d, 1, INPUT)
            w_data, _, w_inv = self._whole_blocks(weight, BLOCK, WEIGHT)
            return block_mm(x_data, x_inv, w_data, w_inv, BLOCK, x2d.dtype), None
        if self.recipe.recipe == "blockwise":  # blocks cut by tp: the per-element block scales, emulated
            cols = _arange(self._in, x2d.device)
            xq = self._rows(x2d, INPUT, cols, self.full_shape[1], self._in_group)
            return fp8_mm(*xq, *self._weight_blocks(weight), x2d.dtype), None
        x_scale, x_inv = self._scale(x2d, INPUT, self.activation_groups)
        w_scale, w_inv = self._scale(weight, WEIGHT, (self.weight_group,))
        x_data, _ = self._quantize(x2d, x_scale, INPUT, record=True)
        w_data, _ = self._quantize(weight, w_scale, WEIGHT, record=True)
        return fp8_mm(x_data, x_inv, w_data, w_inv, x2d.dtype), Saved(x_scale, x_inv, w_scale, w_inv)

    def quantize_grad(self, g2d: torch.Tensor, dgrad: bool = True) -> QuantizedGrad | None:
        """The output gradient in FP8 for both backward GEMMs, in one pass: row-major for dgrad (when
        `dgrad`), transposed for wgrad (under FP8 wgrad). None under block scaling (each GEMM blocks it
        its own way) and while calibrating (its amax recorded)."""
        if self.recipe.recipe == "blockwise":
            return None
        if self.calibrating:
            self._record(g2d, GRAD)
            return None
        scale, scale_inv = self._scale(g2d, GRAD, self.activation_groups)
        rowwise, columnwise = self._quantize(g2d, scale, GRAD, rowwise=dgrad, columnwise=self.recipe.wgrad, record=True)
        return QuantizedGrad(rowwise, columnwise, scale_inv)

    def dgrad(self, g2d: torch.Tensor, weight: torch.Tensor, saved: Saved, grad: QuantizedGrad) -> torch.Tensor:
        """dY W, in dY's dtype: the weight cast-transposed with its forward scale (one pass, no copy after)."""
        if self.calibrating:
            return g2d.mm(weight)
        if self.recipe.recipe == "blockwise" and self._block_group is None:
            g_data, _, g_inv = self._whole_blocks(g2d, 1, GRAD)
            _, w_t, w_inv = self._whole_blocks(weight, BLOCK, WEIGHT, rowwise=False, columnwise=True)
            return block_mm(g_data, g_inv, w_t, w_inv.t(), BLOCK, g2d.dtype)
        if self.recipe.recipe == "blockwise":
            cols = _arange(self._out, g2d.device)
            gq = self._rows(g2d, GRAD, cols, self.full_shape[0], self._out_group)
            w_data, w_scale_inv = self._weight_blocks(weight)
            return fp8_mm(*gq, w_data.t(), w_scale_inv.t(), g2d.dtype)
        _, w_t = self._quantize(weight, saved.w_scale, WEIGHT, rowwise=False, columnwise=True)
        return fp8_mm(grad.rowwise, grad.scale_inv, w_t, saved.w_inv, g2d.dtype)

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor, saved: Saved, grad: QuantizedGrad) -> torch.Tensor:
        """dY^T X in fp32 (added into main_grad, or rounded to the weight's dtype for autograd): the input
        cast-transposed with its forward scale, the gradient's transpose from `quantize_grad`."""
        if not self.recipe.wgrad or self.calibrating:
            return g2d.t().mm(x2d).float()
        if self.recipe.recipe == "blockwise":  # blocks of 128 tokens (this rank's tokens: see docs/fp8.md)
            g_t, _, g_inv = self._whole_blocks(g2d.t(), 1, GRAD)  # the transposed views read in place
            x_t, _, x_inv = self._whole_blocks(x2d.t(), 1, INPUT)
            return block_mm(g_t, g_inv, x_t, x_inv, 1, torch.float32)
        _, x_t = self._quantize(x2d, saved.x_scale, INPUT, rowwise=False, columnwise=True)
        return fp8_mm(grad.columnwise, grad.scale_inv, x_t, saved.x_inv, torch.float32)
