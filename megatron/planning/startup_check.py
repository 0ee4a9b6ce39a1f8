"""The start-up memory check's decision and its messages, on a run's estimate.

`check_fit` is what pretrain_*.py runs at start-up (through megatron/training/memory_check.py):
the per-rank table as log lines and fit_rule.fit_verdict's verdict: "does not fit" (the certain
part of a rank -- weights, gradients, optimizer state, saved activations: what measurement
confirms -- exceeds device memory) is a refusal (ValueError, one line) unless told to skip the
check; "fits with margin X" (only the full estimate exceeds it) a warning naming the unmeasured
parts; "fits" a line. A check that refuses a job that would run is worse than none. The tools
print the same table and verdict.
"""

from __future__ import annotations

from megatron.planning.budget import GIB
from megatron.planning.estimator import MemoryEstimate
from megatron.planning.fit_rule import fit_verdict
from megatron.planning.layout import MemoryLayout

MIB = float(1 << 20)
COLUMNS = ("weights", "grads", "optimizer", "activations", "transients", "certain", "total", "host")


def _size(nbytes: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB (tiny CPU models would print 0.00 GiB)."""
    if nbytes < GIB:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def format_table(estimate: MemoryEstimate, device_bytes: int | None) -> list[str]:
    layout = estimate.layout
    device = f"{_size(device_bytes)} device" if device_bytes else "no device limit"
    scale, unit = (GIB, "GiB") if estimate.max_total_bytes >= GIB else (float(1 << 20), "MiB")
    lines = [
        f"> memory estimate per rank in {unit} ({layout.describe()}, {estimate.kernels.describe()}, "
        f"{layout.device_type}, {device}; identical on every tp/cp/dp rank of a pipeline stage; certain = "
        f"weights + grads + optimizer + activations, total adds the unmeasured transients; host: the "
        f"host-resident chunk state (offloaded optimizer state, gradient and parameter shards), not on the "
        f"device):",
        "  pp rank      parameters " + " ".join(f"{c:>11}" for c in COLUMNS) + "  % device (certain / total)",
    ]
    for r in estimate.ranks:
        values = (
            r.weights_bytes,
            r.grads_bytes,
            r.optimizer_bytes,
            r.activations_bytes,
            r.transients_bytes,
            r.certain_bytes,
            r.total_bytes,
            r.host_bytes,
        )
        share = (
            f"{100.0 * r.certain_bytes / device_bytes:9.1f}% / {100.0 * r.total_bytes / device_bytes:.1f}%"
            if device_bytes
            else "        -"
        )
        lines.append(
            f"  {r.pp_rank:7d} {r.parameters:15,d} " + " ".join(f"{v / scale:>11.2f}" for v in values) + f"  {share}"
        )
    worst = estimate.worst_rank
    lines.append(
        f"> total parameters {estimate.total_parameters:,}; worst rank: pp rank {worst.pp_rank} "
        f"({worst.peak_microbatches} microbatch-chunks in flight, largest temporary "
        f"{worst.transients.largest_temporary})"
    )
    if estimate.moe_routing:
        lines.append(estimate.moe_routing)
    if layout.offload_auto:
        lines.append(
            "> offload policy auto: estimated with every movable part on host, the best case (the start-up "
            "check refuses only what cannot fit even so); the placement below keeps on the device what fits"
        )
    return lines


def explain(estimate: MemoryEstimate) -> list[str]:
    """Every rank's estimate by named component: the certain part, the derived transients and the
    allowances (the uncertain part) of the phase that sets its peak, which add up to its total."""
    lines = []
    for rank in estimate.ranks:
        after = rank.peaks_after_backward
        certain = {"weights": rank.weights_bytes, "grads": rank.grads_bytes, "optimizer": rank.optimizer_bytes}
        if not after:
            certain["saved activations"] = rank.activations_bytes
        uncertain = rank.uncertain()
        derived = {name: nbytes for name, nbytes in rank.allowances().items() if name not in uncertain}
        phase = "after backward (the optimizer step; no activation alive)" if after else "during backward"
        lines.append(f"> pipeline rank {rank.pp_rank}, peak {phase}:")
        for group, parts in (("certain", certain), ("derived", derived), ("allowance", uncertain)):
            lines += [f"  {group:<10} {name:<58} {_size(nbytes):>12}" for name, nbytes in parts.items()]
        lines.append(f"  {'total':<69} {_size(rank.total_bytes):>12}")
    return lines


def _components(rank) -> str:
    return (
        f"weights {_size(rank.weights_bytes)} + grads {_size(rank.grads_bytes)} + optimizer "
        f"{_size(rank.optimizer_bytes)} + saved activations {_size(rank.activations_bytes)}"
    )


def refusal(estimate: MemoryEstimate, device_bytes: int) -> str:
    """The one-line reason the start-up check refuses a layout (fit_verdict's "does not fit")."""
    rank = estimate.worst_certain_rank
    return (
        f"the certain part of the memory estimate, {_size(rank.certain_bytes)} on pipeline rank {rank.pp_rank} "
        f"({_components(rank)}), exceeds device memory {_size(device_bytes)}; raise tensor/pipeline "
        f"parallelism, recompute activations, lower --micro-batch-size or offload optimizer state "
        f"({_offload_hint(estimate.layout)}; tools/plan_parallelism.py ranks layouts that fit and proposes "
        f"the offload fraction), or pass --skip-memory-check"
    )


def _offload_hint(layout: MemoryLayout) -> str:
    if layout.offload_fractions.optimizer == 1.0:
        return "all of it is already on host"
    if layout.offload_fractions.optimizer:
        return "raise --optimizer-offload-fraction"
    return "--use-distributed-optimizer --optimizer-cpu-offload"


def allowance_warning(estimate: MemoryEstimate, device_bytes: int) -> str:
    """Why a layout that fits only with a margin (its full estimate exceeds device memory) still
    starts, and what may not fit."""
    verdict = fit_verdict(estimate, device_bytes)
    rank = estimate.ranks[verdict.pp_rank]
    allowances = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in rank.allowances().items())
    return (
        f"{verdict.label}: estimated peak {_size(rank.total_bytes)} (pipeline rank {rank.pp_rank}) exceeds "
        f"device memory {_size(device_bytes)}, but its certain part {_size(rank.certain_bytes)} "
        f"({_components(rank)}) fits; the rest are unmeasured, largest first: {allowances}; the "
        f"allocator-visible peak {_size(verdict.visible_bytes)} leaves the margin for the allowances "
        f"{_size(verdict.allowance_bytes)}; starting, it may run out of memory"
    )


def check_host(estimate: MemoryEstimate, host_bytes: int | None, skip: bool) -> str | None:
    """None when every rank's host part (its host slab: offloaded optimizer state, host-resident
    gradient and parameter shards) fits `host_bytes` (or no host
    budget applies); else the one-line refusal (ValueError) or, with --skip-memory-check, a warning."""
    rank = max(estimate.ranks, key=lambda r: r.host_bytes)
    if host_bytes is None or rank.host_bytes <= host_bytes:
        return None
    reason = (
        f"the host part of the memory estimate, {_size(rank.host_bytes)} of host-resident chunk state "
        f"on pipeline rank {rank.pp_rank}, exceeds host memory {_size(host_bytes)} per rank (--host-memory-gb, "
        f"default the available memory / ranks on the node); lower --optimizer-offload-fraction (and "
        f"--grad-offload-fraction, --param-offload-fraction), use --offload-policy auto, add ranks, "
        f"or pass --skip-memory-check"
    )
    if not skip:
        raise ValueError(reason)
    return f"> WARNING (--skip-memory-check): {reason}"


def check_estimate(estimate: MemoryEstimate, device_bytes: int | None, skip: bool) -> str:
    """The start-up check's decision as one log line; ValueError (one line) when it refuses."""
    if device_bytes is None:
        return "> memory check: no device memory to compare with (CPU without --device-memory-gb); not checked"
    verdict = fit_verdict(estimate, device_bytes)
    if verdict.refused:
        if not skip:
            raise ValueError(refusal(estimate, device_bytes))
        return f"> WARNING (--skip-memory-check): {refusal(estimate, device_bytes)}"
    if not verdict.fits:
        return f"> WARNING: {allowance_warning(estimate, device_bytes)}"
    peak, share = _size(verdict.total_bytes), verdict.total_bytes / device_bytes
    return f"> memory check: estimated peak {peak} is {share:.0%} of device memory: {verdict.describe()}"


def check_fit(estimate: MemoryEstimate, device_bytes: int | None, host_bytes: int | None, skip: bool) -> list[str]:
    """The start-up check of `estimate` as log lines: the table, the device decision and, unless the
    auto policy places the chunks, the host decision; ValueError (one line) when it refuses."""
    device_line = check_estimate(estimate, device_bytes, skip)
    # auto trades host bytes for device bytes itself and refuses when nothing fits both
    # (offload_run.place_chunks): its full-offload host figure is no reason to refuse
    host_line = None if estimate.layout.offload_auto else check_host(estimate, host_bytes, skip)
    return format_table(estimate, device_bytes) + [device_line] + ([host_line] if host_line else [])


def offload_budget_refusal(estimate: MemoryEstimate, device_bytes: int) -> str | None:
    """Why `device_bytes` cannot hold a rank even with the whole optimizer state on host (weights,
    gradient buffers and saved activations stay on the device), or None when it can."""
    rank = max(estimate.ranks, key=lambda r: r.certain_bytes - r.optimizer_bytes)
    needed = rank.certain_bytes - rank.optimizer_bytes
    if needed <= device_bytes:
        return None
    return (
        f"device memory {device_bytes / MIB:.1f} MiB (--device-memory-gb or the device's) cannot hold pipeline rank "
        f"{rank.pp_rank} even with all optimizer state on host: weights {rank.weights_bytes / MIB:.1f} + gradients "
        f"{rank.grads_bytes / MIB:.1f} + saved activations {rank.activations_bytes / MIB:.1f} = "
        f"{needed / MIB:.1f} MiB; raise tensor/pipeline parallelism, recompute activations or lower "
        f"--micro-batch-size"
    )
