#!/usr/bin/env python
"""Replicated vs distributed optimizer, one training step on CPU gloo ranks, side by side.

    python tools/bench/distributed_optimizer.py [--iters 5]

For DP=2 and DP=4 (tiny Llama, fp32 and bf16 weights) and each optimizer: step time (the
slowest rank's, median over `--iters` steps after a warm-up step), optimizer-state bytes per
rank counted from the tensors against 12/d (bf16) or 8/d (fp32) bytes per parameter, and
bytes each rank sends per step in the gradient and parameter collectives, counted at run time
by wrapping torch.distributed's collectives (ring algorithms: a rank sends (d-1)/d of a
reduce-scatter's input or an all-gather's output, twice that for an all-reduce). Then the
overlap achieved: time the end of backward waits on gradient reductions
(`finish_grad_sync`), with and without --overlap-grad-reduce. Also the sharding strategies
optim_grads and optim_grads_params (bf16): what they keep per rank, and their traffic (one
reduce-scatter per microbatch; two parameter all-gathers per microbatch for optim_grads_params),
and for optim_grads_params the gathers modules waited for: how many per step, the share that
was ready (whole already, or prefetched by the previous module's hook) and the time spent in them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.distributed.model_chunk_buffers import ModelChunkBuffers  # noqa: E402
from megatron.core.distributed.param_and_grad_buffer import Bucket  # noqa: E402
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402

FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--ffn-hidden-size",
    "688",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "100",
    "--mock-data",
    "--vocab-size",
    "1000",
    "--ddp-bucket-size",
    "200000",
]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
COLLECTIVES = {"all_reduce": 0, "reduce_scatter_single": 1, "all_gather_single": 0}  # -> the full-size argument


@contextlib.contextmanager
def count_collectives():
    """Bytes of payload per collective kind while inside (all-reduce: its tensor; reduce-scatter:
    its full input; all-gather: its full output), by wrapping torch.distributed's functions."""
    counts: dict = {}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            tensor = args[COLLECTIVES[name]]
            counts[name] = counts.get(name, 0) + tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def sent_bytes(counts: dict, d: int) -> float:
    """Bytes one rank sends for these collectives with ring algorithms over d ranks."""
    ring = (d - 1) / d
    return ring * (
        2 * counts.get("all_reduce", 0) + counts.get("reduce_scatter_single", 0) + counts.get("all_gather_single", 0)
    )


def _trainer(extra: list[str]) -> Trainer:
    run = parse_run_config(FLAGS + extra, LLAMA_DEFAULTS, dist.get_world_size())
    return Trainer(run, torch.device("cpu"))


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def measure(rank: int, extra: list[str], iters: int) -> dict:
    trainer = _trainer(extra)
    trainer.train_step(1)
    times, waits = [], []
    finish = ModelChunkBuffers.finish_grad_sync

    def timed_finish(chunk):
        start = time.perf_counter()
        finish(chunk)
        waits[-1] += time.perf_counter() - start

    gather = Bucket.gather_params
    gathers = {"calls": 0, "ready": 0, "seconds": 0.0}

    def timed_gather(bucket):
        """A gather a module waits for: ready when already whole or prefetched (started earlier)."""
        whole = bucket.shards_params and bucket.param_full.allocated and bucket.param_handle is None
        gathers["calls"] += 1
        gathers["ready"] += whole or bucket.param_handle is not None
        start = time.perf_counter()
        gather(bucket)
        gathers["seconds"] += time.perf_counter() - start

    ModelChunkBuffers.finish_grad_sync = timed_finish
    Bucket.gather_params = timed_gather
    try:
        for iteration in range(2, iters + 2):
            waits.append(0.0)
            dist.barrier()
            with count_collectives() as counts:
                start = time.perf_counter()
                trainer.train_step(iteration)
                trainer.optimizer.wait_for_step()  # gathers in flight landed (sharded parameters: none)
                times.append(_slowest(time.perf_counter() - start))
    finally:
        ModelChunkBuffers.finish_grad_sync = finish
        Bucket.gather_params = gather
    return {
        "gathers": gathers,
        "step": statistics.median(times),
        "wait": statistics.median(waits),
        "counts": counts,
        "state": trainer.optimizer.state_bytes(),
        "params": trainer.parameters_on_rank(),
        "kept": sum(sum(chunk.buffer.kept_bytes()) for chunk in trainer.chunks),
    }


def _gathers(result: dict, iters: int) -> str:
    g = result["gathers"]
    if not g["calls"]:
        return "-"
    return (
        f"{g['calls'] // iters} per step, {100 * g['ready'] / g['calls']:.0f}% ready, {1e3 * g['seconds'] / iters:.1f}"
    )


def run_all(rank: int, variants: list, iters: int) -> list[dict]:
    return [measure(rank, extra, iters) for _, extra in variants]


def main() -> int:
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist_opt = ["--use-distributed-optimizer"]
    variants = [
        ("replicated fp32", []),
        ("distributed fp32", dist_opt),
        ("replicated bf16", ["--bf16"]),
        ("distributed bf16", dist_opt + ["--bf16"]),
        ("distributed fp32, --overlap-param-gather", dist_opt + ["--overlap-param-gather"]),
        ("distributed fp32, --no-overlap-grad-reduce", dist_opt + ["--no-overlap-grad-reduce"]),
        ("replicated fp32, --no-overlap-grad-reduce", ["--no-overlap-grad-reduce"]),
        ("optim_grads bf16", FSDP + ["optim_grads", "--bf16"]),
        ("optim_grads_params bf16", FSDP + ["optim_grads_params", "--bf16"]),
    ]
    print(
        "| dp | optimizer | step ms | step / replicated | state bytes per rank | bytes per parameter "
        "(12/d or 8/d) | weights + gradients kept per rank | sent per rank per step (collectives) | "
        "backward wait on reductions ms | parameter gathers waited for: ready (whole or prefetched), ms per step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dp in (2, 4):
        results = run_distributed(
            dp, run_all, [(n, v + ["--global-batch-size", str(4 * dp)]) for n, v in variants], args.iters
        )[0]
        base = {"fp32": results[0]["step"], "bf16": results[2]["step"]}
        for (name, _), r in zip(variants, results):
            full = 12 if "bf16" in name else 8
            shards = 1 if name.startswith("replicated") else dp
            kinds = ", ".join(
                f"{k.split('_')[0]}-{k.split('_')[1]} {v / 2**20:.2f} MiB" for k, v in sorted(r["counts"].items())
            )
            print(
                f"| {dp} | {name} | {r['step'] * 1e3:.1f} | {r['step'] / base[name.split(',')[0][-4:]]:.2f} | "
                f"{r['state']:,} | {r['state'] / r['params']:.3f} ({full / shards:.3f}) | {r['kept']:,} | "
                f"{sent_bytes(r['counts'], dp) / 2**20:.2f} MiB ({kinds}) | {r['wait'] * 1e3:.1f} | "
                f"{_gathers(r, args.iters)} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
