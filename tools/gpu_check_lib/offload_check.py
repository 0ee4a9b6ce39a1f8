"""Part offload, 1-3: correctness, bytes and overlap of the offload optimizer and host-resident chunks.

Six runs of one small bf16 Llama, 5 iterations each (the first a warm-up for the timings): the
distributed optimizer on the device and with its state on host (all, half), optim_grads_params on
the device and with every shard on host (static 1/1/1, and --offload-policy auto under a
--device-memory-gb halfway between its full-offload estimate and the device-only one). Each
offloaded run's losses against its device run's; bytes against the estimator's columns; the
runtime's own counters (OffloadStats, FetchStats) for waits, the CPU step and bytes moved, and
CUDA events around every copy of `Transfers` and of parameter fetches for the copy bandwidth,
beside a plain pinned `copy_` of the same bytes.
"""

from __future__ import annotations

import contextlib
import time

import torch

from megatron.core.distributed.host_chunks import HostChunks
from megatron.core.distributed.host_memory import Transfers
from megatron.core.distributed.placement import AUTO_MARGIN
from megatron.core.optimizer.offload import placement_bytes
from tools.gpu_check_lib.env import estimate_run
from tools.gpu_check_lib.report import GIB, NA
from tools.gpu_check_lib.runs import run_config, train

MIB = float(1 << 20)
EXACT_TOL = 1e-5  # relative loss tolerance of tests/parallel/test_host_chunks.py and test_offload_optimizer.py
# bf16 weights, host step against the device's: the device's own noise floor (H200, 2026-11-28, docs/gpu-check.md):
# torch's fused and single-tensor AdamW on one device disagree in 46% of fp32 masters after two steps, the offloaded
# step in 6.1%; bf16 weights turn such last-bit differences into whole bf16 steps (measured: 2.0e-5-2.2e-5)
DEVICE_HOST_BF16_TOL = 5e-5


def loss_tolerance(flags: list[str]) -> float:
    """The relative loss tolerance of an offloaded run against its device run."""
    return DEVICE_HOST_BF16_TOL if "--bf16" in flags else EXACT_TOL


REAL = dict(layers=8, hidden=1024, ffn=2816, heads=8, seq=2048, vocab=32000, bucket=20_000_000)
DRY = dict(layers=2, hidden=64, ffn=176, heads=4, seq=32, vocab=256, bucket=20_000)
DISTOPT = ["--use-distributed-optimizer"]
OGP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
OFFLOAD = ["--optimizer-cpu-offload"]
BF16 = ["--bf16"]
CONFIGS = (  # name, flags, the device run it is compared with
    ("distributed optimizer, device", BF16 + DISTOPT, None),
    ("optimizer offload 1", BF16 + DISTOPT + OFFLOAD, "distributed optimizer, device"),
    ("optimizer offload 0.5", BF16 + DISTOPT + OFFLOAD + ["--optimizer-offload-fraction", "0.5"],
     "distributed optimizer, device"),
    ("optim_grads_params, device", BF16 + OGP, None),
    ("host resident 1/1/1", BF16 + OGP + OFFLOAD + ["--grad-offload-fraction", "1", "--param-offload-fraction", "1"],
     "optim_grads_params, device"),
    ("offload-policy auto", BF16 + OGP + OFFLOAD + ["--offload-policy", "auto"], "optim_grads_params, device"),
    # the same pair in fp32: on CUDA the device's Adam and the CPU's round differently in the last fp32 bit, which
    # bf16 weights turn into whole bf16 steps; in fp32 the pair shows that difference as it is
    ("distributed optimizer, device, fp32", DISTOPT, None),
    ("optimizer offload 1, fp32", DISTOPT + OFFLOAD, "distributed optimizer, device, fp32"),
)  # fmt: skip


def small_flags(dry_run: bool, iters: int = 5) -> list[str]:
    m = DRY if dry_run else REAL
    argv = ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]), "--ffn-hidden-size", str(m["ffn"])]
    argv += ["--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]), "--vocab-size", str(m["vocab"])]
    argv += ["--max-position-embeddings", str(m["seq"]), "--ddp-bucket-size", str(m["bucket"])]
    argv += ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(iters)]
    return argv + ["--mock-data", "--lr", "1e-4", "--lr-decay-style", "constant"]


class CopyTimer:
    """CUDA events around each Transfers.copy (side stream) and HostChunks.fetch (the gather's
    stream), and the training thread's time in HostChunks.add_into / settle (gradient additions)."""

    def __init__(self, cuda: bool):
        self.cuda, self.spans, self.add_seconds, self.on = cuda, [], 0.0, False

    @contextlib.contextmanager
    def patched(self):
        copy, fetch, add_into, settle = Transfers.copy, HostChunks.fetch, HostChunks.add_into, HostChunks.settle
        timer = self

        def timed_events(stream, fn):
            if not (timer.cuda and timer.on):
                return fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            result = fn()
            end.record(stream)
            timer.spans.append((start, end))
            return result

        def host_seconds(fn):
            begin = time.perf_counter()
            fn()
            timer.add_seconds += (time.perf_counter() - begin) if timer.on else 0.0

        Transfers.copy = lambda self, dst, src: timed_events(self.stream, lambda: copy(self, dst, src))
        HostChunks.fetch = lambda self, slot, shard: timed_events(
            torch.cuda.current_stream() if timer.cuda else None, lambda: fetch(self, slot, shard)
        )
        HostChunks.add_into = lambda self, shard, grad: host_seconds(lambda: add_into(self, shard, grad))
        HostChunks.settle = lambda self: host_seconds(lambda: settle(self))
        try:
            yield self
        finally:
            Transfers.copy, HostChunks.fetch, HostChunks.add_into, HostChunks.settle = copy, fetch, add_into, settle

    def copy_seconds(self) -> float:
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1e3


def plain_copy_gbps(nbytes: int) -> tuple[float, float]:
    """(device -> pinned host, pinned host -> device) GB/s of one plain copy_ of `nbytes`, median of 3."""
    device = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
    host = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, device), (device, host)):
        seconds = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        rates.append(device.numel() / sorted(seconds)[1] / 1e9)
    return rates[0], rates[1]


def _pinned_bytes() -> tuple:
    """(torch's pinned allocator bytes, the kernel's VmPin + VmLck of this process)."""
    allocator = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    with open("/proc/self/status") as status:
        kib = sum(int(line.split()[1]) for line in status if line.startswith(("VmPin:", "VmLck:")))
    return allocator, kib * 1024


def inspect_offload(ctx, timer: CopyTimer, iters: int):
    def inspect(trainer, measured):
        optimizer = trainer.optimizer
        extra = measured.extra
        extra["slab"] = placement_bytes(optimizer.adam)[1]
        extra["pinned"] = _pinned_bytes() if ctx.cuda else (NA, NA)
        if optimizer.host is None:
            return
        stats, fetches = optimizer.adam.offload.take_stats(), optimizer.host.take_stats()
        counts = optimizer.host.placement.counts()
        extra["chunks"] = f"{counts['optimizer']}/{counts['grads']}/{counts['params']} of {len(optimizer.shards)}"
        extra["d2h"] = (stats.d2h_bytes + fetches.d2h_bytes) / iters
        extra["h2d"] = (stats.h2d_bytes + fetches.h2d_bytes) / iters
        extra["fetch wait"] = fetches.wait_seconds / iters
        extra["cpu"], extra["exposed"] = stats.cpu_seconds / iters, stats.exposed_seconds / iters
        extra["hidden"] = stats.hidden_fraction
        extra["grad add"] = timer.add_seconds / iters
        extra["copy"] = timer.copy_seconds() / iters if ctx.cuda else NA
        if trainer.placement_decision is not None:
            extra["decision"] = trainer.placement_decision.describe()

    return inspect


def _resetter(timer: CopyTimer):
    def reset(trainer):
        if trainer.optimizer.host is not None:
            trainer.optimizer.adam.offload.take_stats()
            trainer.optimizer.host.take_stats()
        timer.spans, timer.add_seconds, timer.on = [], 0.0, True

    return reset


def auto_budget_gb(ctx, argv_auto: list[str], argv_device: list[str]) -> float:
    """A device budget halfway between the auto run's full-offload estimate and the device-only one."""
    low = estimate_run(run_config(argv_auto), ctx.device, None).total
    high = estimate_run(run_config(argv_device), ctx.device, None).total
    return (low + (high - low) / 2) / (1 - AUTO_MARGIN) / GIB


def run_configs(ctx, warmup: int = 1, iters: int = 4) -> dict:
    """name -> (argv, estimate, Measured) of every configuration that ran."""
    results = {}
    for name, flags, _ in CONFIGS:
        if ctx.skip(40):
            results[name] = None
            continue
        argv = small_flags(ctx.dry_run, warmup + iters) + flags
        if "auto" in flags:
            budget = auto_budget_gb(ctx, argv, small_flags(ctx.dry_run) + BF16 + OGP)
            argv += ["--device-memory-gb", f"{budget:.6f}"]
        device_bytes = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.cuda else None
        estimate = estimate_run(run_config(argv), ctx.device, device_bytes)
        timer = CopyTimer(ctx.cuda)
        with timer.patched():
            measured = train(
                ctx, argv, iters, warmup, inspect=inspect_offload(ctx, timer, iters), hooks=_resetter(timer)
            )
        results[name] = (argv, estimate, measured)
    return results
