#!/usr/bin/env python
"""The largest Llama that fits a device (and host) budget, per optimizer and sharding strategy.

    python tools/bench/max_model_size.py [--device-memory-gb 16] [--dp 4] [--host-memory-gb H] [--fp32]

A family of Llamas (hidden h = 256, 384, ..., h / 128 layers, h / 128 heads of 128, Megatron's
SwiGLU ffn, seq 2048, micro batch 1, full recomputation, bf16 weights) on dp ranks. Columns:
plain AdamW (no_shard), the distributed optimizer (optim), optim_grads, optim_grads_params,
optimizer offload with the distributed optimizer and optim_grads_params with optimizer offload
(the least optimizer state on host that lets the device part fit, rounded to whole chunks by
the static policy), full host residency (optim_grads_params with optimizer state, gradient and
parameter shards all on host: --optimizer-offload-fraction 1 --grad-offload-fraction 1
--param-offload-fraction 1), and device + host together: optim_grads_params with the least
static fractions (optimizer, gradients, parameters; nested) that let the device part fit,
found along the order of the auto policy (placement.auto_placement: optimizer state goes to
host first, then gradients, then parameters); when that point overflows the host budget, along
a second order in which each chunk's gradient goes to host with its optimizer state (free on
host: the resident gradient is the optimizer's host copy), which with bf16 weights spends the
least host memory for the device bytes it frees (one host byte per device byte). The fractions
chosen are printed. The trainer's auto policy places chunk by chunk rather than by fractions;
under a host budget it also brings parameters back first, then whole chunks (keeping each
gradient on host with its optimizer state), and it keeps a 10% margin of the device that this
count does not.

A member fits when its per-rank device bytes — the estimator's certain part (weights, gradient
buffers, optimizer state on the device, saved activations: equal to the measured bytes on CPU,
tests/parallel/test_memory_measured.py and test_sharding_strategies.py) plus the whole buckets
that sharded strategies hold during forward/backward — fit the device budget, and its host
bytes (the host slab: offloaded optimizer state, resident gradient and parameter shards,
staging slots of the gradient additions) fit the host budget.

First the table for `--device-memory-gb` per rank at `--dp`, then two fixed budgets: a node of
8 x 80 GiB with 1 TiB of host memory in all (PatrickStar's A100 node) and one 80 GiB GPU with
256 GiB of host (ZeRO-Offload's one-GPU claim), each with the largest member per column, its
ratio to plain AdamW and the fractions on host of the columns that use host memory; the last
line takes the best column. By the accounting only: no GPU has run these members.
Last line: `largest Llama that fits: node 8x80GiB+1TiB host <N>B parameters, one 80GiB GPU+256GiB
host <M>B parameters`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.core.distributed.placement import (  # noqa: E402
    auto_placement,
    forward_order,
    part_bytes,
    shard_numels,  # noqa: E402
)
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.planning.model_states import chunk_buffers  # noqa: E402
from megatron.planning.parameters import rank_chunks  # noqa: E402
from megatron.training.arguments.tool_command_line import run_config_for_tool  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402

GIB = float(1 << 30)
WIDTHS = tuple(range(256, 16385, 128))
FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy")
PARTS = ("optimizer", "grads", "params")  # the order of --optimizer/--grad/--param-offload-fraction
AUTO_ORDER = (("optimizer",), ("grads",), ("params",))  # to host in this order, as placement.auto_placement
WITH_GRADIENTS = (("optimizer", "grads"), ("params",))  # a chunk's gradient goes to host with its optimizer state


@dataclass(frozen=True)
class Column:
    """`paths`: each a sequence of steps, each step moving its parts' fractions from 0 to 1
    together; the column takes the first path whose least step that fits the device also fits
    the host. `fixed`: the (optimizer, grads, params) fractions on host, whatever the budget."""

    flags: tuple
    paths: tuple = ()
    fixed: tuple = (0.0, 0.0, 0.0)

    @property
    def on_host(self) -> bool:
        return bool(self.paths) or any(self.fixed)


OGP = FSDP + ("optim_grads_params",)
COLUMNS = {
    "plain AdamW": Column(()),
    "distributed": Column(("--use-distributed-optimizer",)),
    "optim_grads": Column(FSDP + ("optim_grads",)),
    "optim_grads_params": Column(OGP),
    "offload": Column(("--use-distributed-optimizer",), paths=((("optimizer",),),)),
    "params+offload": Column(OGP, paths=((("optimizer",),),)),
    "host resident": Column(OGP, fixed=(1.0, 1.0, 1.0)),
    "device+host": Column(OGP, paths=(AUTO_ORDER, WITH_GRADIENTS)),
}
FIXED_BUDGETS = (("node 8x80GiB+1TiB host", 8, 80.0, 1024.0 / 8), ("one 80GiB GPU+256GiB host", 1, 80.0, 256.0))
BISECTIONS = 9  # a step's fraction to within 1/512 of its elements (a 90B member has ~300 chunks per rank)


def member_argv(width: int, dp: int, bf16: bool, flags: tuple, fractions: tuple, seq_length: int = 2048) -> list[str]:
    """pretrain_llama.py flags of the member, with `fractions` (optimizer, grads, params) on host
    (`seq_length`: the family's 2048; tools/gpu_check.py's dry run trains a shorter one)."""
    argv = [
        "--num-layers",
        str(max(2, width // 128)),
        "--hidden-size",
        str(width),
        "--num-attention-heads",
        str(max(2, width // 128)),
        "--seq-length",
        str(seq_length),
        "--max-position-embeddings",
        str(seq_length),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(dp),
        "--vocab-size",
        "32000",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    argv += (["--bf16"] if bf16 else []) + list(flags)
    optimizer, grads, params = fractions
    if optimizer:
        argv += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", str(optimizer)]
    argv += ["--grad-offload-fraction", str(grads)] if grads else []
    argv += ["--param-offload-fraction", str(params)] if params else []
    return argv


@functools.cache
def member_run(width: int, dp: int, bf16: bool, flags: tuple, fractions: tuple):
    """(model config, memory layout) of the member, with `fractions` (optimizer, grads, params) on host."""
    run = run_config_for_tool(member_argv(width, dp, bf16, flags, fractions), "llama", dp, "max_model_size")
    return run.model, layout_from_run(run, "cuda")


@functools.cache
def estimate(width: int, dp: int, bf16: bool, flags: tuple, fractions: tuple):
    """Pipeline rank 0 of the member, with `fractions` (optimizer, grads, params) on host."""
    return estimate_memory(*member_run(width, dp, bf16, flags, fractions)).ranks[0]


def auto_decision(width: int, dp: int, bf16: bool, budget: float, host_budget: float):
    """What the trainer's --offload-policy auto decides for the member under optim_grads_params:
    chunk by chunk, from the estimate with every part on host, with its 10% device margin."""
    member, full = (width, dp, bf16, OGP), (1.0, 1.0, 1.0)
    model, layout = member_run(*member, full)
    buffers = [b for chunk in rank_chunks(model, layout, 0) for b in chunk_buffers(model, layout, chunk)]
    costs = part_bytes(2 if bf16 else 4, shards_grads=True, shards_params=True)
    return auto_placement(
        forward_order(buffers),
        shard_numels(buffers),
        costs,
        int(budget),
        estimate(*member, full).total_bytes,
        2 if bf16 else 4,
        int(host_budget),
    )


def device_bytes(rank) -> int:
    return rank.certain_bytes + rank.gathered_bytes


def fractions_at(path: tuple, steps_done: int, fraction: float) -> tuple:
    """(optimizer, grads, params) on host after `steps_done` whole steps of `path` and `fraction` of the next."""
    on_host = {part: 1.0 for step in path[:steps_done] for part in step}
    if steps_done < len(path):
        on_host.update({part: fraction for part in path[steps_done]})
    return tuple(on_host.get(part, 0.0) for part in PARTS)


def least_that_fits(member: tuple, path: tuple, budget: float) -> tuple:
    """The fractions at the least point of `path` whose device bytes fit `budget`, to within
    BISECTIONS halvings of a step (the path's end when none fits). Device bytes do not rise
    along a path: a larger fraction puts a superset of chunks on host."""

    def fits(fractions):
        return device_bytes(estimate(*member, fractions)) <= budget

    knots = [fractions_at(path, k, 0.0) for k in range(len(path) + 1)]
    first = next((k for k, f in enumerate(knots) if fits(f)), None)
    if not first:  # fits with nothing moved (0), or does not fit at all (None)
        return knots[0 if first == 0 else -1]
    low, high = 0.0, 1.0  # of step `first - 1`: does not fit, fits
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (low, middle) if fits(fractions_at(path, first - 1, middle)) else (middle, high)
    return fractions_at(path, first - 1, high)


def placed(width: int, dp: int, bf16: bool, column: str, budget: float, host_budget: float | None):
    """(rank estimate, fractions on host, fits) of the column's placement for these budgets."""
    spec = COLUMNS[column]
    member = (width, dp, bf16, spec.flags)
    candidates = [least_that_fits(member, path, budget) for path in spec.paths] or [spec.fixed]
    for fractions in candidates:
        rank = estimate(*member, fractions)
        if device_bytes(rank) <= budget and (host_budget is None or rank.host_bytes <= host_budget):
            return rank, fractions, True
    return estimate(*member, candidates[-1]), candidates[-1], False


def largest(dp: int, bf16: bool, budget: float, host_budget: float | None) -> dict[str, tuple]:
    """Per column, (parameters, fractions on host) of the largest member that fits ((0, None) when none does)."""
    out = {}
    for column in COLUMNS:
        out[column] = (0, None)
        for width in WIDTHS:
            rank, fractions, fits = placed(width, dp, bf16, column, budget, host_budget)
            if fits and rank.parameters > out[column][0]:
                out[column] = (rank.parameters, fractions)
    return out


def _fractions(fractions: tuple | None) -> str:
    return "/".join(f"{f:.3g}" for f in fractions) if fractions else "-"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--device-memory-gb", type=float, default=16.0)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--host-memory-gb", type=float, help="host budget per rank (default: not limited)")
    parser.add_argument(
        "--fp32",
        action="store_true",
        help="fp32 weights (default bf16: 18 bytes per parameter with plain AdamW, 6 + 12/dp distributed, 6 offloaded)",
    )
    args = parser.parse_args(argv)
    bf16 = not args.fp32
    budget = args.device_memory_gb * GIB
    host_budget = None if args.host_memory_gb is None else args.host_memory_gb * GIB
    print(
        f"device budget {args.device_memory_gb} GiB per rank, dp {args.dp}, {'bf16' if bf16 else 'fp32'} weights, "
        f"seq 2048, micro batch 1, full recomputation (GiB per rank on the device; offload: device / host)"
    )
    print(f"{'hidden':>7}{'layers':>7}{'parameters':>17}" + "".join(f"{c:>20}" for c in COLUMNS))
    for width in [w for w in WIDTHS if w <= 4096]:
        cells = []
        for column, spec in COLUMNS.items():
            rank, _, fits = placed(width, args.dp, bf16, column, budget, host_budget)
            text = f"{device_bytes(rank) / GIB:.2f}" + (f" / {rank.host_bytes / GIB:.2f}" if spec.on_host else "")
            cells.append(text + ("" if fits else " x"))
        print(f"{width:>7}{max(2, width // 128):>7}{rank.parameters:>17,}" + "".join(f"{c:>20}" for c in cells))
    found = largest(args.dp, bf16, budget, host_budget)
    print("x: does not fit. largest that fits: " + ", ".join(f"{k} {v / 1e6:,.0f}M" for k, (v, _) in found.items()))
    print(f"offload / plain parameters: {found['offload'][0] / max(found['plain AdamW'][0], 1):.2f}")
    best = []
    for name, dp, device_gib, host_gib in FIXED_BUDGETS:
        found = largest(dp, bf16, device_gib * GIB, host_gib * GIB)
        plain = max(found["plain AdamW"][0], 1)
        print(
            f"{name} (dp {dp}, {host_gib:g} GiB host per rank): "
            + ", ".join(f"{k} {v / 1e9:.1f}B ({v / plain:.2f}x)" for k, (v, _) in found.items())
            + "; on host (optimizer/grads/params fractions): "
            + ", ".join(f"{k} {_fractions(f)}" for k, (_, f) in found.items() if COLUMNS[k].on_host)
        )
        best.append(f"{name} {max(v for v, _ in found.values()) / 1e9:.1f}B parameters")
        auto = max(
            (
                estimate(w, dp, bf16, OGP, (1.0, 1.0, 1.0)).parameters
                for w in WIDTHS
                if auto_decision(w, dp, bf16, device_gib * GIB, host_gib * GIB).fits
            ),
            default=0,
        )
        print(
            f"  the trainer's --offload-policy auto there (chunk by chunk, 10% of the device kept free, its "
            f"total estimate rather than the certain part): {auto / 1e9:.1f}B"
        )
    print("largest Llama that fits: " + ", ".join(best))


if __name__ == "__main__":
    main()
