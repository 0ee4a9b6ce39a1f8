"""Autograd-aware collectives of tensor and sequence parallelism.

Activations are laid out [s, b, h]: the sequence dimension is dim 0 (split by
sequence parallelism), the hidden dimension is the last one (split by tensor
parallelism). Every function is the identity when the group has one rank.

Each collective adds the bytes it moves to `COMM_STATS`, so benchmarks compare
the volume really communicated with the analytic one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes of tensor-parallel payload per collective kind (input size of an all-reduce,
    full output size of an all-gather, full input size of a reduce-scatter)."""

    enabled: bool = False
    bytes: dict = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        if self.enabled:
            self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()

    @contextlib.contextmanager
    def counting(self):
        self.bytes, self.enabled = {}, True
        try:
            yield self
        finally:
            self.enabled = False


COMM_STATS = CommStats()


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    COMM_STATS.add("all_reduce", x)
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    gathered = _gather_first(x.movedim(-1, 0).contiguous(), group)
    return gathered.movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    COMM_STATS.add("all_gather", out)
    dist.all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    COMM_STATS.add("reduce_scatter", x)
    dist.reduce_scatter_single(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient across the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) across the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if _size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather along the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence (dim 0). Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0 (the gathered
    activation feeds a tensor-parallel matmul, so each rank holds a partial gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0. Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceRegion.apply(x, group)
