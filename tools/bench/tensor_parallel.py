#!/usr/bin/env python
"""Bytes communicated per transformer layer per microbatch under tensor parallelism,
counted by the collectives themselves, against Megatron's analytic volume.

    python tools/bench/tensor_parallel.py [--tp 2 4] [--seq-length 128] [--micro-batch-size 2] [--hidden-size 256]

Analytic (forward + backward, per layer, activations of s*b*h elements):
- without SP: 4 all-reduces (2 forward: after attention and MLP; 2 backward: the
  inputs of the QKV and fc1 projections);
- with SP: 4 all-gathers + 4 reduce-scatters of the full s*b*h tensor, which move
  the same bytes as the 4 all-reduces (an all-reduce = reduce-scatter + all-gather),
  plus 2 all-gathers in backward that re-gather the inputs of the QKV and fc1
  projections: like Megatron, we save only their sequence shards (1/tp of the
  activation memory) and gather again for the weight gradients.
Counted sizes: an all-reduce's input, an all-gather's full output, a reduce-scatter's
full input. The "ring bytes" column counts an all-reduce as RS + AG, i.e. 2x.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.tensor_parallel.initialization import initialize_parameters  # noqa: E402
from megatron.core.tensor_parallel.mappings import COMM_STATS  # noqa: E402
from megatron.core.tensor_parallel.random import RNGTracker  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402
from megatron.core.transformer.layer import TransformerLayer  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402


def counted_bytes(rank: int, args, sequence_parallel: bool) -> dict:
    world = dist.get_world_size()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=8,
        vocab_size=128,
        seq_length=args.seq_length,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=world,
        sequence_parallel=sequence_parallel,
    )
    layer = TransformerLayer(config, tp_group=dist.group.WORLD, rng_tracker=RNGTracker("cpu", 0, tp_rank=rank))
    initialize_parameters(layer, seed=0)
    s = args.seq_length // world if sequence_parallel else args.seq_length
    x = torch.randn(s, args.micro_batch_size, args.hidden_size, requires_grad=True)
    with COMM_STATS.counting() as stats:
        layer(x).sum().backward()
    return dict(stats.bytes)


def measure(world: int, args, sequence_parallel: bool) -> dict:
    return run_distributed(world, counted_bytes, args, sequence_parallel)[0]


def analytic(args, sequence_parallel: bool) -> dict:
    volume = args.seq_length * args.micro_batch_size * args.hidden_size * 4  # fp32 bytes
    if sequence_parallel:
        return {"all_gather": (4 + 2) * volume, "reduce_scatter": 4 * volume}
    return {"all_reduce": 4 * volume}


def ring_bytes(by_kind: dict) -> int:
    return sum(v * (2 if kind == "all_reduce" else 1) for kind, v in by_kind.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    args = parser.parse_args()
    for tp in args.tp:
        if tp < 2 or 8 % tp or args.seq_length % tp or args.hidden_size % 8:
            parser.error(f"--tp {tp}: need 2, 4 or 8 dividing --seq-length and the 8 heads")
    print(f"per layer per microbatch, s={args.seq_length} b={args.micro_batch_size} h={args.hidden_size}, fp32")
    print(f"{'tp':>3} {'SP':>3} {'collective':>15} {'counted bytes':>14} {'analytic bytes':>15} {'ratio':>7}")
    exact = True
    for tp in args.tp:
        for sp in (False, True):
            counted, expected = measure(tp, args, sp), analytic(args, sp)
            rows = sorted(set(counted) | set(expected)) + ["ring total"]
            for kind in rows:
                c = ring_bytes(counted) if kind == "ring total" else counted.get(kind, 0)
                e = ring_bytes(expected) if kind == "ring total" else expected.get(kind, 0)
                exact &= c == e
                print(
                    f"{tp:>3} {'yes' if sp else 'no':>3} {kind:>15} {c:>14,} {e:>15,} "
                    f"{c / e if e else float('nan'):>7.3f}"
                )
    print("counted volume equals the analytic volume" if exact else "MISMATCH between counted and analytic volume")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
