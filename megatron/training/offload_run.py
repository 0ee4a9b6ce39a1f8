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
    chunk_placement,
    forward_order,
    part_bytes,
    shard_numels,
)
from megatron.core.optimizer.offload import placement_bytes
from megatron.planning.budget import device_memory_bytes, host_memory_bytes
from megatron.planning.estimator import estimate_memory
from megatron.training.memory_check import layout_from_run

MIB = float(1 << 20)


def place_chunks(run, pp_rank: int, layouts: list, device: torch.device) -> tuple[Placement, AutoDecision | None]:
    """The placement of this rank's chunks (`layouts`: the BufferLayouts of its buffers, not made
    yet) and, with the auto policy, the decision that chose it."""
    offload = run.optimizer.offload
    if offload.policy == "static":
        return chunk_placement(layouts, offload.fraction, offload.grad_fraction, offload.param_fraction), None
    fixed = estimate_memory(run.model, layout_from_run(run, device.type)).ranks[pp_rank].total_bytes
    weight_bytes, ddp = run.model.params_dtype.itemsize, run.parallel.ddp
    costs = part_bytes(weight_bytes, ddp.shards_grads, ddp.shards_params, ddp.grad_dtype.itemsize)
    decision = auto_placement(
        forward_order(layouts),
        shard_numels(layouts),
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
