#!/usr/bin/env python
"""Host-resident chunks on CPU: bytes moved per step and the time spent waiting for fetched parameters.

    python tools/bench/host_chunks.py [--rounds 5] [--iters 4]

A tiny Llama (4 layers, hidden 256, seq 64, bf16, buckets of 200k elements: 10 chunks per
rank) trained on 2 forked gloo ranks under --data-parallel-sharding-strategy optim_grads_params,
2 microbatches per rank, in four layouts: without offload (the reference), static full host
residency (optimizer state, gradient and parameter shards of every chunk on host: fractions
1/1/1), static half (1/0.5/0.5) and --offload-policy auto with a --device-memory-gb computed
here to hold the auto policy's fixed part plus the parameters of every chunk and the gradients
of about half of them (its decision line is printed). The four trainers are built side by side
and, after a warm-up step each, run in turn: --rounds rounds of --iters steps each, the order
rotated every round. Per layout, rank 0's counts per step: bytes moved device->host and
host->device (the optimizer step's copies plus the host-resident gradients' additions and
parameter fetches) next to the bytes the placement implies (`analytic_bytes`), the gathers of
host-resident parameters, the share of them started ahead by the previous module's hook
(prefetch hit rate), the time the training thread waited for them and for every parameter
all-gather (host-resident or not: the reference has these too), the CPU step, and the step
time (the slowest rank's mean over a round's steps, the last step's CPU work included; median
over rounds) with its ratio to the reference.

On CPU host = device: the copies are memcpy within one memory, the CPU Adam step shares the
cores with the training thread, and the gathers are gloo's. So the bytes and the hit rate are
the ones a GPU run would see, the times are not: nothing here has run on a GPU.
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

from megatron.core.distributed.param_and_grad_buffer import Bucket  # noqa: E402
from megatron.core.distributed.placement import AUTO_MARGIN  # noqa: E402
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402

DP = 2
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
    "--global-batch-size",
    str(2 * 2 * DP),
    "--train-iters",
    "100",
    "--mock-data",
    "--vocab-size",
    "1000",
    "--ddp-bucket-size",
    "200000",
    "--bf16",
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
]
OFFLOAD = ["--optimizer-cpu-offload"]
LAYOUTS = [
    ("no offload", []),
    ("static full 1/1/1", OFFLOAD + ["--grad-offload-fraction", "1", "--param-offload-fraction", "1"]),
    ("static half 1/0.5/0.5", OFFLOAD + ["--grad-offload-fraction", "0.5", "--param-offload-fraction", "0.5"]),
    ("auto", OFFLOAD + ["--offload-policy", "auto"]),
]  # --device-memory-gb: auto_budget_gb()
MIB = float(1 << 20)


def _run(extra: list[str]):
    return parse_run_config(FLAGS + extra, LLAMA_DEFAULTS, DP)


def auto_budget_gb(shard_elements: int) -> float:
    """A device budget under which the auto policy keeps every chunk's parameters and about half
    of the gradients on the device: its fixed part (the estimate with every movable part on host)
    plus those bytes (bf16 parameters, fp32 gradients), over 1 - its margin."""
    run = _run(LAYOUTS[-1][1])
    fixed = estimate_memory(run.model, layout_from_run(run, "cpu")).ranks[0].total_bytes
    kept = shard_elements * (2 + 4 / 2)
    return (fixed + kept) / (1 - AUTO_MARGIN) / (1 << 30)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


@contextlib.contextmanager
def gather_waits(seconds: list[float], current: list[int]):
    """Adds to seconds[current[0]] the time spent waiting for any parameter all-gather to land
    (host-resident or not), by wrapping Bucket.finish_param_gather."""
    finish = Bucket.finish_param_gather

    def timed(bucket):
        start = time.perf_counter()
        finish(bucket)
        seconds[current[0]] += time.perf_counter() - start

    Bucket.finish_param_gather = timed
    try:
        yield
    finally:
        Bucket.finish_param_gather = finish


def analytic_bytes(trainer) -> tuple[int, int]:
    """(device->host, host->device) bytes per step that the placement implies, m microbatches:
    a host-resident gradient shard receives each microbatch's reduce-scattered gradient; a chunk
    with only its optimizer state on host sends its gradient shard at the step and gets its
    updated weights back; a host-resident parameter shard is fetched for each of its bucket's
    two gathers per microbatch (forward, and backward after the release)."""
    placement, m = trainer.optimizer.host.placement, trainer.run.training.num_microbatches
    buckets = [bucket for chunk in trainer.chunks for bucket in chunk.buffer.buckets]
    grad = [b.grad_shard.numel() * b.grad_shard.element_size() for b in buckets]
    param = [b.param_shard.numel() * b.param_shard.element_size() for b in buckets]
    d2h = sum(m * grad[i] if i in placement.grads else grad[i] for i in placement.optimizer)
    h2d = sum(2 * m * param[i] if i in placement.params else param[i] for i in placement.optimizer)
    return d2h, h2d


def _counts(trainer, steps: int) -> dict:
    """Rank 0's offload and fetch counters since the warm-up, per step."""
    optimizer = trainer.optimizer
    if optimizer.host is None:
        return {}
    stats, fetches = optimizer.adam.offload.take_stats(), optimizer.host.take_stats()
    assert stats.steps == steps, (stats.steps, steps)
    out = dict(
        d2h=(stats.d2h_bytes + fetches.d2h_bytes) / steps,
        h2d=(stats.h2d_bytes + fetches.h2d_bytes) / steps,
        step_d2h=stats.d2h_bytes / steps,
        step_h2d=stats.h2d_bytes / steps,
        fetches=fetches.fetches / steps,
        hit_rate=fetches.hit_rate,
        wait=fetches.wait_seconds / steps,
        cpu=stats.cpu_seconds / steps,
        counts=optimizer.host.placement.counts(),
        chunks=len(optimizer.shards),
        analytic=analytic_bytes(trainer),
    )
    if trainer.placement_decision is not None:
        out["decision"] = trainer.placement_decision.describe()
    return out


def measure(rank: int, rounds: int, iters: int) -> tuple[list, list[dict]]:
    """Every layout's trainer side by side: a warm-up step each, then `rounds` rounds of `iters`
    steps of each layout, the order rotated each round; a layout's step time is the median
    over rounds of the slowest rank's mean step."""
    reference = Trainer(_run([]), torch.device("cpu"))
    elements = sum(b.param_shard.numel() for c in reference.chunks for b in c.buffer.buckets)
    budget = f"{auto_budget_gb(elements):.5f}"
    layouts = LAYOUTS[:-1] + [(f"auto, --device-memory-gb {budget}", LAYOUTS[-1][1] + ["--device-memory-gb", budget])]
    trainers = [reference] + [Trainer(_run(extra), torch.device("cpu")) for _, extra in layouts[1:]]
    for trainer in trainers:
        trainer.train_step(1)
        trainer.optimizer.wait_for_step()
        _counts(trainer, 1)  # the warm-up's counts are dropped
    times, iteration = [[] for _ in trainers], 2
    waits, current = [0.0] * len(trainers), [0]
    with gather_waits(waits, current):
        for round_ in range(rounds):
            for index in [(round_ + k) % len(trainers) for k in range(len(trainers))]:
                trainer, current[0] = trainers[index], index
                dist.barrier()
                start = time.perf_counter()
                for step in range(iteration, iteration + iters):
                    trainer.train_step(step)
                trainer.optimizer.wait_for_step()  # the last step's CPU work and copies count too
                times[index].append(_slowest(time.perf_counter() - start) / iters)
            iteration += iters
    results = [
        dict(_counts(trainer, rounds * iters), step=statistics.median(t), all_wait=w / (rounds * iters))
        for trainer, t, w in zip(trainers, times, waits)
    ]
    for trainer in trainers:
        trainer.close()
    return [name for name, _ in layouts], results


def _row(name: str, r: dict, reference: float) -> str:
    cpu = f"{1e3 * r['cpu']:.1f}" if "cpu" in r else "-"
    times = f"{1e3 * r['all_wait']:.1f} | {cpu} | {1e3 * r['step']:.1f} | {r['step'] / reference:.2f} |"
    if "d2h" not in r:
        return f"| {name} | - | 0 | 0 | 0 / 0 | - | - | - | {times}"
    c = r["counts"]
    ahead = f"{100 * r['hit_rate']:.0f}%" if r["fetches"] else "-"
    d2h, h2d = r["analytic"]
    return (
        f"| {name} | {c['optimizer']}/{c['grads']}/{c['params']} of {r['chunks']} | {r['d2h'] / MIB:.2f} "
        f"({r['step_d2h'] / MIB:.2f}) | {r['h2d'] / MIB:.2f} ({r['step_h2d'] / MIB:.2f}) | {d2h / MIB:.2f} / "
        f"{h2d / MIB:.2f} | {r['fetches']:.1f} | {ahead} | {1e3 * r['wait']:.1f} | {times}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the layouts (default 5)")
    parser.add_argument("--iters", type=int, default=4, help="steps of a layout per round (default 4)")
    args = parser.parse_args()
    for flag, value in (("--rounds", args.rounds), ("--iters", args.iters)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names, results = run_distributed(DP, measure, args.rounds, args.iters)[0]
    print(
        f"host-resident chunks, optim_grads_params, dp {DP}, 2 microbatches per rank, bf16 tiny Llama on CPU "
        f"(rank 0's bytes per step over {args.rounds * args.iters} steps after a warm-up step; step time: median "
        f"over {args.rounds} rounds of {args.iters} steps). On CPU host = device: the copies are memcpy and nothing "
        f"here has run on a GPU; the bytes and the share started ahead carry over to a GPU, the times do not."
    )
    for name, r in zip(names, results):
        if "decision" in r:
            print(f"{name}: {r['decision']}")
    print(
        "| layout | chunks on host: optimizer/grads/params | device->host MiB (of it the optimizer step) | "
        "host->device MiB (of it the optimizer step) | analytic device->host / host->device MiB | "
        "parameter gathers from host | started ahead | "
        "waited for them ms | waited for all parameter gathers ms | CPU step ms | step ms | step / no offload |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in zip(names, results):
        print(_row(name, r, results[0]["step"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
