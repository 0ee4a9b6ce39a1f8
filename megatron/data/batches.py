"""Which samples each data-parallel rank reads, as Megatron's pretraining sampler does.

An iteration consumes the G samples after those its predecessors consumed ((i-1) G for
iteration i with a constant global batch size G; the batch-size schedule says otherwise).
Its microbatch k covers the next micro x dp samples, of which dp rank d takes the
d-th slice of `micro` consecutive samples.
"""
from __future__ import annotations

import torch


def microbatch_indices(consumed_samples: int, microbatch: int, *, micro_batch_size: int, dp_size: int,
                       dp_rank: int) -> range:
    """Sample indices of one microbatch on one dp rank; `consumed_samples`: before this iteration."""
    start = consumed_samples + (microbatch * dp_size + dp_rank) * micro_batch_size
    return range(start, start + micro_batch_size)


def collate(samples: list[dict], device) -> tuple:
    """(tokens [b, s], labels [b, s], loss_mask [b, s]) on `device`. On CUDA the batch goes
    through pinned host memory with a non-blocking copy, so it never stalls the host."""
    device = torch.device(device)
    stacked = (torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask"))
    if device.type != "cuda":
        return tuple(t.to(device) for t in stacked)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in stacked)
