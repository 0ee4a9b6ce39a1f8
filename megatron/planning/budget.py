"""The device and host memory a run's ranks may use: the budgets the start-up check and the auto
placement compare the estimate with."""

from __future__ import annotations

import os

import torch

from megatron.planning.hardware import DEVICES

GIB = float(1 << 30)


def device_memory_bytes(device: torch.device, device_memory_gb: float | None, preset: str | None = None) -> int | None:
    """`--device-memory-gb` (GiB, 2**30 bytes), else the `--device` preset's, else the CUDA device's total
    memory, else None (no limit known)."""
    if device_memory_gb is not None:
        return int(device_memory_gb * GIB)
    if preset is not None:
        return int(DEVICES[preset].memory_gib * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def host_memory_bytes(device: torch.device, host_memory_gb: float | None) -> int | None:
    """`--host-memory-gb` (GiB per rank), else on CUDA the machine's available memory (MemAvailable)
    shared by the ranks on the node (LOCAL_WORLD_SIZE, 1 without a launcher); None on CPU, where
    the offloaded state shares the memory the device budget already counts."""
    if host_memory_gb is not None:
        return int(host_memory_gb * GIB)
    if device.type != "cuda":
        return None
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
