#!/usr/bin/env python
"""GPU self-check: one prepared run of every GPU part, one process (size members in their own), one GPU.

    python tools/gpu_check.py --part {all,offload,kernels-step,...} [--out DIR] [--dry-run]
                              [--only SECTIONS] [--skip SECTIONS]

Prints its tables and writes DIR/report.json and DIR/report.md (default runs/gpu_check), rewritten
after every section. User guide: docs/gpu-check.md; the device call that runs it (carried wheels
included): tools/gpu_check_device.sh. Parts are a registry (tools/gpu_check_lib/parts.py: name ->
sections, budget, order); `--part all` runs them newest measurements first:

throughput (issue 43; throughput_check.py)
  throughput: our attention kernel vs each SDPA backend; ours (default and best flags), bare PyTorch
     eager/compiled and torchtitan 0.2.2 eager/compiled at the Llama-3-8B layer shape, 8 and 16
     layers, each in a fresh process; four memory configurations on both sides of the device's limit.
offload (issue 35; adam_bits and fresh-process sizes: issue 42)
  adam_bits: the same fp32 masters stepped by ShardedAdamW on the device and by the offload CPU
     step in each rounding, bitwise; the device's noise floor (fused / multi-tensor AdamW, a
     reduction in two orders); the 0.17B model offloaded vs on the device, masters after one step.
  size: the largest Llama that fits this GPU and host with full host residency, and without
     offload, by tools/bench/max_model_size.py's rule; 3 iterations each, each in a fresh process.
  offload: eight 5-iteration runs of a 0.17B Llama (optimizer offload 1 and 0.5, host-resident
     chunks 1/1/1 and auto, their device-only runs, an fp32 pair): losses, bytes vs the estimate,
     waits, CPU step, copy bandwidth vs a plain pinned copy_.
kernels-step (issue 34)
  kernels: flash attention, RMSNorm/LayerNorm and the LM head + cross-entropy (fused vs unfused, vocab
     128256) forward and backward in bf16 at real sizes: error vs fp32, TFLOP/s or GB/s, ratio to torch.
  step: a 1.1B Llama through our Trainer, 3 warm-up + 20 timed iterations: tokens/s, TFLOP/s, MFU,
     host syncs per iteration; the same model as a bare PyTorch loop for the ratio.
  memory: five configurations of that model: the estimate beside the allocator's peaks.

Time: each part has its budget (360 s each here); `--part all` runs under one deadline (a 600 s
device call less 60 s to start) and gives each part its budget or what is left, the smaller; a
section that would start with less time left than it needs is skipped and says so. The report's
header says how the budgets sum. Measured 2026-11-26: kernels-step 74-85 s on an H100, offload
176 s on an H200.

--dry-run runs the same code on CPU at tiny sizes (kernels under TRITON_INTERPRET=1) and fills
every cell that needs no CUDA; speed and allocator cells read "n/a (dry run)".
Bad input (an unknown --part or section, a section not in the chosen part, an --out that cannot be
written, no CUDA without --dry-run): one `error:` line, exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.gpu_check_lib.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
