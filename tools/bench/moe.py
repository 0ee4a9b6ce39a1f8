#!/usr/bin/env python
"""MoE vs a dense model of the same active parameters per token, on one rank and on two (EP2 for MoE, DP2 for
dense), side by side in one run: step time ratio, the dispatcher's bytes per step against the analytic volume,
and the tokens-per-expert imbalance (max / mean over experts, per MoE layer, of the routes of the last step).

    python tools/bench/moe.py [--iters 5] [--hidden-size 128] [--experts 8] [--topk 2]

The dense model's MLP has topk x the expert's intermediate size, so a token meets the same MLP weights in both
(the router's h x E is the only extra). Times are CPU wall clock on this machine (gloo, shared cores): they
say what the routing, permutation and dispatch cost around the same matmuls here, not what a GPU does. GPU speed
is unmeasured (no grouped GEMM kernel is built; the experts run one after the other).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.tensor_parallel.mappings import COMM_STATS  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402

GLOBAL_BATCH, LAYERS = 8, 2


def flags(args, moe: bool, extra: list[str]) -> list[str]:
    common = (
        f"--num-layers {LAYERS} --hidden-size {args.hidden_size} --num-attention-heads 8 "
        f"--seq-length {args.seq_length} --micro-batch-size 4 --global-batch-size {GLOBAL_BATCH} "
        f"--train-iters {args.iters + 2} --mock-data --vocab-size 512 --lr 1e-3"
    ).split()
    if not moe:
        return common + ["--ffn-hidden-size", str(args.topk * args.expert_ffn)] + extra
    return (
        common
        + f"--num-experts {args.experts} --moe-router-topk {args.topk} --moe-ffn-hidden-size {args.expert_ffn}".split()
        + ["--moe-aux-loss-coeff", "1e-2"]
        + extra
    )


def run_one(rank: int, args, moe: bool, extra: list[str]) -> dict:
    trainer = Trainer(
        parse_run_config(flags(args, moe, extra), LLAMA_DEFAULTS, dist.get_world_size()), torch.device("cpu")
    )
    counts: list[torch.Tensor] = []
    for module in trainer.chunks[0].module.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda _m, _i, out: counts.append(out[1].sum(dim=0)))
    trainer.train_step(1)  # warm-up
    with COMM_STATS.counting() as stats:
        trainer.train_step(2)
    times = []
    for iteration in range(3, args.iters + 3):
        counts.clear()
        start = time.perf_counter()
        trainer.train_step(iteration)
        times.append(time.perf_counter() - start)
    trainer.close()
    layers = len(counts) // max(1, trainer.run.training.num_microbatches) if counts else 0
    per_layer = [sum(counts[i::layers]) for i in range(layers)] if layers else []
    if per_layer and dist.get_world_size() > 1:  # routes of the whole data-parallel batch
        for tensor in per_layer:
            dist.all_reduce(tensor)
    imbalance = [float(c.max() / c.float().mean()) for c in per_layer]
    return {"step": statistics.median(times), "bytes": dict(stats.bytes), "imbalance": imbalance}


def analytic_alltoall(args) -> int:
    """Bytes all ranks hand to the all-to-all in one step: per route of every token and MoE layer, the row and
    its weight out and the row back, forward and backward: 2 (2h + 1) fp32 values."""
    routes = GLOBAL_BATCH * args.seq_length * args.topk
    return LAYERS * routes * 2 * (2 * args.hidden_size + 1) * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=128)
    args = parser.parse_args()
    rows = [
        ("dense, 1 rank", 1, False, []),
        ("MoE, 1 rank", 1, True, []),
        ("dense, DP2", 2, False, []),
        (
            "MoE, EP2 alltoall",
            2,
            True,
            ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
        ),
        ("MoE, EP2 allgather", 2, True, ["--expert-model-parallel-size", "2"]),
    ]
    results = {name: run_distributed(world, run_one, args, moe, extra) for name, world, moe, extra in rows}
    dense = {1: results["dense, 1 rank"][0]["step"], 2: results["dense, DP2"][0]["step"]}
    print(
        "| run | step (ms) | / dense, same ranks | dispatcher MiB per step (all ranks) | tokens per expert max/mean |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, world, moe, _ in rows:
        ranks = results[name]
        step = max(r["step"] for r in ranks)
        moved = sum(
            v for r in ranks for k, v in r["bytes"].items() if k in ("all_to_all", "all_gather", "reduce_scatter")
        )
        imbalance = ", ".join(f"{x:.2f}" for x in ranks[0]["imbalance"]) if moe else "-"
        mib = f"{moved / 2**20:.2f}" if world > 1 and moe else "-"
        print(f"| {name} | {step * 1000:.1f} | {step / dense[world]:.2f} | {mib} | {imbalance} |")
    a2a = sum(r["bytes"].get("all_to_all", 0) for r in results["MoE, EP2 alltoall"])
    print(f"alltoall bytes per step: measured {a2a:,}, analytic {analytic_alltoall(args):,}")
    print("CPU wall clock on shared cores (gloo); GPU speed is unmeasured.")


if __name__ == "__main__":
    main()
