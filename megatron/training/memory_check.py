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
    """The layout `run` trains with; `distributed_optimizer` overrides its --use-distributed-optimizer
    (None: keep it), to compare the two optimizers on one run (the replicated one without offload).
    --offload-policy auto is estimated as full offload (every part the strategy can move on host):
    the best case, so the start-up check refuses only a run that cannot fit even then."""
    par, training, offload = run.parallel, run.training, run.optimizer.offload
    ddp = par.ddp
    sharded = ddp.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    strategy = "no_shard" if not sharded else ddp.sharding_strategy if ddp.sharding_strategy != "no_shard" else "optim"
    offloaded = offload.enabled and sharded
    auto = offloaded and offload.policy == "auto"
    fractions = (
        (1.0, float(strategy in ("optim_grads", "optim_grads_params")), float(strategy == "optim_grads_params"))
        if auto
        else (offload.fraction, offload.grad_fraction, offload.param_fraction)
        if offloaded
        else (0.0, 0.0, 0.0)
    )
    return MemoryLayout(
        tp=par.tp,
        cp=par.cp,
        pp=par.pp,
        dp=par.dp,
        virtual_stages=par.virtual_stages,
        microbatch_group_size=par.microbatch_group_size,
        micro_batch_size=training.micro_batch_size,
        num_microbatches=training.num_microbatches,
        distributed_optimizer=sharded,
        bucket_size=ddp.bucket_size,
        first_stage_layers=par.first_stage_layers,
        last_stage_layers=par.last_stage_layers,
        offload_fraction=fractions[0],
        grad_offload_fraction=fractions[1],
        param_offload_fraction=fractions[2],
        offload_auto=auto,
        grad_dtype_bytes=ddp.grad_dtype.itemsize,
        device_type=device_type,
        split_backward=par.split_backward,
        sharding_strategy=strategy,
        reshard_after_forward=ddp.reshard_after_forward,
        unsharded_grad_accumulation=ddp.unsharded_grad_accumulation and strategy != "optim",
    )


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
