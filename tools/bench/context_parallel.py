#!/usr/bin/env python
"""Context-parallel attention (causal, load-balanced chunks) on CPU gloo ranks: memory saved
for backward per rank, attention work per rank, bytes sent per rank against the analytic
volume, and step time of the p2p ring against the all-gather variant.

    python tools/bench/context_parallel.py [--cp 1 2 4] [--seq-length 256] [--heads 8] [--kv-heads 2]

Analytic volume per rank, with B = this rank's K and V bytes (2 b (s/c) h_kv d, input dtype)
and A = the same in fp32 (the dK/dV accumulators):
  * p2p forward: the block travels c-1 hops, (c-1) B = 2 (c-1)/c x the K (or V) bytes of the
    whole sequence; backward: the blocks again plus their dK/dV, (c-1) (B + A).
  * all_gather (counted as the tensor-parallel collectives are: a gather's full output, a
    reduce-scatter's full input): forward c B; backward the re-gather c B and the
    reduce-scatter c A. A ring algorithm puts (c-1)/c of that on each rank's wire, so both
    variants send the same bytes; the ring overlaps them with compute and holds one block
    at a time instead of c.
Step times are taken on CPU with gloo on shared cores: compare the two variants in one run,
not with other machines.
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

from megatron.core.context_parallel import COMM_STATS, COMM_TYPES, context_parallel_attention  # noqa: E402
from megatron.core.context_parallel.sharding import causal_pairs, positions, shard  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402


def _local_inputs(args, cp_rank, cp):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.seq_length, args.heads, args.head_dim, generator=g)
    k, v = (torch.randn(args.batch, args.seq_length, args.kv_heads, args.head_dim, generator=g) for _ in range(2))
    return [shard(t, cp_rank, cp).requires_grad_() for t in (q, k, v)]


def _step(local, group, comm, impl):
    """Forward and backward; returns the bytes counted in each and the bytes saved for backward."""
    saved = []
    with (
        COMM_STATS.counting() as forward,
        torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ),
    ):
        out = context_parallel_attention(*local, group, comm_type=comm, impl=impl)
    forward_bytes = dict(forward.bytes)
    with COMM_STATS.counting() as backward:
        torch.autograd.grad(out.sum(), local)
    return forward_bytes, dict(backward.bytes), sum(saved)


def measure(rank, args):
    """Per comm type: counted bytes (forward, backward), saved bytes, median step time."""
    cp, group = dist.get_world_size(), dist.group.WORLD
    local = _local_inputs(args, rank, cp)
    results = {}
    for comm in COMM_TYPES:
        forward, backward, saved = _step(local, group, comm, args.impl)  # also the warm-up
        times = []
        for _ in range(args.iters):
            dist.barrier()
            start = time.perf_counter()
            out = context_parallel_attention(*local, group, comm_type=comm, impl=args.impl)
            torch.autograd.grad(out.sum(), local)
            times.append(time.perf_counter() - start)
        results[comm] = dict(forward=forward, backward=backward, saved=saved, time=statistics.median(times))
    return results


def block_bytes(args, cp):
    """B: one rank's K and V, fp32."""
    return 2 * args.batch * (args.seq_length // cp) * args.kv_heads * args.head_dim * 4


def analytic(args, cp, comm):
    """Counted bytes per rank by (phase, kind), fp32 inputs."""
    block = block_bytes(args, cp)
    if cp == 1:
        return {}
    if comm == "p2p":
        return {("forward", "p2p"): (cp - 1) * block, ("backward", "p2p"): 2 * (cp - 1) * block}
    return {
        ("forward", "all_gather"): cp * block,
        ("backward", "all_gather"): cp * block,
        ("backward", "reduce_scatter"): cp * block,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--impl", choices=["torch", "triton", "auto"], default="torch")
    args = parser.parse_args()
    for cp in args.cp:
        if cp < 1 or args.seq_length % (2 * cp):
            parser.error(f"--cp {cp}: --seq-length {args.seq_length} must be divisible by 2 x cp")
    if 1 not in args.cp:
        args.cp = [1] + args.cp
    runs = {cp: run_distributed(cp, measure, args) for cp in args.cp}
    print(
        f"causal attention fwd+bwd, b={args.batch} s={args.seq_length} h={args.heads} h_kv={args.kv_heads} "
        f"d={args.head_dim} fp32, impl={args.impl}, gloo on CPU"
    )

    print("\nmemory saved for backward per rank (bytes)")
    print(f"{'cp':>3} {'comm':>10} {'saved/rank':>11} {'vs cp=1':>8} {'ideal 1/c':>9}")
    for cp, ranks in runs.items():
        for comm in COMM_TYPES:
            saved = max(r[comm]["saved"] for r in ranks)
            print(f"{cp:>3} {comm:>10} {saved:>11,} {saved / runs[1][0][comm]['saved']:>8.3f} {1 / cp:>9.3f}")

    print("\ncausal attention work per rank: visible (query, key) pairs, max / mean over ranks")
    print(f"{'cp':>3} {'load-balanced':>14} {'contiguous':>11}")
    s = args.seq_length
    for cp in args.cp:
        balanced = [causal_pairs(positions(s, r, cp)) for r in range(cp)]
        contiguous = [causal_pairs(torch.arange(s).chunk(cp)[r]) for r in range(cp)]
        print(
            f"{cp:>3} {max(balanced) / statistics.mean(balanced):>14.3f} "
            f"{max(contiguous) / statistics.mean(contiguous):>11.3f}"
        )

    print(
        "\nbytes sent per rank: counted vs analytic; wire = bytes a ring algorithm puts on this rank's link,"
        " as a fraction of the whole sequence's K+V bytes"
    )
    print(
        f"{'cp':>3} {'comm':>10} {'phase':>8} {'kind':>14} {'counted':>11} {'analytic':>11} {'ratio':>6} {'wire/KV':>8}"
    )
    exact = True
    for cp, ranks in runs.items():
        for comm in COMM_TYPES:
            expected = analytic(args, cp, comm)
            for rank_result in ranks:
                counted = {
                    (phase, kind): n
                    for phase in ("forward", "backward")
                    for kind, n in rank_result[comm][phase].items()
                }
                exact &= counted == expected
            for (phase, kind), n in expected.items():
                c = counted.get((phase, kind), 0)
                wire = c if kind == "p2p" else c * (cp - 1) / cp
                print(
                    f"{cp:>3} {comm:>10} {phase:>8} {kind:>14} {c:>11,} {n:>11,} {c / n:>6.3f} "
                    f"{wire / (cp * block_bytes(args, cp)):>8.3f}"
                )
    print("counted volume equals the analytic volume on every rank" if exact else "MISMATCH with the analytic volume")

    print("\nstep time (fwd+bwd, median of the slowest rank)")
    print(f"{'cp':>3} {'p2p ms':>8} {'all_gather ms':>14} {'p2p/all_gather':>15} {'cp=1/p2p':>9}")
    one = runs[1][0]["p2p"]["time"]
    for cp, ranks in runs.items():
        p2p, gathered = (max(r[comm]["time"] for r in ranks) for comm in COMM_TYPES)
        print(f"{cp:>3} {p2p * 1e3:>8.2f} {gathered * 1e3:>14.2f} {p2p / gathered:>15.3f} {one / p2p:>9.3f}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
