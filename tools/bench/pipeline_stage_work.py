#!/usr/bin/env python
"""The work of one pipeline stage, ours against torch's, by CPU time: no pipeline, no transfers.

    python tools/bench/pipeline_stage_work.py [--blocks 2] [--microbatches 8] [--rounds 50] [--quick]

tools/bench/pipeline.py times whole schedules; with more ranks than cores (p = 4 on two) a step
lasts as long as the ranks' summed work takes, so a difference in work shows there first. This
runs the benchmark's stage (its residual MLP blocks: ours from our linear layers in gradient
buffers, torch's from torch.nn.Linear, the same weights) forward and backward over the
microbatches of one step in one process and one thread, as each side's schedule would (ours:
gradient buffer zeroed, gradient accumulation fusion, the last-microbatch marker; torch: gradients
set to None, accumulated by autograd), and times each step by the thread's CPU clock, the two sides
alternating which goes first, after checking both give the same gradients. Prints the medians and
ours/torch.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import pipeline as bench  # noqa: E402
import torch  # noqa: E402

from megatron.core.distributed.model_chunk_buffers import DDPConfig, ModelChunkBuffers  # noqa: E402
from megatron.core.parallel_state import ParallelDims, ParallelMesh  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402


def _step_ours(stage, inputs, grad) -> None:
    stage.zero_grad_buffer()
    for mb, x in enumerate(inputs):
        stage.set_is_last_microbatch(mb == len(inputs) - 1)
        stage(x.clone().requires_grad_()).backward(grad)
    stage.finish_grad_sync()


def _step_torch(stage, inputs, grad) -> None:
    stage.zero_grad(set_to_none=True)
    for x in inputs:
        stage(x.clone().requires_grad_()).backward(grad)


def worker(rank: int, args) -> dict:
    torch.set_num_threads(1)
    mesh = ParallelMesh(ParallelDims(), "cpu")
    torch.manual_seed(args.seed)
    blocks = [bench.torch_block(args.hidden, args.ffn) for _ in range(args.blocks)]
    ours_blocks = [bench.our_block(b, mesh.tp_group, args.gradient_accumulation_fusion) for b in blocks]
    ours = ModelChunkBuffers(bench.Stage(ours_blocks), DDPConfig(), mesh.dp_cp_group)
    theirs = bench.Stage([copy.deepcopy(b) for b in blocks])
    inputs = list(torch.randn(args.microbatches, args.tokens, 1, args.hidden))
    grad = torch.randn(args.tokens, 1, args.hidden)
    sides = {
        "ours": functools.partial(_step_ours, ours, inputs, grad),
        "torch": functools.partial(_step_torch, theirs, inputs, grad),
    }
    sides["ours"](), sides["torch"]()  # equal work is the precondition for comparing time
    grad_diff = bench._max_rel_diff(
        [p.main_grad for p in ours.module.parameters()], [p.grad for p in theirs.parameters()]
    )
    if grad_diff > bench.GRAD_RTOL:
        raise RuntimeError(f"ours and torch's gradients differ (max rel diff {grad_diff:.1e}): not the same work")
    seconds = {name: [] for name in sides}
    for round_index in range(args.warmup + args.rounds):
        for name in sorted(sides, reverse=round_index % 2 == 1):
            start = time.thread_time()
            sides[name]()
            if round_index >= args.warmup:
                seconds[name].append(time.thread_time() - start)
    return {"grad_diff": grad_diff, **{name: statistics.median(samples) for name, samples in seconds.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--blocks", type=bench._positive, default=2, help="blocks in the stage (default 2: 1F1B's at v = 2)"
    )
    parser.add_argument("--hidden", type=bench._positive, default=512)
    parser.add_argument("--ffn", type=bench._positive, default=None, help="MLP inner size (default 2 * hidden)")
    parser.add_argument("--tokens", type=bench._positive, default=256, help="tokens per microbatch (default 256)")
    parser.add_argument("--microbatches", type=bench._positive, default=8)
    parser.add_argument("--warmup", type=bench._positive, default=10, help="untimed rounds (default 10)")
    parser.add_argument("--rounds", type=bench._positive, default=50, help="timed rounds (default 50)")
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 4 timed rounds")
    parser.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    args.ffn = args.ffn or 2 * args.hidden
    if args.quick:
        args.warmup, args.rounds = 2, 4
    try:
        medians = run_distributed(1, worker, args, timeout=900.0)[0]
    except (RuntimeError, AssertionError) as error:
        sys.exit(f"error: {error}")
    print(
        f"one stage, {args.blocks} blocks (hidden {args.hidden}, ffn {args.ffn}), {args.microbatches} microbatches of "
        f"{args.tokens} tokens, forward + backward, CPU time of one thread, median of {args.rounds} rounds: "
        f"ours {medians['ours'] * 1e3:.2f} ms, torch {medians['torch'] * 1e3:.2f} ms, "
        f"ours/torch {medians['ours'] / medians['torch']:.3f} "
        f"(gradients equal: max rel diff {medians['grad_diff']:.1e})"
    )


if __name__ == "__main__":
    main()
