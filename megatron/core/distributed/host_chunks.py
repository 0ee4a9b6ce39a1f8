"""Host-resident gradient and parameter shards of a rank's buckets, and their traffic.

`placement.Placement` says which chunks keep which part in host memory. `HostChunks` cuts one
host slab for all of it (the optimizer state's part too, taken by the optimizer) before the
buffers exist, hands each bucket its host-resident gradient and parameter shards as the bucket
is made (so they never exist on the device, and building holds one whole bucket at a time on
it), and moves their bytes during training:
- gradients: each microbatch's reduce-scattered gradient of a bucket (a device tensor) is
  copied into one of two host staging slots and added into the host shard by a worker thread
  once the copy has landed, so neither the training thread nor the device waits for the
  addition; `settle()` waits for all of them before anything reads the gradients (the norm,
  the CPU step);
- parameters: when a bucket is gathered, this rank's host shard is copied into its own slot of
  the gathered bucket, which is then all-gathered in place. The module hooks start a bucket's
  gather one module ahead of its use (param_gather.py); `FetchStats` counts the gathers that
  were started ahead and the time the training thread still waited for them.
On a machine without CUDA host = device: the copies are plain copies, the same code path.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron.core.distributed.host_memory import HostMemory, Transfers
from megatron.core.distributed.placement import ADD_STAGING_SLOTS, Placement, host_elements, shard_numels


@dataclass
class FetchStats:
    """Since the last `take_stats`: bytes of gradient and parameter shards moved each way, the
    gathers of host-resident parameters (`prefetched`: started ahead of the module that needed
    them), and the seconds the training thread waited for those gathers to land."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    fetches: int = 0
    prefetched: int = 0
    wait_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.prefetched / self.fetches if self.fetches else 1.0


class HostChunks:
    """`layouts`: the BufferLayouts of the rank's ParamAndGradBuffers, not made yet (their buckets
    in build_shards' order, the order `next_shards` is asked in); `model_dtype`: the weights'."""

    def __init__(self, layouts: list, placement: Placement, model_dtype: torch.dtype, device: torch.device):
        self.placement = placement
        self.numels = shard_numels(layouts)
        self.memory = HostMemory(host_elements(self.numels, placement, model_dtype.itemsize), pin=device.type == "cuda")
        self.transfers = Transfers(device)
        largest = max((self.numels[i] for i in placement.grads), default=0)
        self._staging = [self.memory.empty(largest) for _ in range(ADD_STAGING_SLOTS if placement.grads else 0)]
        self._adds: list = [None] * len(self._staging)
        self._next_slot = 0
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-grad-add") if placement.grads else None
        )
        self._made = 0  # buckets given their shards so far
        self.stats = FetchStats()

    def next_shards(
        self, numel: int, dtype: torch.dtype, grad_dtype: torch.dtype, shards_params: bool, shards_grads: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (parameter, gradient) shards of the next bucket made, cut from the slab (zeroed) where
        the placement puts them on host, else None (the bucket makes that part on the device)."""
        index, self._made = self._made, self._made + 1
        if index >= len(self.numels) or numel != self.numels[index]:
            raise ValueError(
                f"bucket {index} of {numel} elements is not the placed layout's ({len(self.numels)} buckets)"
            )
        params, grads = index in self.placement.params, index in self.placement.grads
        if (grads and not shards_grads) or (params and not shards_params):
            raise ValueError(
                "host-resident gradients need sharded gradients (--data-parallel-sharding-strategy "
                "optim_grads or optim_grads_params), host-resident parameters optim_grads_params"
            )
        param = self.memory.empty_as(numel, dtype).zero_() if params else None
        grad = self.memory.empty_as(numel, grad_dtype).zero_() if grads else None
        return param, grad

    # ---- gradients ----

    def add_into(self, host_shard: torch.Tensor, gradient: torch.Tensor) -> None:
        """host_shard += gradient (a device tensor), asynchronously (see the module docstring)."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._staging)
        if self._adds[slot] is not None:
            self._adds[slot].result()  # the slot's previous addition has read it
        staging = self._staging[slot][: gradient.numel()]
        self.transfers.side_waits_for_current()  # the reduce-scatter has written `gradient` on the current stream
        copied = self.transfers.copy(staging, gradient)
        self.stats.d2h_bytes += gradient.numel() * gradient.element_size()
        # the worker holds `gradient` until its copy has landed, so its memory is not reused before
        self._adds[slot] = self._worker.submit(self._add, host_shard, staging, copied, gradient)

    @staticmethod
    def _add(host_shard, staging, copied, _gradient) -> None:
        Transfers.synchronize(copied)
        host_shard.add_(staging)

    def settle(self) -> None:
        """Wait for every gradient addition in flight."""
        for slot, future in enumerate(self._adds):
            if future is not None:
                future.result()
                self._adds[slot] = None

    # ---- parameters ----

    def fetch(self, slot: torch.Tensor, host_shard: torch.Tensor) -> None:
        """Copy this rank's host shard into its slot of the gathered bucket (on the stream the
        gather is issued on, so the gather sees it)."""
        slot.copy_(host_shard, non_blocking=True)
        self.stats.h2d_bytes += host_shard.numel() * host_shard.element_size()

    def record_use(self, started_ahead: bool) -> None:
        self.stats.fetches += 1
        self.stats.prefetched += int(started_ahead)

    def record_wait(self, seconds: float) -> None:
        self.stats.wait_seconds += seconds

    def take_stats(self) -> FetchStats:
        stats, self.stats = self.stats, FetchStats()
        return stats
