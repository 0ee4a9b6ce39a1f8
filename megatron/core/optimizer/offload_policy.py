"""Which shards (memory chunks) of the optimizer live in host memory, and what each place holds.

Chunks are ranked by when the next forward needs them: the first layers' chunks first (model
chunk 0 before 1, and within a model chunk the buckets in reverse backward order). Offloading
takes chunks from the *end* of that order, because the forward reaches them last, so their
CPU step has the longest time to hide; keeping on the device takes them from the front.

- static (`--optimizer-offload-fraction f`): the chunks at the end of the order holding the
  nearest to f of the elements go to host;
- auto: everything starts on host; after the first iteration the peak device memory that is
  not model state (activations, transients) is known, and as many chunks as fit under the
  device budget minus that peak and a margin move back to the device, front of the order first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO_MARGIN = 0.10  # of the device budget: allocator fragmentation and what one iteration did not show


def forward_order(buffers: list) -> list[int]:
    """Shard indices (build_shards' order: buffer by buffer, buckets in backward order) in the
    order the next forward uses them."""
    order, first = [], 0
    for buffer in buffers:
        order += list(reversed(range(first, first + len(buffer.buckets))))
        first += len(buffer.buckets)
    return order


def static_offloaded(order: list[int], numels: list[int], fraction: float) -> frozenset:
    """The chunks at the end of `order` whose elements come nearest to `fraction` of all."""
    target, taken, out = fraction * sum(numels), 0, set()
    for index in reversed(order):
        if taken + numels[index] / 2 >= target:
            break
        taken += numels[index]
        out.add(index)
    return frozenset(out)


def state_bytes_per_element(model_dtype: torch.dtype) -> int:
    """Device bytes an element's state takes when kept on the device: Adam's moments, plus an
    fp32 master copy unless the weights are fp32."""
    return 8 + (0 if model_dtype == torch.float32 else 4)


@dataclass(frozen=True)
class AutoDecision:
    budget_bytes: int | None
    model_bytes: int        # weights + gradient buffers on the device (never offloaded)
    peak_other_bytes: int   # measured peak of everything else during the first iteration
    margin_bytes: int
    keep: tuple[int, ...]   # chunks whose state moves to the device
    kept_bytes: int
    host_chunks: int

    def describe(self) -> str:
        if self.budget_bytes is None:
            return (f"> offload policy auto: no device memory limit known (CPU without --device-memory-gb): all "
                    f"{len(self.keep)} chunks' optimizer state on the device")
        return (f"> offload policy auto: budget {_size(self.budget_bytes)} - weights and gradients "
                f"{_size(self.model_bytes)} - measured peak of activations and transients "
                f"{_size(self.peak_other_bytes)} - margin {_size(self.margin_bytes)}: keeping {len(self.keep)} "
                f"chunks ({_size(self.kept_bytes)} of optimizer state) on the device, {self.host_chunks} on host")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def auto_keep(order: list[int], numels: list[int], per_element: int, budget_bytes: int | None, model_bytes: int,
              peak_other_bytes: int) -> AutoDecision:
    """As many chunks (front of `order` first) as fit under the budget."""
    if budget_bytes is None:
        return AutoDecision(None, model_bytes, peak_other_bytes, 0, tuple(order),
                            per_element * sum(numels), 0)
    margin = int(AUTO_MARGIN * budget_bytes)
    room = budget_bytes - model_bytes - peak_other_bytes - margin
    keep, used = [], 0
    for index in order:
        cost = per_element * numels[index]
        if used + cost > room:
            break
        keep.append(index)
        used += cost
    return AutoDecision(budget_bytes, model_bytes, peak_other_bytes, margin, tuple(keep), used,
                        len(order) - len(keep))


def placement_bytes(adam) -> tuple[int, int]:
    """(device, host) bytes of optimizer state: on the device counted from the tensors that exist
    (master copies, not fp32 weights that are their own master, and moments); on host the slab
    that holds the offloaded masters, moments and gradient copies (what the process holds)."""
    device = 0
    for shard, exp_avg, exp_avg_sq in zip(adam.shards, adam.exp_avg, adam.exp_avg_sq):
        if not shard.offloaded:
            tensors = [exp_avg, exp_avg_sq] + ([] if shard.aliased else [shard.main])
            device += sum(t.numel() * t.element_size() for t in tensors)
    return device, adam.host_memory.nbytes if adam.host_memory is not None else 0
