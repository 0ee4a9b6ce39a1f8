"""Which attention path `--attention-backend auto` takes on a CUDA device: the fastest correct one measured.

The rule (`fastest`). For a shape (head dim, dtype, sequence length) on a device (its CUDA compute capability),
auto takes, among the paths the GPU check measured correct on a device of that capability at that head dim and
dtype (output and every input gradient within `TOLERANCE` of the fp32 reference, relative to its largest
value), the one with the least forward + backward time at the measured sequence length nearest to the run's
(by ratio). Where nothing is measured for the capability, head dim and dtype, or where our kernel is the
fastest, kernels/dispatch.py keeps its default: our flash kernel where it takes the shape, torch's SDPA with
torch's own backend choice elsewhere. A path is "ours" (kernels/flash_attention.py) or an SDPA
backend pinned with `torch.nn.attention.sdpa_kernel` (`SDPA_BACKENDS`).

The measurements (`MEASURED`) are rows of the GPU check's attention section
(tools/gpu_check_lib/attention_backends.py `measurements`), each with the device, date and report it came
from: one H200 (compute capability 9.0) so far, 2026-11-28 (docs/gpu-results/2026-11-28-h200.json), where
cuDNN's backend took 0.56x our kernel's forward + backward time at seq 8192 and 0.53x at 2048 (flash: 0.97x,
0.90x; memory-efficient refuses grouped K/V and is not taken), so on capability 9.0 `auto` pins cuDNN for
head dim 128 in bf16. Other capabilities, head dims and dtypes keep the default until measured.
The measured shapes have grouped K/V heads (4 query heads per group, as Llama-3-8B); they stand for
ungrouped attention of the same head dim too.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
TOLERANCE = 2e-2  # bf16: the kernel tests' tolerance relative to the reference's largest value
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Measurement:
    """One path at one shape on one device, as the GPU check's attention section measured it."""

    capability: tuple[int, int]  # torch.cuda.get_device_capability
    head_dim: int
    dtype: str  # "bf16" or "fp16"
    seq_length: int
    path: str  # "ours" or a key of SDPA_BACKENDS
    ms: float  # forward + backward
    correct: bool  # output and gradients within TOLERANCE
    source: str  # device, date, report


H200 = "NVIDIA H200, 2026-11-28, GPU check section attention_backends (docs/gpu-results/2026-11-28-h200.json)"
MEASURED: tuple[Measurement, ...] = (
    Measurement((9, 0), 128, "bf16", 8192, "ours", 6.6525, True, H200),
    Measurement((9, 0), 128, "bf16", 8192, "flash", 6.4677, True, H200),
    Measurement((9, 0), 128, "bf16", 8192, "cudnn", 3.7449, True, H200),
    Measurement((9, 0), 128, "bf16", 2048, "ours", 0.6769, True, H200),
    Measurement((9, 0), 128, "bf16", 2048, "flash", 0.6077, True, H200),
    Measurement((9, 0), 128, "bf16", 2048, "cudnn", 0.3588, True, H200),
)


def fastest(measurements, capability, head_dim: int, dtype: str, seq_length: int) -> str | None:
    """The rule: the path auto takes for this shape on a device of `capability`, or None where nothing correct
    was measured for the capability, head dim and dtype."""
    candidates = [
        m
        for m in measurements
        if tuple(m.capability) == tuple(capability) and m.head_dim == head_dim and m.dtype == dtype and m.correct
    ]
    if not candidates:
        return None
    nearest = min({m.seq_length for m in candidates}, key=lambda s: (abs(math.log(s / seq_length)), s))
    return min((m for m in candidates if m.seq_length == nearest), key=lambda m: m.ms).path


def measured_sdpa_backend(device_type: str, head_dim: int, dtype, seq_length, measurements=None) -> str | None:
    """The SDPA backend `auto` pins for this shape on this process's CUDA device (a key of SDPA_BACKENDS), or
    None: nothing measured, our kernel the fastest, or no CUDA device here (an estimate for a device elsewhere
    keeps the default path)."""
    measurements = MEASURED if measurements is None else measurements
    if device_type != "cuda" or seq_length is None or not measurements or not torch.cuda.is_available():
        return None
    path = fastest(measurements, torch.cuda.get_device_capability(), head_dim, DTYPE_NAMES.get(dtype), seq_length)
    return path if path in SDPA_BACKENDS else None


def pinned_backend(name: str | None):
    """The context that pins SDPA to backend `name` (None: torch's own choice)."""
    return contextlib.nullcontext() if name is None else sdpa_kernel(SDPA_BACKENDS[name])
