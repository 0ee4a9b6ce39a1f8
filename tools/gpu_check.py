#!/usr/bin/env python
"""GPU self-check: run once on a new GPU machine, one process, one GPU.

    python tools/gpu_check.py --part {kernels-step,offload,throughput,all} [--out DIR] [--dry-run] [--only SECTIONS]

Prints its tables and writes DIR/report.json and DIR/report.md (default runs/gpu_check). User
guide: docs/gpu-check.md. Parts (tools/gpu_check_lib/):

kernels-step (issue 34)
  1. kernels_check: flash attention (causal; head dim 64, 128; MHA and GQA with 8 groups; seq 2k
     and 8k, 64k tokens per case) and RMSNorm/LayerNorm (hidden 4096, 8192; 16k rows), forward and
     backward in bf16: error vs fp32, TFLOP/s or GB/s, ratio to torch (SDPA flash, F.rms_norm /
     F.layer_norm, apex when importable); a failing case is one row with its error line.
  2. step_check.check_step: a 1.1B Llama (seq 4096, 8 microbatches of 1) through our Trainer,
     3 warm-up + 20 timed iterations: tokens/s, TFLOP/s (the log line's FLOP count), MFU against
     the device preset's dense bf16 peak, host syncs per iteration; the same model as a bare
     PyTorch loop (SDPA, AdamW fused) for the ratio.
  3. step_check.check_memory: five configurations of that model, 3 iterations each: the
     estimate (certain, total) beside max_memory_allocated / max_memory_reserved, and whether
     the start-up check's decision was right.
offload (issue 35)
  1-3. offload_check / offload_tables: six 5-iteration runs of a 0.17B Llama (optimizer
     offload 1 and 0.5, host-resident chunks 1/1/1 and auto, and their device-only runs):
     losses, bytes vs the estimate, waits, CPU step, copy bandwidth vs a plain pinned copy_.
  4. size_check: the largest Llama that fits this GPU and host with full host residency, and
     without offload, by tools/bench/max_model_size.py's rule; 3 iterations each.
throughput (issue 43; throughput_check.py)
  ours (default and best flags), bare PyTorch eager/compiled and torchtitan 0.2.2 eager/compiled at the
  Llama-3-8B layer shape, 8 and 16 layers, each in a fresh process; our attention kernel vs each SDPA
  backend; four memory configurations on both sides of the device's limit.

Time budget: 6 minutes per part. Each part has a 360 s deadline; a section that would start with
less time left than it needs is skipped and says so. Measured 2026-11-26 (docs/gpu-check.md):
kernels-step 74-85 s on an H100, offload 176 s on an H200.

--dry-run runs the same code on CPU at tiny sizes (kernels under TRITON_INTERPRET=1) and fills
every cell that needs no CUDA; speed and allocator cells read "n/a (dry run)".
Bad input (an unknown --part, an --out that cannot be written, no CUDA without --dry-run): one
`error:` line, exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.gpu_check_lib.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
