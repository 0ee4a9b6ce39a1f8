"""Which samples each data-parallel rank reads, as Megatron's pretraining sampler does.

An iteration consumes the G samples after those its predecessors consumed ((i-1) G for
iteration i with a constant global batch size G; the batch-size schedule says otherwise).
Its microbatch k covers the next micro x dp samples, of which dp rank d takes the
d-th slice of `micro` consecutive samples.
"""

from __future__ import annotations

import torch

from megatron.core.pipeline_parallel.microbatch import Microbatch


def microbatch_indices(
    consumed_samples: int, microbatch: int, *, micro_batch_size: int, dp_size: int, dp_rank: int
) -> range:
    """Sample indices of one microbatch on one dp rank; `consumed_samples`: before this iteration."""
    start = consumed_samples + (microbatch * dp_size + dp_rank) * micro_batch_size
    return range(start, start + micro_batch_size)


def model_input_fields(data_config) -> tuple[str, ...]:
    """The per-sample model inputs the data flags ask for (None: mock data, which has none):
    position ids with --reset-position-ids, document ids with --reset-attention-mask."""
    if data_config is None:
        return ()
    wanted = (("position_ids", data_config.reset_position_ids), ("document_ids", data_config.reset_attention_mask))
    return tuple(name for name, on in wanted if on)


def collate(samples: list[dict], device, model_inputs: tuple[str, ...] = ()) -> Microbatch:
    """The Microbatch of `samples` on `device`, with the fields `model_inputs` besides tokens,
    labels and loss mask. On CUDA the batch goes through pinned host memory with a
    non-blocking copy, so it never stalls the host."""
    device = torch.device(device)
    stacked = {
        key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask") + tuple(model_inputs)
    }
    if device.type != "cuda":
        return Microbatch(**{key: t.to(device) for key, t in stacked.items()})
    return Microbatch(**{key: t.pin_memory().to(device, non_blocking=True) for key, t in stacked.items()})
