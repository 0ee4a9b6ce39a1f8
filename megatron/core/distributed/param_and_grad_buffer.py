"""Flat parameter and gradient buffers of one model chunk, and the collectives of their buckets.

Every parameter's storage becomes a view into one contiguous parameter buffer (model
dtype) and its `main_grad` a view into one gradient buffer (fp32 by default, whatever the
weights), laid out by `BufferLayout`. Microbatch gradients accumulate there in fp32, and
each bucket (memory chunk) is reduced over the dp x cp group with one collective:
- replicated optimizer: an all-reduce, after which every rank holds the whole averaged bucket;
- distributed optimizer: a reduce-scatter, after which each rank holds only its shard of the
  averaged bucket (the rest of the bucket is stale and never read); after the optimizer
  step each bucket's parameters are all-gathered from the updated shards.
"Local shard" below means this rank's shard (the whole bucket when replicated): the part of
the gradient that is valid after the reduction and that this rank's optimizer steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.bucket_layout import SHARD_ALIGN, BufferLayout


class Bucket:
    """Views of one bucket in both buffers, the parameters whose gradients fill it, and the
    handles of its collectives in flight."""

    def __init__(self, place, param_data: torch.Tensor, grad_data: torch.Tensor, params: list, group,
                 shard_rank: int):
        self.param = param_data[place.start: place.end]
        self.grad = grad_data[place.start: place.end]
        start, end = place.shard(shard_rank)
        self.param_shard, self.grad_shard = param_data[start:end], grad_data[start:end]
        self.params = set(params)
        self.group, self.group_size = group, dist.get_world_size(group)
        self.sharded = place.shards > 1
        self.ready: set = set()
        self.reducing = False
        self.grad_handle = self.param_handle = None

    def start_grad_reduce(self) -> None:
        """Average the bucket over the group, asynchronously (once per iteration)."""
        if self.reducing:
            return
        self.reducing = True
        if self.group_size == 1:
            return
        self.grad.div_(self.group_size)  # gloo has no AVG: sum of the pre-divided gradients
        if self.sharded:
            self.grad_handle = dist.reduce_scatter_single(self.grad_shard, self.grad, group=self.group,
                                                          async_op=True)
        else:
            self.grad_handle = dist.all_reduce(self.grad, group=self.group, async_op=True)

    def finish_grad_reduce(self) -> None:
        self.start_grad_reduce()
        if self.grad_handle is not None:
            self.grad_handle.wait()
        self.ready.clear()
        self.reducing, self.grad_handle = False, None

    def start_param_gather(self) -> None:
        """Gather every rank's updated shard into the whole bucket of the parameter buffer."""
        if self.sharded and self.param_handle is None:
            self.param_handle = dist.all_gather_single(self.param, self.param_shard, group=self.group,
                                                       async_op=True)

    def finish_param_gather(self) -> None:
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None


class ParamAndGradBuffer:
    """`named_params`: (name, parameter) in the order backward produces their gradients.
    `sharded`: split each bucket over the group (distributed optimizer) instead of replicating it."""

    def __init__(self, named_params: list, *, grad_dtype: torch.dtype, bucket_size: int, group, sharded: bool):
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) > 1:
            raise ValueError(f"a model chunk's parameters must share one dtype for its flat buffer, got {dtypes}")
        shards = dist.get_world_size(group) if sharded else 1
        self.layout = BufferLayout([(n, p.numel(), getattr(p, "shared_embedding", False)) for n, p in named_params],
                                   bucket_size, shards, SHARD_ALIGN)
        self.shard_rank = dist.get_rank(group) if sharded else 0
        device = named_params[0][1].device if named_params else None
        dtype = dtypes.pop() if dtypes else torch.float32
        self.param_data = torch.zeros(self.layout.numel, dtype=dtype, device=device)
        self.grad_data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        self.params = dict(named_params)
        for place in self.layout.params:
            param = self.params[place.name]
            view = self.param_data[place.start: place.end]
            view.copy_(param.detach().reshape(-1))
            param.data = view.view(param.shape)
            param.main_grad = self.grad_data[place.start: place.end].view(param.shape)
            param.grad_added_to_main_grad = False
        self.buckets = [Bucket(bucket, self.param_data, self.grad_data,
                               [self.params[p.name] for p in self.layout.params if p.bucket == index], group,
                               self.shard_rank)
                        for index, bucket in enumerate(self.layout.buckets)]
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        self.reuse_waits: list = []

    def zero(self) -> None:
        """Zero the gradients once whatever still reads them is done (`reuse_waits`: callables
        that make the current stream wait, e.g. for the offload optimizer's copies to host)."""
        for wait in self.reuse_waits:
            wait()
        self.reuse_waits = []
        self.grad_data.zero_()

    def mark_ready(self, param) -> None:
        """Record that `param`'s gradient is final; start its bucket's reduction once all are."""
        bucket = self.bucket_of[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            bucket.start_grad_reduce()

    def finish_grad_reduce(self) -> None:
        """Start buckets not started yet (no overlap, or parameters without gradients), wait for all."""
        for bucket in self.buckets:
            bucket.start_grad_reduce()
        for bucket in self.buckets:
            bucket.finish_grad_reduce()

    def start_param_gather(self) -> None:
        """All-gather buckets in the order the next forward uses them (the reverse of backward's)."""
        for bucket in reversed(self.buckets):
            bucket.start_param_gather()

    def finish_param_gather(self) -> None:
        for bucket in self.buckets:
            bucket.finish_param_gather()

    def local_grads(self, predicate=None) -> list[torch.Tensor]:
        """Views of the local shard of the gradient of every parameter for which `predicate(param)`
        holds (all when None), in buffer order: the same order and sizes on every rank whose
        buffers have the same layout, so such ranks can reduce them together."""
        out = []
        for index, bucket in enumerate(self.buckets):
            for piece in self.layout.pieces(index, self.shard_rank):
                if predicate is None or predicate(self.params[piece.name]):
                    out.append(bucket.grad_shard[piece.shard_start: piece.shard_end])
        return out
