"""What the GPU check takes from the planning side: device presets, the estimate, the fit rules.

- `device_preset`: the preset of megatron/planning/hardware.py matching the CUDA device;
- `estimate_run`: the memory estimate as the start-up check makes it (megatron/training/memory_check.py
  over megatron/planning/), and that check's decision;
- `size_rule`: tools/bench/max_model_size.py's rule for what fits (member flags, device bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.planning.budget import host_memory_bytes
from megatron.planning.estimator import estimate_memory
from megatron.planning.hardware import DEVICES
from megatron.planning.startup_check import check_estimate
from megatron.training.memory_check import layout_from_run

PRESETS_FILE = "megatron/planning/hardware.py"


def device_preset(name: str, total_bytes: int) -> tuple[str | None, object | None, str]:
    """(preset key, Hardware, note) of the project's preset matching the CUDA device name
    (torch.cuda.get_device_name) and its memory; (None, None, why) when none matches."""
    lower = name.lower()
    if "h200" in lower:
        key = "h200"
    elif "h100" in lower:
        key = "h100-80gb"
    elif "a100" in lower:
        key = "a100-80gb" if total_bytes > 48 * (1 << 30) else "a100-40gb"
    else:
        return None, None, f"no preset in {PRESETS_FILE} matches {name!r}: MFU not computed"
    note = f"preset {key} of {PRESETS_FILE}: dense bf16 peak {DEVICES[key].peak_tflops:g} TFLOP/s"
    if "pcie" in lower or "nvl" in lower:
        note += " (an SXM figure; this device is a PCIe/NVL part with a lower peak: MFU reads low)"
    return key, DEVICES[key], note


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
    return host_memory_bytes(device, None)


def size_rule():
    """tools/bench/max_model_size.py: member_argv, device_bytes (its fit rule), WIDTHS, COLUMNS."""
    from tools.bench import max_model_size as rule

    return rule
