#!/usr/bin/env python
"""The largest Llama that fits a device (and host) budget, per optimizer and sharding strategy.

    python tools/bench/max_model_size.py [--device-memory-gb 16] [--dp 4] [--host-memory-gb H] [--fp32]

A family of Llamas (hidden h = 256, 512, ..., h / 128 layers, h / 128 heads of 128, Megatron's
SwiGLU ffn, seq 2048, micro batch 1, full recomputation, bf16 weights) on dp ranks. Columns:
plain AdamW (no_shard), the distributed optimizer (optim), optim_grads, optim_grads_params,
optimizer offload with the distributed optimizer (all of it on host), and optim_grads_params
with as much optimizer state offloaded as the device needs (the fraction the start-up check
would propose, rounded to whole chunks by the static policy). A member fits when its per-rank
device bytes — the estimator's certain part (weights, gradient buffers, optimizer state on the
device, saved activations: equal to the measured bytes on CPU, tests/parallel/test_memory_measured.py
and test_sharding_strategies.py) plus the whole buckets that sharded strategies hold during
forward/backward — fit the device budget, and its host bytes (offloaded optimizer state) fit
the host budget. Not a column: host-resident parameters and gradients (not built).

First the table for `--device-memory-gb` per rank at `--dp`, then two fixed budgets: a node of
8 x 80 GiB with 1 TiB of host memory in all (PatrickStar's A100 node) and one 80 GiB GPU with
256 GiB of host (ZeRO-Offload's one-GPU claim), each with the largest member per column and
its ratio to plain AdamW. By the accounting only: no GPU has run these members.
Last line: `largest Llama that fits: node 8x80GiB+1TiB host <N>B parameters, one 80GiB GPU+256GiB
host <M>B parameters`.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.core.memory.estimator import estimate_memory  # noqa: E402
from megatron.core.memory.offload import fraction_that_fits  # noqa: E402
from megatron.training.memory_check import layout_from_run, run_config_for_tool  # noqa: E402

GIB = float(1 << 30)
WIDTHS = tuple(range(256, 16385, 256))
FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy")
COLUMNS = {  # name -> (flags, offloads optimizer state)
    "plain AdamW": ((), False),
    "distributed": (("--use-distributed-optimizer",), False),
    "optim_grads": (FSDP + ("optim_grads",), False),
    "optim_grads_params": (FSDP + ("optim_grads_params",), False),
    "offload": (("--use-distributed-optimizer",), True),
    "params+offload": (FSDP + ("optim_grads_params",), True),
}
FIXED_BUDGETS = (("node 8x80GiB+1TiB host", 8, 80.0, 1024.0 / 8), ("one 80GiB GPU+256GiB host", 1, 80.0, 256.0))


@functools.lru_cache(maxsize=None)
def estimate(width: int, dp: int, bf16: bool, flags: tuple, offload_fraction: float):
    argv = ["--num-layers", str(max(2, width // 128)), "--hidden-size", str(width), "--num-attention-heads",
            str(max(2, width // 128)), "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--micro-batch-size", "1", "--global-batch-size", str(dp), "--vocab-size", "32000",
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    argv += (["--bf16"] if bf16 else []) + list(flags)
    if offload_fraction:
        argv += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", str(offload_fraction)]
    run = run_config_for_tool(argv, "llama", dp, "max_model_size")
    return estimate_memory(run.model, layout_from_run(run, "cuda")).ranks[0]


def device_bytes(rank) -> int:
    return rank.certain_bytes + rank.gathered_bytes


def placed(width: int, dp: int, bf16: bool, column: str, budget: float):
    """(rank estimate, device bytes, host bytes) of the column's placement for this budget: offload
    columns put on host the least optimizer state that lets the device part fit (all of it when
    nothing fits)."""
    flags, offloads = COLUMNS[column]
    rank = estimate(width, dp, bf16, flags, 0.0)
    if offloads:
        fraction = fraction_that_fits(device_bytes(rank), rank.optimizer_bytes, int(budget))
        fraction = 1.0 if fraction is None else min(1.0, fraction)
        rank = estimate(width, dp, bf16, flags, fraction) if fraction > 0 else rank
        if device_bytes(rank) > budget and fraction < 1.0:  # rounded down to whole chunks: one step more
            rank = estimate(width, dp, bf16, flags, 1.0)
    return rank, device_bytes(rank), rank.host_bytes


def largest(dp: int, bf16: bool, budget: float, host_budget: float | None) -> dict[str, int]:
    out = {}
    for column in COLUMNS:
        out[column] = 0
        for width in WIDTHS:
            rank, device, host = placed(width, dp, bf16, column, budget)
            if device <= budget and (host_budget is None or host <= host_budget):
                out[column] = max(out[column], rank.parameters)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--device-memory-gb", type=float, default=16.0)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--host-memory-gb", type=float, help="host budget per rank (default: not limited)")
    parser.add_argument("--fp32", action="store_true", help="fp32 weights (default bf16: 18 bytes per parameter "
                        "with plain AdamW, 6 + 12/dp distributed, 6 offloaded)")
    args = parser.parse_args(argv)
    bf16 = not args.fp32
    budget = args.device_memory_gb * GIB
    host_budget = None if args.host_memory_gb is None else args.host_memory_gb * GIB
    print(f"device budget {args.device_memory_gb} GiB per rank, dp {args.dp}, {'bf16' if bf16 else 'fp32'} weights, "
          f"seq 2048, micro batch 1, full recomputation (GiB per rank on the device; offload: device / host)")
    print(f"{'hidden':>7}{'layers':>7}{'parameters':>17}" + "".join(f"{c:>20}" for c in COLUMNS))
    for width in [w for w in WIDTHS if w <= 4096]:
        cells = []
        for column in COLUMNS:
            rank, device, host = placed(width, args.dp, bf16, column, budget)
            fits = device <= budget and (host_budget is None or host <= host_budget)
            text = f"{device / GIB:.2f}" + (f" / {host / GIB:.2f}" if COLUMNS[column][1] else "")
            cells.append(text + ("" if fits else " x"))
        print(f"{width:>7}{max(2, width // 128):>7}{rank.parameters:>17,}" + "".join(f"{c:>20}" for c in cells))
    found = largest(args.dp, bf16, budget, host_budget)
    print("x: does not fit. largest that fits: " + ", ".join(f"{k} {v / 1e6:,.0f}M" for k, v in found.items()))
    print(f"offload / plain parameters: {found['offload'] / max(found['plain AdamW'], 1):.2f}")
    best = []
    for name, dp, device_gib, host_gib in FIXED_BUDGETS:
        found = largest(dp, bf16, device_gib * GIB, host_gib * GIB)
        plain = max(found["plain AdamW"], 1)
        print(f"{name} (dp {dp}, {host_gib:g} GiB host per rank): " +
              ", ".join(f"{k} {v / 1e9:.1f}B ({v / plain:.2f}x)" for k, v in found.items()))
        best.append(f"{name} {max(found.values()) / 1e9:.1f}B parameters")
    print("largest Llama that fits: " + ", ".join(best))


if __name__ == "__main__":
    main()
