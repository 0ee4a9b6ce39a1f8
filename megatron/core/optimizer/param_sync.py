"""The optimizer's last part: updated master shards back into the model's parameters.

Copy each shard's fp32 master weights into the parameter buffer in the model dtype (nothing
to copy when the weights are fp32: the master is the parameter buffer), then all-gather
each bucket from the updated shards (distributed optimizer only; replicated buckets are
already whole). With `overlap_param_gather` the gathers are only started here and the
model chunks' forward pre-hooks wait for them before first use.

Offloaded shards arrive later, from the CPU step (offload.OffloadedSteps copies them back
itself): their buckets' gathers are deferred to a forward pre-hook of the first module that
uses them, which waits for the chunk's CPU step first. The hooks fire in module order, the
same on every rank, so the deferred collectives stay in step across ranks. Sharded parameters
(optim_grads_params) are gathered only when next used anyway: their buckets wait for the
CPU step just before that gather (`Bucket.before_gather`).
"""

from __future__ import annotations

import functools

import torch


class ParamSync:
    def __init__(self, shards: list, chunks: list, offload=None):
        self.shards, self.chunks, self.offload = shards, chunks, offload
        buckets = [bucket for chunk in chunks for buffer in chunk.buffers for bucket in buffer.buckets]  # shard order
        self.shard_of = {bucket: index for index, bucket in enumerate(buckets)}
        self.deferred: list = []  # buckets whose gather waits for their CPU step, in forward order
        self._hooks = [] if offload is None else self._register_hooks()

    def _register_hooks(self) -> list:
        hooks = []
        for chunk in self.chunks:
            for buffer in chunk.buffers:
                if buffer.shards_params:
                    continue
                for module in chunk.module.modules():
                    buckets = {buffer.bucket_of[p] for p in module.parameters(recurse=False) if p in buffer.bucket_of}
                    if any(self.shards[self.shard_of[b]].offloaded for b in buckets):
                        hooks.append(module.register_forward_pre_hook(self._release_hook(buckets), prepend=True))
        return hooks

    def _release_hook(self, buckets: set):
        def hook(*_):
            for bucket in [b for b in self.deferred if b in buckets]:
                self._release(bucket)

        return hook

    def _release(self, bucket) -> None:
        self.deferred.remove(bucket)
        self.offload.wait(self.shard_of[bucket])
        bucket.start_param_gather()
        bucket.finish_param_gather()

    @torch.no_grad()
    def start(self) -> None:
        for shard in self.shards:
            if not shard.aliased and not shard.offloaded:
                shard.model.copy_(shard.main)
        if self.offload is None:
            for chunk in self.chunks:
                chunk.start_param_gather()
            return
        for chunk in self.chunks:
            if chunk.buffer.shards_params:  # gathered when next used: after the shard's CPU step
                chunk.start_param_gather()
                for bucket in (b for buffer in chunk.buffers for b in buffer.buckets):
                    if self.shards[self.shard_of[bucket]].offloaded:
                        bucket.before_gather = functools.partial(self.offload.wait, self.shard_of[bucket])
                continue
            for buffer in chunk.buffers:
                for bucket in reversed(buffer.buckets):  # the order the next forward uses them
                    if self.shards[self.shard_of[bucket]].offloaded:
                        self.deferred.append(bucket)
                        continue
                    bucket.start_param_gather()
                    if not chunk.config.overlap_param_gather:
                        bucket.finish_param_gather()

    def finish(self) -> None:
        """Wait for every gather in flight and every deferred one (before reading parameters
        outside a forward)."""
        for bucket in list(self.deferred):
            self._release(bucket)
        for chunk in self.chunks:
            chunk.finish_param_gather()
            for buffer in chunk.buffers:
                for bucket in buffer.buckets:
                    bucket.wait_for_shard()
