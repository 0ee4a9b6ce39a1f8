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

from megatron.core.distributed import collectives


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
    gathered = all_gather_sequence(x.movedim(-1, 0).contiguous(), group)
    return gathered.movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    COMM_STATS.add("all_gather", out)
    collectives.all_gather_single(out, x, group=group)
    return out


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    COMM_STATS.add("reduce_scatter", x)
    collectives.reduce_scatter_single(out, x, group=group)
    return out


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _all_reduce_out_of_place(x: torch.Tensor, group) -> torch.Tensor:
    # autograd must not see its input modified in place
    return _all_reduce(x.clone() if _size(group) > 1 else x, group)


def _region(name: str, forward_op, backward_op, doc: str):
    """An autograd Function applying `forward_op` forward and `backward_op` to the gradient; over a
    group of one rank (both ops the identity) the input itself, without a node in the graph."""

    class _Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward_op(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward_op(grad, ctx.group), None

    _Region.__name__ = _Region.__qualname__ = name
    _Region.__doc__ = doc

    def region(x: torch.Tensor, group) -> torch.Tensor:
        return x if _size(group) == 1 else _Region.apply(x, group)

    region.__name__ = region.__qualname__ = name
    region.__doc__ = doc
    return region


copy_to_tensor_parallel_region = _region(
    "CopyToRegion", _identity, _all_reduce, "Forward: identity. Backward: all-reduce (sum) the gradient."
)
reduce_from_tensor_parallel_region = _region(
    "ReduceFromRegion", _all_reduce_out_of_place, _identity, "Forward: all-reduce (sum). Backward: identity."
)
scatter_to_tensor_parallel_region = _region(
    "ScatterToRegion",
    _split_last,
    _gather_last,
    "Forward: keep this rank's slice of the last dim. Backward: all-gather along the last dim.",
)
gather_from_tensor_parallel_region = _region(
    "GatherFromRegion",
    _gather_last,
    _split_last,
    "Forward: all-gather along the last dim. Backward: keep this rank's slice.",
)
scatter_to_sequence_parallel_region = _region(
    "ScatterToSequenceRegion",
    _split_first,
    all_gather_sequence,
    "Forward: keep this rank's slice of the sequence (dim 0). Backward: all-gather along dim 0.",
)
gather_from_sequence_parallel_region = _region(
    "GatherFromSequenceRegion",
    all_gather_sequence,
    reduce_scatter_sequence,
    "Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0 (the gathered activation "
    "feeds a tensor-parallel matmul, so each rank holds a partial gradient).",
)
reduce_scatter_to_sequence_parallel_region = _region(
    "ReduceScatterToSequenceRegion",
    reduce_scatter_sequence,
    all_gather_sequence,
    "Forward: reduce-scatter along dim 0. Backward: all-gather along dim 0.",
)
