#!/usr/bin/env python
"""The offload optimizer's CPU AdamW step vs torch's, side by side on the same chunks.

    python tools/bench/cpu_adam.py [--params 100e6] [--chunk 25e6] [--steps 7] [--threads N]

One AdamW step over `--params` fp32 elements held in chunks of `--chunk` (the offload
optimizer's memory chunks), with weight decay on all but a small no-decay run per chunk
(as a shard's norm weights and biases): ours (`cpu_adam.CpuAdamW`, what --optimizer-cpu-offload
runs) vs torch.optim.AdamW(fused=True) vs foreach=True, and DeepSpeed's CPU Adam when it is
installed; and ours in the roundings that match a device shard's masters bit for bit
(`rounding="cpu"`, `"cuda"`: megatron/core/optimizer/adam_rounding.py). Each: median seconds
per step, effective GB/s at 28 bytes per element (read param, grad, m, v; write param, m, v),
and that as a share of the machine's copy bandwidth measured here (read + write of a large
tensor: the ceiling for a streaming kernel). Last line: `ratio ours/torch-fused: X` (target <= 1.0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.core.optimizer.cpu_adam import CpuAdamW, default_cpu_threads  # noqa: E402

BYTES_PER_ELEMENT = 28
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def interleaved_medians(steps: dict, rounds: int) -> dict:
    """Median seconds per step of each implementation, timed in turn within each round, so that
    every one sees the same machine load (these machines are shared and noisy)."""
    for step in steps.values():
        step()  # warm-up: first touch of the state, thread start
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            begin = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(numel: int, steps: int) -> float:
    src, dst = torch.rand(numel), torch.empty(numel)
    return 2 * 4 * numel / interleaved_medians({"copy": lambda: dst.copy_(src)}, steps)["copy"] / 1e9


def chunks(total: int, chunk: int) -> list[torch.nn.Parameter]:
    out = []
    for start in range(0, total, chunk):
        param = torch.nn.Parameter(torch.randn(min(chunk, total - start)))
        param.grad = torch.randn_like(param)
        out.append(param)
    return out


def ours(params: list, rounding: str = "fused"):
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    optimizers = [
        CpuAdamW(p.data, p.grad, m, v, decay=[(1024, p.numel())], decoupled=[], rounding=rounding)
        for p, (m, v) in zip(params, state)
    ]
    count = [0]

    def step():
        count[0] += 1
        for optimizer in optimizers:
            optimizer.step(count[0], HYPER["lr"], None, HYPER["betas"], HYPER["eps"], HYPER["weight_decay"])

    return step


def torch_adamw(params: list, **kind):
    decay = [p[1024:] for p in params]  # the same decay split as ours, as views with their own grads
    no_decay = [p[:1024] for p in params]
    leaves = []
    for group in (decay, no_decay):
        leaves.append([])
        for view in group:
            leaf = torch.nn.Parameter(view.detach())
            leaf.grad = torch.randn_like(leaf)
            leaves[-1].append(leaf)
    optimizer = torch.optim.AdamW([{"params": leaves[0]}, {"params": leaves[1], "weight_decay": 0.0}], **HYPER, **kind)
    return optimizer.step


def deepspeed_adam(params: list):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    optimizer = DeepSpeedCPUAdam(
        params,
        lr=HYPER["lr"],
        betas=HYPER["betas"],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        adamw_mode=True,
    )
    return optimizer.step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--chunk", type=float, default=25e6)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=default_cpu_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    total, chunk = int(args.params), int(args.chunk)
    ceiling = copy_bandwidth(chunk, args.steps)
    params = chunks(total, chunk)
    print(
        f"AdamW step over {total / 1e6:.0f}M fp32 elements in chunks of {chunk / 1e6:.0f}M, {args.threads} threads, "
        f"torch {torch.__version__}; copy bandwidth {ceiling:.1f} GB/s (the ceiling)"
    )
    print(f"{'implementation':<28}{'s/step':>10}{'GB/s':>10}{'of ceiling':>12}")
    steps = {
        "ours (cpu_adam.CpuAdamW)": ours(params),
        "torch AdamW fused=True": torch_adamw(params, fused=True),
        "torch AdamW foreach=True": torch_adamw(params, foreach=True),
        "DeepSpeedCPUAdam": deepspeed_adam(params),
        "ours, rounding=cpu": ours(params, "cpu"),  # bit-equal to ShardedAdamW on CPU
        "ours, rounding=cuda": ours(params, "cuda"),  # ShardedAdamW's CUDA rounding, emulated
    }
    results = interleaved_medians({k: v for k, v in steps.items() if v is not None}, args.steps)
    for name in steps:
        seconds = results.get(name)
        if seconds is None:
            print(f"{name:<28}{'not installed':>32}")
            continue
        rate = BYTES_PER_ELEMENT * total / seconds / 1e9
        print(f"{name:<28}{seconds:>10.3f}{rate:>10.1f}{rate / ceiling:>11.0%}")
    print(f"ratio ours/torch-fused: {results['ours (cpu_adam.CpuAdamW)'] / results['torch AdamW fused=True']:.3f}")


if __name__ == "__main__":
    main()
