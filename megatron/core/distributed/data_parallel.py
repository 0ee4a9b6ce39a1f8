"""Data-parallel wrapper: gradient hooks feed the flat buffers; reduction overlaps backward.

Usage per iteration: `zero_grad_buffer()`; for each microbatch call
`set_is_last_microbatch(...)` before its backward (the reduction only runs on
the last one); after backward, `finish_grad_sync()` waits for every bucket.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.distributed.grad_buffer import GradBuffer


@dataclass
class DDPConfig:
    bucket_size: int = 40_000_000
    grad_dtype: torch.dtype = torch.float32
    average_in_collective: bool = True


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, config: DDPConfig, dp_cp_group):
        super().__init__()
        self.module = module
        self.sync_now = True
        params = [p for p in module.parameters() if p.requires_grad]
        self.buffer = GradBuffer(list(reversed(params)), dtype=config.grad_dtype, bucket_size=config.bucket_size,
                                 group=dp_cp_group, average=config.average_in_collective)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in params]

    def _accumulate(self, param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.sync_now:
            self.buffer.mark_ready(param)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_is_last_microbatch(self, last: bool) -> None:
        self.sync_now = last

    def zero_grad_buffer(self) -> None:
        self.buffer.zero()

    def finish_grad_sync(self) -> None:
        self.buffer.finish()
        self.sync_now = True
