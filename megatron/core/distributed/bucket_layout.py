"""Where each parameter of one model chunk lives in its flat buffers, and which part each rank owns.

Pure arithmetic (no processes, no tensors), so the gradient reduction, the optimizer's
shards and, later, sharded checkpoints all read one description that unit tests check
alone.

Parameters are laid out in the order given (the caller passes the order in which backward
produces their gradients) and cut into buckets (memory chunks): a bucket closes after the
parameter that brings it to `bucket_size` elements. A parameter flagged `own_bucket` (an
embedding tied across pipeline stages) gets a bucket to itself, so the first and last stage
shard it identically and can sum their shards of its gradient. With `shards` > 1 (the
distributed optimizer over dp x cp ranks) each bucket is padded to a multiple of
`shards * align` elements and split into equal shards: rank r owns
[start + r * shard_numel, start + (r + 1) * shard_numel). A parameter may straddle two
ranks' shards; each rank sees its part of it as a `ShardPiece`. `align` keeps every shard
boundary on a multiple of `align` elements (coalesced collective and optimizer accesses on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

SHARD_ALIGN = 64  # elements: 256 bytes of fp32 gradient, 128 of bf16 weight
# Megatron-FSDP's names for what is sharded over dp x cp (param_and_grad_buffer.py says how)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def default_bucket_size(shards: int) -> int:
    """Megatron's automatic bucket size, max(40M, 1M x shards) elements: few collectives, and the
    padding (< shards x SHARD_ALIGN elements per bucket) stays below 0.007% of the buffer."""
    return max(40_000_000, 1_000_000 * shards)


@dataclass(frozen=True)
class ParamPlace:
    """One parameter's elements [start, start + numel) of the buffer, inside bucket `bucket`."""

    name: str
    bucket: int
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class BucketPlace:
    """Elements [start, end) of the buffer (padding included), split into `shards` equal shards."""

    start: int
    end: int
    shards: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    def shard(self, rank: int) -> tuple[int, int]:
        """Buffer range [start, end) owned by shard `rank`."""
        start = self.start + rank * self.shard_numel
        return start, start + self.shard_numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of parameter `name` inside one rank's shard of a bucket: shard elements
    [shard_start, shard_start + numel) are the parameter's flattened elements
    [param_start, param_start + numel)."""

    name: str
    shard_start: int
    param_start: int
    numel: int

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.numel


class BufferLayout:
    """Buckets and parameter places of one buffer; `params` entries are (name, numel, own_bucket)."""

    def __init__(self, params: list[tuple[str, int, bool]], bucket_size: int, shards: int = 1, align: int = 1):
        if bucket_size < 1 or shards < 1 or align < 1:
            raise ValueError(f"need bucket_size, shards and align >= 1, got {bucket_size}, {shards}, {align}")
        self.shards = shards
        self.params: list[ParamPlace] = []
        self.buckets: list[BucketPlace] = []
        multiple = shards * align if shards > 1 else 1
        offset, bucket_start = 0, 0
        for index, (name, numel, own_bucket) in enumerate(params):
            if own_bucket and offset > bucket_start:
                offset = bucket_start = self._close(bucket_start, offset, multiple)
            self.params.append(ParamPlace(name, len(self.buckets), offset, numel))
            offset += numel
            last = index == len(params) - 1
            if own_bucket or last or offset - bucket_start >= bucket_size:
                offset = bucket_start = self._close(bucket_start, offset, multiple)
        self.numel = offset

    def _close(self, start: int, end: int, multiple: int) -> int:
        """Add the bucket [start, end) padded to `multiple`; return where the next one starts."""
        padded = start + -(-(end - start) // multiple) * multiple
        self.buckets.append(BucketPlace(start, padded, self.shards))
        return padded

    def pieces(self, bucket: int, rank: int) -> list[ShardPiece]:
        """The parameters (or parts of them) in shard `rank` of `bucket`, in buffer order."""
        start, end = self.buckets[bucket].shard(rank)
        out = []
        for place in self.params:
            if place.bucket != bucket or place.end <= start or place.start >= end:
                continue
            first, last = max(place.start, start), min(place.end, end)
            out.append(ShardPiece(place.name, first - start, first - place.start, last - first))
        return out
