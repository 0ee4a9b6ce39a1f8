"""What the step-time model knows of a GPU cluster: one `Hardware` per device preset.

Every figure is the vendor's spec sheet (sources in docs/planner.md); bandwidths are per
GPU and per direction:

* `peak_tflops`: dense fp16/bf16 tensor-core peak (no sparsity);
* `fp8_tflops`: dense FP8 tensor-core peak (no sparsity), None where the device has no FP8 tensor cores
  (A100: compute capability 8.0; the trainer refuses FP8 below 8.9);
* `hbm_gbps`: device-memory bandwidth;
* `intra_node_gbps`: NVLink bandwidth of one GPU (half the bidirectional figure);
* `inter_node_gbps`: the network bandwidth of one GPU: DGX A100 / DGX H100 nodes have one
  InfiniBand adapter per GPU (HDR 200 Gb/s = 25 GB/s; NDR 400 Gb/s = 50 GB/s);
* `host_link_gbps`: the host link (PCIe) of one GPU: Gen4 x16 for A100 (64 GB/s both ways),
  Gen5 x16 for H100 / H200 (128 GB/s both ways); what host-resident chunks move over;
* `memory_gib`: the device memory CUDA reports as total (what the start-up check compares with);
  where no such report is at hand (B200, GB200) the marketed size read as GiB less the 1.1% that
  CUDA reports below it on H100 and A100 80 GB (79.11 and 79.15 of 80), marked so in docs/planner.md.

A "node" is the NVLink domain: 8 GPUs of a DGX/HGX board, 2 for H100 NVL (bridged pairs), 72 for
GB200 NVL72.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float = 989.0
    fp8_tflops: float | None = 1979.0
    hbm_gbps: float = 3350.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    memory_gib: float = 79.11
    host_link_gbps: float = 64.0

    def __post_init__(self):
        flags = {
            "peak_tflops": "--peak-tflops",
            "hbm_gbps": "--hbm-gbps",
            "intra_node_gbps": "--intra-node-gbps",
            "inter_node_gbps": "--inter-node-gbps",
            "gpus_per_node": "--gpus-per-node",
            "memory_gib": "--device-memory-gb",
            "host_link_gbps": "--host-link-gbps",
        }
        for name, flag in flags.items():
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        if self.fp8_tflops is not None and self.fp8_tflops <= 0:
            raise ValueError(f"--fp8-peak-tflops must be > 0, got {self.fp8_tflops}")


DEVICES = {
    "a100-40gb": Hardware(
        peak_tflops=312.0,
        fp8_tflops=None,
        hbm_gbps=1555.0,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
        gpus_per_node=8,
        memory_gib=39.39,
        host_link_gbps=32.0,
    ),
    "a100-80gb": Hardware(
        peak_tflops=312.0,
        fp8_tflops=None,
        hbm_gbps=2039.0,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
        gpus_per_node=8,
        memory_gib=79.15,
        host_link_gbps=32.0,
    ),
    "h100-80gb": Hardware(
        peak_tflops=989.0,
        fp8_tflops=1979.0,
        hbm_gbps=3350.0,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
        gpus_per_node=8,
        memory_gib=79.11,
        host_link_gbps=64.0,
    ),
    "h200": Hardware(
        peak_tflops=989.0,
        fp8_tflops=1979.0,
        hbm_gbps=4800.0,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
        gpus_per_node=8,
        memory_gib=139.7,
        host_link_gbps=64.0,
    ),
}
DEVICES["h100-nvl"] = Hardware(
    peak_tflops=835.5,
    fp8_tflops=1670.5,
    hbm_gbps=3900.0,
    intra_node_gbps=300.0,
    inter_node_gbps=50.0,
    gpus_per_node=2,
    memory_gib=93.6,
    host_link_gbps=64.0,
)
DEVICES["h800"] = dataclasses.replace(DEVICES["h100-80gb"], intra_node_gbps=200.0)
DEVICES["b200"] = Hardware(
    peak_tflops=2250.0,
    fp8_tflops=4500.0,
    hbm_gbps=8000.0,
    intra_node_gbps=900.0,
    inter_node_gbps=50.0,
    gpus_per_node=8,
    memory_gib=178.0,
    host_link_gbps=64.0,
)
DEVICES["gb200"] = Hardware(
    peak_tflops=2500.0,
    fp8_tflops=5000.0,
    hbm_gbps=8000.0,
    intra_node_gbps=900.0,
    inter_node_gbps=50.0,
    gpus_per_node=72,
    memory_gib=184.0,
    host_link_gbps=225.0,
)
DEFAULT_DEVICE = "h100-80gb"
