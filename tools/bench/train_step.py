#!/usr/bin/env python
"""One-rank training step: our stack (Trainer.train_step) against a bare PyTorch loop on
the same model and batch, side by side in one run; prints the overhead ratio (target <= 1.05).

    python tools/bench/train_step.py [--iters 20] [--hidden-size 256] [--seq-length 256] [--bf16]

Bare loop: model(tokens, labels).mean() -> backward -> clip_grad_norm_ -> AdamW.step ->
zero_grad, with the same AdamW settings (no decay on 1-D parameters) and clipping.
Ours adds the fp32 gradient buffer, bucketed hooks, the global-norm reduction, the
loss average across ranks and the learning-rate schedule. Iterations alternate A/B so
machine noise hits both; the table shows medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.models.gpt_model import GPTModel  # noqa: E402
from megatron.core.tensor_parallel.initialization import initialize_parameters  # noqa: E402
from megatron.core.tensor_parallel.random import RNGTracker  # noqa: E402
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.initialize import free_port  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402


class BareLoop:
    def __init__(self, run, batch):
        self.model = GPTModel(run.model, tp_group=dist.group.WORLD, rng_tracker=RNGTracker("cpu", 0))
        initialize_parameters(self.model, run.training.seed)
        opt = run.optimizer
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=opt.lr,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_eps,
        )
        self.clip, self.batch = opt.clip_grad, batch

    def step(self) -> float:
        tokens, labels = self.batch.tokens, self.batch.labels
        loss = self.model(tokens, labels).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    argv = [
        "--num-layers",
        str(args.num_layers),
        "--hidden-size",
        str(args.hidden_size),
        "--num-attention-heads",
        "8",
        "--seq-length",
        str(args.seq_length),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--train-iters",
        str(args.iters + args.warmup),
        "--mock-data",
        "--vocab-size",
        "1024",
        "--lr",
        "1e-4",
        "--lr-decay-style",
        "constant",
    ]
    argv += ["--bf16"] if args.bf16 else []
    run = parse_run_config(argv, LLAMA_DEFAULTS, world_size=1)
    ours = Trainer(run, torch.device("cpu"))
    bare = BareLoop(run, ours.batch_fn(1)(0))
    ours_times, bare_times = [], []
    for i in range(args.warmup + args.iters):
        a, b = timed(lambda: ours.train_step(1)), timed(bare.step)
        if i >= args.warmup:
            ours_times.append(a)
            bare_times.append(b)
    ours_ms, bare_ms = statistics.median(ours_times) * 1e3, statistics.median(bare_times) * 1e3
    print(
        f"model: Llama {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
        f"micro batch {args.micro_batch_size}, {'bf16' if args.bf16 else 'fp32'}, CPU, "
        f"{torch.get_num_threads()} threads, {args.iters} iterations (median)"
    )
    print(f"{'path':<28} {'step ms':>9}")
    print(f"{'bare PyTorch loop':<28} {bare_ms:>9.1f}")
    print(f"{'ours (Trainer.train_step)':<28} {ours_ms:>9.1f}")
    print(f"overhead ratio ours/bare: {ours_ms / bare_ms:.3f} (target <= 1.05)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
