"""The offload optimizer in the training loop: the auto policy's measurement and the log line.

`--offload-policy auto` starts with every chunk's optimizer state on host. During the first
iteration it measures the peak device memory that is not model state — on CUDA the
allocator's peak above what was allocated before the iteration (weights, gradient buffers,
device optimizer state); on CPU, which keeps no allocator statistics, the memory estimator's
activations + transients of this rank, whose saved-activation part equals the measured bytes
exactly (tests/parallel/test_memory_measured.py). The largest figure over all ranks decides,
so that every rank of a data-parallel group keeps the same chunks (their deferred parameter
gathers must be issued in the same order), then `offload_policy.auto_keep` chooses.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.memory.estimator import estimate_memory
from megatron.core.optimizer.offload_policy import auto_keep, forward_order, placement_bytes, state_bytes_per_element
from megatron.training.memory_check import device_memory_bytes, layout_from_run

MIB = float(1 << 20)


class AutoOffload:
    """Call `before_first_iteration()` and `after_first_iteration()` around iteration 1."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.decision = None
        self._baseline = 0

    def before_first_iteration(self) -> None:
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._baseline = torch.cuda.memory_allocated()

    def _peak_other_bytes(self) -> int:
        trainer = self.trainer
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._baseline
        estimate = estimate_memory(trainer.run.model, layout_from_run(trainer.run, "cpu"))
        rank = estimate.ranks[trainer.mesh.pp_rank]
        return rank.activations_bytes + rank.transients_bytes

    def after_first_iteration(self) -> None:
        trainer, optimizer = self.trainer, self.trainer.optimizer
        optimizer.wait_for_step()
        peak = torch.tensor([float(self._peak_other_bytes())], device=trainer.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        buffers = [chunk.buffer for chunk in trainer.chunks]
        model_bytes = sum(sum(b.resident_bytes()) for b in buffers)
        numels = [shard.main.numel() for shard in optimizer.shards]
        budget = device_memory_bytes(trainer.device, trainer.run.training.device_memory_gb)
        self.decision = auto_keep(forward_order(buffers), numels, state_bytes_per_element(trainer.run.model.params_dtype),
                                  budget, model_bytes, int(peak.item()))
        optimizer.adam.offload.keep_on_device(self.decision.keep)


def offload_line(optimizer) -> str:
    """This rank's offload accounting since the previous line (resets the counters)."""
    offload = optimizer.adam.offload
    device, host = placement_bytes(optimizer.adam)
    stats = offload.take_stats()
    steps = max(stats.steps, 1)
    return (f"  offload: optimizer state on device {device / MIB:.2f} MiB | on host {host / MIB:.2f} MiB "
            f"({len(offload.order)} of {len(optimizer.shards)} chunks) | device->host {stats.d2h_bytes / steps / MIB:.2f} "
            f"MiB/iter | host->device {stats.h2d_bytes / steps / MIB:.2f} MiB/iter | CPU step "
            f"{1000 * stats.cpu_seconds / steps:.1f} ms/iter on {offload.threads} threads | hidden behind the next "
            f"forward {100 * stats.hidden_fraction:.0f}%")


def check_offload_budget(run, device: torch.device) -> None:
    """Refuse (ValueError, one line) a device budget that cannot hold a rank even with the whole
    optimizer state on host: weights, gradient buffers and saved activations stay on the device."""
    budget = device_memory_bytes(device, run.training.device_memory_gb)
    if not run.optimizer.offload.enabled or budget is None:
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
            f"--micro-batch-size")
