"""Flat gradient buffers split into buckets, all-reduced as soon as a bucket is complete.

Each parameter's `main_grad` is a view into one contiguous buffer (fp32 by
default, whatever the parameter dtype), so microbatch gradients accumulate in
fp32 and a bucket is one collective. Buckets cover parameters in reverse
registration order, roughly the order backward produces their gradients, so the
first buckets can be reduced while backward still runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Bucket:
    """A contiguous slice of the buffer and the parameters whose gradients fill it."""

    def __init__(self, data: torch.Tensor, params: list):
        self.data = data
        self.params = set(params)
        self.ready: set = set()
        self.handle = None

    def reset(self) -> None:
        self.ready.clear()
        self.handle = None


class GradBuffer:
    def __init__(self, params: list, *, dtype: torch.dtype, bucket_size: int, group, average: bool = True):
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.average = average
        total = sum(p.numel() for p in params)
        self.data = torch.zeros(total, dtype=dtype, device=params[0].device if params else None)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict = {}
        offset, bucket_start, bucket_params = 0, 0, []
        for param in params:
            param.main_grad = self.data[offset: offset + param.numel()].view(param.shape)
            offset += param.numel()
            bucket_params.append(param)
            if offset - bucket_start >= bucket_size or param is params[-1]:
                self._add_bucket(bucket_start, offset, bucket_params)
                bucket_start, bucket_params = offset, []

    def _add_bucket(self, start: int, end: int, params: list) -> None:
        bucket = Bucket(self.data[start:end], params)
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket

    def zero(self) -> None:
        self.data.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def mark_ready(self, param) -> None:
        """Record that `param`'s gradient is final; launch its bucket's reduction when complete."""
        bucket = self.bucket_of[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.handle is not None or self.group_size == 1:
            return
        if self.average:
            bucket.data.div_(self.group_size)
        bucket.handle = dist.all_reduce(bucket.data, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch buckets whose parameters got no gradient hook (unused ones), then wait for all."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.reset()
