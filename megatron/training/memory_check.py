"""The start-up memory check, training's side: estimate the run, print the check's lines or raise.

The decision and its messages are megatron/planning/startup_check.py; the estimate reads the run's
own config (`layout_from_run`).
"""

from __future__ import annotations

import torch

from megatron.planning.budget import device_memory_bytes, host_memory_bytes
from megatron.planning.estimator import estimate_memory
from megatron.planning.layout import MemoryLayout
from megatron.planning.startup_check import check_fit, offload_budget_refusal


def layout_from_run(run, device_type: str, *, distributed_optimizer: bool | None = None) -> MemoryLayout:
    """What the estimate reads of `run` on `device_type`: its own parallel config and offload
    settings, its batch sizes and whether its data builds a document mask. `distributed_optimizer`
    overrides --use-distributed-optimizer (None: keep it), to compare the two optimizers on one run
    (the replicated one without offload)."""
    layout = MemoryLayout(
        run.parallel,
        run.training.micro_batch_size,
        run.training.num_microbatches,
        run.optimizer.offload,
        device_type,
        document_mask=run.data is not None and run.data.reset_attention_mask,
    )
    if distributed_optimizer is None:
        return layout
    return layout.with_ddp(use_distributed_optimizer=True) if distributed_optimizer else layout.replicated()


def check_memory(
    run, device: torch.device, device_memory_gb: float | None, skip: bool, host_memory_gb: float | None = None
) -> list[str]:
    """Estimate `run` on `device`; return log lines, raise ValueError when its certain part cannot fit
    the device or its host part the host."""
    estimate = estimate_memory(run.model, layout_from_run(run, device.type))
    device_bytes = device_memory_bytes(device, device_memory_gb)
    return check_fit(estimate, device_bytes, host_memory_bytes(device, host_memory_gb), skip)


def check_offload_budget(run, device: torch.device) -> None:
    """Refuse (ValueError, one line) a device budget that cannot hold a rank even with the whole
    optimizer state on host."""
    budget = device_memory_bytes(device, run.training.device_memory_gb)
    if not run.optimizer.offload.enabled or budget is None:
        return
    reason = offload_budget_refusal(estimate_memory(run.model, layout_from_run(run, device.type)), budget)
    if reason is not None:
        raise ValueError(reason)
