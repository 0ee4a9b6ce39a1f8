"""What the GPU check borrows from modules that are being moved: each import is made here, once.

- `HARDWARE_MODULE`: the device presets (megatron/core/memory/hardware.py today, megatron/planning/
  after the move): `device_preset` reads them;
- `estimate_run`: the memory estimate through the function the start-up check uses
  (megatron/training/memory_check.py over megatron/core/memory/*), and that check's decision;
- `size_rule`: tools/bench/max_model_size.py's rule for what fits (member flags, device bytes).
Fix a moved module's path in this file only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

HARDWARE_MODULE = "megatron.core.memory.hardware"


def device_preset(name: str, total_bytes: int) -> tuple[str | None, object | None, str]:
    """(preset key, Hardware, note) of the project's preset matching the CUDA device name
    (torch.cuda.get_device_name) and its memory; (None, None, why) when none matches."""
    devices = importlib.import_module(HARDWARE_MODULE).DEVICES
    lower = name.lower()
    if "h200" in lower:
        key = "h200"
    elif "h100" in lower:
        key = "h100-80gb"
    elif "a100" in lower:
        key = "a100-80gb" if total_bytes > 48 * (1 << 30) else "a100-40gb"
    else:
        return None, None, f"no preset in {HARDWARE_MODULE} matches {name!r}: MFU not computed"
    note = f"preset {key} of {HARDWARE_MODULE}: dense bf16 peak {devices[key].peak_tflops:g} TFLOP/s"
    if "pcie" in lower or "nvl" in lower:
        note += " (an SXM figure; this device is a PCIe/NVL part with a lower peak: MFU reads low)"
    return key, devices[key], note


@dataclass
class Estimate:
    certain: int
    total: int
    host: int
    gathered: int
    rank: object  # the RankEstimate itself (for max_model_size's rule)
    decision: str  # the start-up check's: 'fits', 'warns' or 'refuses' ('not checked' without a device size)
    line: str


def estimate_run(run, device: torch.device, device_bytes: int | None) -> Estimate:
    """The estimate of pipeline rank 0 of `run` on `device` as pretrain_*.py's start-up check makes it,
    and that check's decision against `device_bytes` (its device part only: the host part is
    compared by the callers with what they measure)."""
    from megatron.core.memory.estimator import estimate_memory
    from megatron.training.memory_check import check_estimate, layout_from_run

    estimate = estimate_memory(run.model, layout_from_run(run, device.type))
    rank = estimate.worst_rank
    try:
        line = check_estimate(estimate, device_bytes, skip=False)
        decision = "not checked" if device_bytes is None else "warns" if "WARNING" in line else "fits"
    except ValueError as error:
        line, decision = str(error), "refuses"
    return Estimate(rank.certain_bytes, rank.total_bytes, rank.host_bytes, rank.gathered_bytes, rank, decision, line)


def host_budget(device: torch.device) -> int | None:
    """The start-up check's host budget of one rank: MemAvailable on CUDA, None (not limited) elsewhere."""
    from megatron.training.memory_check import host_memory_bytes

    return host_memory_bytes(device, None)


def size_rule():
    """tools/bench/max_model_size.py: member_argv, device_bytes (its fit rule), WIDTHS, COLUMNS."""
    from tools.bench import max_model_size as rule

    return rule
