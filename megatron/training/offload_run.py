"""Host-resident chunks in the training loop: where this rank's chunks live, and the log line.

Static policy: the three fractions (`placement.static_placement`). Auto: placed from the traced
memory estimate of this rank with every movable part on host (the start-up check's estimate):
its total is what stays on the device whatever the placement (saved activations, transients,
buffers the strategy does not shard, gathered buckets), and `placement.auto_placement` fills the
rest of the device budget (--device-memory-gb or the device's capacity, less a 10% margin) with
chunks' parameters, then gradients, then optimizer state, once the host part fits the host budget
(--host-memory-gb, default on CUDA the available memory / ranks on the node). The decision is made before anything
is allocated, so nothing moves after iteration 1, and it is the same on every rank of a pipeline
stage (their deferred gathers must be issued in the same order). On CPU the estimate's certain
part equals the measured bytes (tests/parallel/test_memory_measured.py); on a GPU the estimate's
allowances and the margin stand in for what the allocator adds. The room the placement leaves
over lets each forward keep gathered buckets for its backward (`keep_gathered_buckets`).
"""

from __future__ import annotations

import sys

import torch

from megatron.core.distributed.placement import (
    AutoDecision,
    Placement,
    auto_placement,
    forward_order,
    part_bytes,
    static_placement,
)
from megatron.core.memory.estimator import estimate_memory
from megatron.core.optimizer.offload import placement_bytes
from megatron.training.memory_check import device_memory_bytes, host_memory_bytes, layout_from_run

MIB = float(1 << 20)


def chunk_placement(run, pp_rank: int, buffers: list, device: torch.device) -> tuple[Placement, AutoDecision | None]:
    """The placement of this rank's chunks (`buffers`: its ParamAndGradBuffers, not yet placed)
    and, with the auto policy, the decision that chose it."""
    offload = run.optimizer.offload
    order = forward_order(buffers)
    numels = [bucket.param_shard.numel() for buffer in buffers for bucket in buffer.buckets]
    if offload.policy == "static":
        return static_placement(order, numels, offload.fraction, offload.grad_fraction, offload.param_fraction), None
    layout = layout_from_run(run, device.type)
    fixed = estimate_memory(run.model, layout).ranks[pp_rank].total_bytes
    weight_bytes = run.model.params_dtype.itemsize
    costs = part_bytes(weight_bytes, layout.shards_grads, layout.shards_params, layout.grad_dtype_bytes)
    decision = auto_placement(
        order,
        numels,
        costs,
        device_memory_bytes(device, run.training.device_memory_gb),
        fixed,
        weight_bytes,
        host_memory_bytes(device, run.training.host_memory_gb),
    )
    if not decision.fits and not run.training.skip_memory_check:
        raise ValueError(
            f"--offload-policy auto finds no placement of pipeline rank {pp_rank}'s chunks that fits both "
            f"budgets: {decision.summary()}; raise --device-memory-gb or "
            f"--host-memory-gb, add ranks, recompute activations, or pass --skip-memory-check"
        )
    return decision.placement, decision


def keep_gathered_buckets(chunks: list, decision: AutoDecision | None, pp: int) -> None:
    """The auto placement's spare device room lets each forward keep gathered buckets for its
    backward (optim_grads_params releasing after forward; not under pipelining, where several
    forwards run before their backwards)."""
    if decision is None or pp > 1:
        return
    spare = decision.spare_bytes
    for chunk in chunks:
        if chunk.bucket_hooks is not None:
            chunk.bucket_hooks.keep_gathered(sys.maxsize if spare is None else spare // len(chunks))


def offload_line(optimizer) -> str:
    """This rank's offload accounting since the previous line (resets the counters): bytes moved
    by the optimizer step and by host-resident gradients and parameters during the iterations."""
    offload, host = optimizer.adam.offload, optimizer.host
    device, slab = placement_bytes(optimizer.adam)
    stats, fetches = offload.take_stats(), host.take_stats()
    steps = max(stats.steps, 1)
    counts, chunks = host.placement.counts(), len(optimizer.shards)
    d2h, h2d = stats.d2h_bytes + fetches.d2h_bytes, stats.h2d_bytes + fetches.h2d_bytes
    line = (
        f"  offload: optimizer state on device {device / MIB:.2f} MiB | host slab {slab / MIB:.2f} MiB (optimizer "
        f"state of {counts['optimizer']}, gradients of {counts['grads']}, parameters of {counts['params']} of "
        f"{chunks} chunks) | device->host {d2h / steps / MIB:.2f} MiB/iter | host->device {h2d / steps / MIB:.2f} "
        f"MiB/iter | CPU step {1000 * stats.cpu_seconds / steps:.1f} ms/iter on {offload.threads} threads | "
        f"hidden behind the next forward {100 * stats.hidden_fraction:.0f}%"
    )
    if fetches.fetches:
        line += (
            f" | parameter gathers from host {fetches.fetches / steps:.1f}/iter, started ahead "
            f"{100 * fetches.hit_rate:.0f}%, waited {1000 * fetches.wait_seconds / steps:.1f} ms/iter"
        )
    return line


def check_offload_budget(run, device: torch.device) -> None:
    """Refuse (ValueError, one line) a device budget that cannot hold a rank even with the whole
    optimizer state on host: weights, gradient buffers and saved activations stay on the device. MoE models are
    not estimated (the start-up memory line says so), so not checked here either."""
    budget = device_memory_bytes(device, run.training.device_memory_gb)
    if not run.optimizer.offload.enabled or budget is None or run.model.num_moe_experts is not None:
        return
    estimate = estimate_memory(run.model, layout_from_run(run, device.type))
    rank = max(estimate.ranks, key=lambda r: r.certain_bytes - r.optimizer_bytes)
    needed = rank.certain_bytes - rank.optimizer_bytes
    if needed > budget:
        raise ValueError(
            f"device memory {budget / MIB:.1f} MiB (--device-memory-gb or the device's) cannot hold pipeline rank "
            f"{rank.pp_rank} even with all optimizer state on host: weights {rank.weights_bytes / MIB:.1f} + gradients "
            f"{rank.grads_bytes / MIB:.1f} + saved activations {rank.activations_bytes / MIB:.1f} = "
            f"{needed / MIB:.1f} MiB; raise tensor/pipeline parallelism, recompute activations or lower "
            f"--micro-batch-size"
        )
