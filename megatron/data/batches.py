"""Which samples each data-parallel rank reads, as Megatron's pretraining sampler does.

Iteration i (1-based) consumes samples [(i-1) G, i G) of the global batch size G.
Its microbatch k covers the next micro x dp samples, of which dp rank d takes the
d-th slice of `micro` consecutive samples.
"""
from __future__ import annotations

import torch


def microbatch_indices(iteration: int, microbatch: int, *, micro_batch_size: int, global_batch_size: int,
                       dp_size: int, dp_rank: int) -> range:
    start = (iteration - 1) * global_batch_size + microbatch * micro_batch_size * dp_size
    start += dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


def collate(samples: list[dict], device) -> tuple:
    """(tokens [b, s], labels [b, s], loss_mask [b, s]) on `device`. On CUDA the batch goes
    through pinned host memory with a non-blocking copy, so it never stalls the host."""
    device = torch.device(device)
    stacked = (torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask"))
    if device.type != "cuda":
        return tuple(t.to(device) for t in stacked)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in stacked)
