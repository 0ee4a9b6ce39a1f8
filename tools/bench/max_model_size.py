#!/usr/bin/env python
"""The largest Llama that fits a device budget: plain AdamW vs distributed optimizer vs offload.

    python tools/bench/max_model_size.py [--device-memory-gb 16] [--dp 4] [--fp32]

A family of Llamas (hidden h = 256, 512, ... 4096, bf16 weights, h / 128 layers, h / 128 heads of 128, Megatron's
SwiGLU ffn, seq 2048, micro batch 1, full recomputation) on dp ranks: for each optimizer, the
largest member whose per-rank device bytes — weights + gradient buffers + optimizer state on
the device + saved activations: the estimator's certain part, which equals the measured bytes
on CPU (tests/parallel/test_memory_measured.py; the offload split is checked against the
tensors in tests/parallel/test_offload_optimizer.py) — fit the budget. This is the accounting
on CPU; on a GPU the same members are meant to be trained one step each under the budget
(not run yet: no GPU measurement exists). Last line: `offload / plain parameters: X` (target >= 2.5).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.core.memory.estimator import estimate_memory  # noqa: E402
from megatron.training.memory_check import layout_from_run, run_config_for_tool  # noqa: E402

WIDTHS = tuple(range(256, 4097, 256))
GIB = float(1 << 30)


def member(width: int, dp: int, bf16: bool, distributed: bool):
    flags = ["--num-layers", str(max(2, width // 128)), "--hidden-size", str(width), "--num-attention-heads",
             str(max(2, width // 128)), "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--micro-batch-size", "1", "--global-batch-size", str(dp), "--vocab-size", "32000",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    flags += (["--bf16"] if bf16 else []) + (["--use-distributed-optimizer"] if distributed else [])
    run = run_config_for_tool(flags, "llama", dp, "max_model_size")
    return estimate_memory(run.model, layout_from_run(run, "cuda")).ranks[0]


def device_bytes(rank, optimizer: str) -> int:
    """The certain part; with offload (fraction 1) the optimizer state is on host."""
    return rank.certain_bytes - (rank.optimizer_bytes if optimizer == "offload" else 0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--device-memory-gb", type=float, default=16.0)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--fp32", action="store_true", help="fp32 weights (default bf16: 18 bytes per parameter "
                        "with plain AdamW, 6 + 12/dp distributed, 6 offloaded)")
    args = parser.parse_args(argv)
    args.bf16 = not args.fp32
    budget = args.device_memory_gb * GIB
    print(f"device budget {args.device_memory_gb} GiB per rank, dp {args.dp}, {'bf16' if args.bf16 else 'fp32'} "
          f"weights, seq 2048, micro batch 1, full recomputation (GiB per rank: device / host)")
    print(f"{'hidden':>7}{'layers':>7}{'parameters':>15}{'plain AdamW':>14}{'distributed':>14}{'offload':>20}")
    largest = {"plain": 0, "distributed": 0, "offload": 0}
    for width in WIDTHS:
        plain = member(width, args.dp, args.bf16, distributed=False)
        sharded = member(width, args.dp, args.bf16, distributed=True)
        row = {"plain": (plain, device_bytes(plain, "plain")),
               "distributed": (sharded, device_bytes(sharded, "distributed")),
               "offload": (sharded, device_bytes(sharded, "offload"))}
        cells = []
        for name, (rank, nbytes) in row.items():
            fits = nbytes <= budget
            if fits:
                largest[name] = max(largest[name], rank.parameters)
            host = f" / {16 * sharded.optimizer_bytes // (8 if not args.bf16 else 12) / GIB:.2f}" \
                if name == "offload" else ""
            cells.append(f"{nbytes / GIB:.2f}{host}{'' if fits else ' x'}")
        print(f"{width:>7}{max(2, width // 128):>7}{plain.parameters:>15,}" + "".join(
            f"{c:>{w}}" for c, w in zip(cells, (14, 14, 20))))
    print("x: does not fit. largest that fits: " + ", ".join(f"{k} {v / 1e6:,.0f}M" for k, v in largest.items()))
    print(f"offload / plain parameters: {largest['offload'] / max(largest['plain'], 1):.2f}")


if __name__ == "__main__":
    main()
