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
"""

from __future__ import annotations

import torch

from megatron.core.fp8.gemm import fp8_mm
from megatron.core.fp8.recipe import BLOCK, GRAD, INPUT, WEIGHT, Fp8Recipe
from megatron.core.fp8.scaling import all_reduce_max, amax, cast, current_scale, quantize_blocks
from megatron.core.tensor_parallel.initialization import InitSpec, held_ranges

STATE_BUFFERS = ("fp8_amax_history", "fp8_scale")  # delayed scaling's state, saved in checkpoints


def is_fp8_state(name: str) -> bool:
    """Whether a checkpoint tensor is delayed scaling's state (optional on load, both ways)."""
    return name.rsplit(".", 1)[-1] in STATE_BUFFERS


def _global_index(shard, size: int, dim: int) -> tuple[list[tuple[int, int]], bool]:
    """(the full dimension's ranges this rank holds along `dim`, whether a block of BLOCK straddles ranks)."""
    ranges = held_ranges(shard if shard is not None and shard.dim == dim else None, size)
    straddles = any(start % BLOCK or (stop % BLOCK and stop != size) for start, stop in ranges)
    return ranges, straddles


def _arange(ranges, device) -> torch.Tensor:
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in ranges])


class Fp8Gemms:
    """The FP8 GEMMs of the linear layer `owner` (a module with a 2-D `weight` carrying its InitSpec)."""

    def __init__(self, recipe: Fp8Recipe, owner: torch.nn.Module, *, weight_group, activation_groups, expert: bool):
        self.recipe, self.owner, self.expert = recipe, owner, expert
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

    # ---- per-tensor scales (delayed and tensorwise)
    def _record(self, x: torch.Tensor, tensor: int) -> None:
        """Delayed scaling: fold this cast's amax into the iteration's pending amax (training only)."""
        if self.owner.training:
            pending = self.owner.fp8_amax_pending
            pending[tensor] = torch.maximum(pending[tensor], amax(x))

    @property
    def calibrating(self) -> bool:
        """Delayed scaling before its first update: the GEMMs run in the model's precision and only record
        amaxes (a fixed first scale, TE's 1, would flush small gradients by a layout-dependent amount)."""
        return self.recipe.delayed and not self.has_history

    def _scale(self, x: torch.Tensor, tensor: int, groups) -> torch.Tensor:
        if self.recipe.delayed:
            self._record(x, tensor)
            return self.owner.fp8_scale[tensor]
        return current_scale(all_reduce_max(amax(x), *groups), self.recipe.dtype(tensor))

    def _cast(self, x, scale, tensor):
        return cast(x, scale, self.recipe.dtype(tensor)), scale.reciprocal()

    # ---- block scaling: 1x128 along the contraction dimension for activations and gradients, 128x128 weights
    def _rows(self, x2d: torch.Tensor, tensor: int, cols=None, full_cols=None, group=None):
        cols = torch.arange(x2d.shape[1], device=x2d.device) if cols is None else cols
        rows = torch.arange(x2d.shape[0], device=x2d.device)
        shape = (x2d.shape[0], x2d.shape[1] if full_cols is None else full_cols)
        return quantize_blocks(x2d, rows, cols, (1, BLOCK), shape, self.recipe.dtype(tensor), group)

    def _weight_blocks(self, weight: torch.Tensor):
        out, inp = _arange(self._out, weight.device), _arange(self._in, weight.device)
        dtype = self.recipe.dtype(WEIGHT)
        return quantize_blocks(weight, out, inp, (BLOCK, BLOCK), self.full_shape, dtype, self._block_group)

    # ---- the three products
    def forward(self, x2d: torch.Tensor, weight: torch.Tensor):
        """(x W^T in x's dtype, what backward reuses: the per-tensor scales of x and W)."""
        if self.calibrating:
            self._record(x2d, INPUT)
            self._record(weight, WEIGHT)
            return x2d.mm(weight.t()), None
        if self.recipe.recipe == "blockwise":
            cols = _arange(self._in, x2d.device)
            xq = self._rows(x2d, INPUT, cols, self.full_shape[1], self._in_group)
            return fp8_mm(*xq, *self._weight_blocks(weight), x2d.dtype), None
        x_scale = self._scale(x2d, INPUT, self.activation_groups)
        w_scale = self._scale(weight, WEIGHT, (self.weight_group,))
        y = fp8_mm(*self._cast(x2d, x_scale, INPUT), *self._cast(weight, w_scale, WEIGHT), x2d.dtype)
        return y, (x_scale, w_scale)

    def grad_scale(self, g2d: torch.Tensor):
        """The output gradient's per-tensor scale, shared by dgrad and wgrad (None under block scaling)."""
        if self.recipe.recipe == "blockwise":
            return None
        if self.calibrating:
            self._record(g2d, GRAD)
            return None
        return self._scale(g2d, GRAD, self.activation_groups)

    def dgrad(self, g2d: torch.Tensor, weight: torch.Tensor, saved, g_scale) -> torch.Tensor:
        """dY W, in dY's dtype."""
        if self.calibrating:
            return g2d.mm(weight)
        if self.recipe.recipe == "blockwise":
            cols = _arange(self._out, g2d.device)
            gq = self._rows(g2d, GRAD, cols, self.full_shape[0], self._out_group)
            w_data, w_scale_inv = self._weight_blocks(weight)
            return fp8_mm(*gq, w_data.t(), w_scale_inv.t(), g2d.dtype)
        w_data, w_scale_inv = self._cast(weight, saved[1], WEIGHT)
        return fp8_mm(*self._cast(g2d, g_scale, GRAD), w_data.t(), w_scale_inv, g2d.dtype)

    def wgrad(self, g2d: torch.Tensor, x2d: torch.Tensor, saved, g_scale) -> torch.Tensor:
        """dY^T X in fp32 (added into main_grad, or rounded to the weight's dtype for autograd)."""
        if not self.recipe.wgrad or self.calibrating:
            return g2d.t().mm(x2d).float()
        if self.recipe.recipe == "blockwise":  # blocks of 128 tokens (this rank's tokens: see docs/fp8.md)
            return fp8_mm(*self._rows(g2d.t(), GRAD), *self._rows(x2d.t(), INPUT), torch.float32)
        g_data, g_scale_inv = self._cast(g2d, g_scale, GRAD)
        x_data, x_scale_inv = self._cast(x2d, saved[0], INPUT)
        return fp8_mm(g_data.t(), g_scale_inv, x_data.t(), x_scale_inv, torch.float32)
