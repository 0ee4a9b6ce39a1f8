#!/usr/bin/env python
"""Per-step overhead of a pipeline schedule, ours against torch.distributed.pipelining's, counted.

    python tools/bench/pipeline_overhead.py [--schedule 1f1b] [--pp 2] [--microbatches 8] [--steps 200]

Timing is noisy on a shared machine; counts are not. With blocks so small (hidden 8, 4 tokens)
that the work is the per-step overhead, each rank runs the benchmark's runs (tools/bench/pipeline.py:
the same blocks, weights and microbatches, ours in gradient buffers as the trainer builds them)
and reports per step: Python function calls (C functions called from Python included), aten
operators dispatched (backward included) and the process's CPU milliseconds (the least of three
windows of --steps steps; the only noisy column).
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline as bench  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from megatron.core.parallel_state import ParallelDims, ParallelMesh  # noqa: E402


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _python_calls(step, n: int) -> float:
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        for _ in range(n):
            step()
    finally:
        sys.setprofile(None)
    return calls / n


def _aten_ops(step) -> int:
    with _CountOps() as mode:
        step()
    return mode.count


def _cpu_ms(step, n: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(n):
            step()
        best = min(best, (time.process_time() - start) / n * 1e3)
    return best


def _measure(run, data, args, group) -> list:
    """[Python calls, aten ops, CPU ms] per step of one run, after a warm-up."""

    def step():
        run.step(data)

    for _ in range(20):
        step()
    measured = []
    for measure in (lambda: _python_calls(step, 10), lambda: _aten_ops(step), lambda: _cpu_ms(step, args.steps)):
        dist.barrier(group=group)
        measured.append(measure())
    return measured


def worker(rank: int, args) -> dict:
    p, v = args.pp, bench.chunks_per_rank(args.schedule, args.vpp)
    mesh = ParallelMesh(ParallelDims(pp=p), "cpu")
    bench._TorchSpans.install()  # torch's side timed as the benchmark times it
    torch.manual_seed(args.seed)
    blocks = [bench.torch_block(args.hidden, args.ffn) for _ in range(p * args.vpp * args.blocks_per_stage)]
    ours = functools.partial(bench.our_block, tp_group=mesh.tp_group, fusion=True)
    runs = {
        "ours": bench.Ours(bench._stages_for(blocks, p, v, rank, args.schedule, ours)[0], mesh, args, args.schedule),
        "torch": bench.Theirs(*bench._stages_for(blocks, p, v, rank, args.schedule), mesh, args, args.schedule),
    }
    x = torch.randn(args.microbatches, args.tokens, 1, args.hidden)
    data = (x, torch.randn_like(x), torch.ones(args.tokens, 1))
    return {side: _measure(run, data, args, mesh.pp_group) for side, run in runs.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--pp", type=bench._positive, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--vpp", type=bench._positive, default=2, help="chunks per rank, interleaved (default 2)")
    parser.add_argument("--microbatches", type=bench._positive, default=8, help="per step (default 8)")
    parser.add_argument(
        "--blocks-per-stage",
        type=bench._positive,
        default=1,
        help="MLP blocks per interleaved stage, a 1F1B stage holding vpp times as many (default 1)",
    )
    parser.add_argument("--steps", type=bench._positive, default=200, help="steps per CPU-time window (default 200)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    args.hidden, args.ffn, args.tokens, args.split_backward = 8, 16, 4, False
    results = bench.run_distributed(args.pp, worker, args)
    print(f"{args.schedule}, p={args.pp}, m={args.microbatches}, hidden 8, 4 tokens: per step and rank")
    print("rank  side    Python calls  aten ops  CPU ms (noisy)")
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for rank, result in enumerate(results):
        for side, (calls, ops, ms) in result.items():
            print(f"{rank:4d}  {side:6s}  {calls:12.0f}  {ops:8d}  {ms:14.2f}")
            totals[side][0] += calls
            totals[side][1] += ops
    ours, theirs = totals["ours"], totals["torch"]
    print(f"all ranks: ours/torch {ours[0] / theirs[0]:.2f}x the Python calls, {ours[1] / theirs[1]:.2f}x the aten ops")


if __name__ == "__main__":
    main()
