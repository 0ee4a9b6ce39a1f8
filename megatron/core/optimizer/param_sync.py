"""The optimizer's last part: updated master shards back into the model's parameters.

Copy each shard's fp32 master weights into the parameter buffer in the model dtype (nothing
to copy when the weights are fp32: the master is the parameter buffer), then all-gather
each bucket from the updated shards (distributed optimizer only; replicated buckets are
already whole). With `overlap_param_gather` the gathers are only started here and the
model chunks' forward pre-hooks wait for them before first use.
"""
from __future__ import annotations

import torch


class ParamSync:
    def __init__(self, shards: list, chunks: list):
        self.shards, self.chunks = shards, chunks

    @torch.no_grad()
    def start(self) -> None:
        for shard in self.shards:
            if not shard.aliased:
                shard.model.copy_(shard.main)
        for chunk in self.chunks:
            chunk.start_param_gather()

    def finish(self) -> None:
        """Wait for every gather in flight (before reading parameters outside a forward)."""
        for chunk in self.chunks:
            chunk.finish_param_gather()
