"""Megatron's offload-optimizer flags (and ours: host-resident gradients and parameters, the policy,
the CPU step's threads) -> OffloadConfig."""

from __future__ import annotations

import argparse

from megatron.core.optimizer.config import OFFLOAD_POLICIES, OffloadConfig
from megatron.training.arguments.parallel import sharding_strategy_from_args


def add_offload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("offload optimizer")
    g.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="keep the distributed optimizer's fp32 master weights and Adam moments of some chunks in "
        "(pinned) host memory and step them on the CPU, hidden behind the next forward",
    )
    g.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="static policy: share of the optimizer state's elements on host, in [0, 1] (default 1)",
    )
    g.add_argument(
        "--grad-offload-fraction",
        type=float,
        default=0.0,
        help="static policy, sharded gradients (optim_grads, optim_grads_params): share of the elements "
        "whose fp32 gradient shard also lives on host, added there each microbatch; at most "
        "--optimizer-offload-fraction (default 0)",
    )
    g.add_argument(
        "--param-offload-fraction",
        type=float,
        default=0.0,
        help="static policy, sharded parameters (optim_grads_params): share of the elements whose "
        "parameter shard also lives on host, copied to the device when its bucket is gathered; at "
        "most --grad-offload-fraction (default 0)",
    )
    g.add_argument(
        "--offload-policy",
        choices=OFFLOAD_POLICIES,
        default="static",
        help="static: the three fractions; auto: place each chunk's parameters, gradients and optimizer "
        "state by the traced memory estimate of this rank, keeping on the device what fits under "
        "--device-memory-gb (or the device's capacity), parameters first, then gradients, then "
        "optimizer state; the rest on host",
    )
    g.add_argument(
        "--cpu-optimizer-threads",
        type=int,
        help="threads of the CPU AdamW step (default on CUDA: the cores available to the process / "
        "ranks on the node; where host = device: the process's threads)",
    )
    return parser


def offload_config_from_args(args) -> OffloadConfig:
    strategy = sharding_strategy_from_args(args)
    if args.optimizer_cpu_offload and strategy == "no_shard":
        raise ValueError(
            "--optimizer-cpu-offload needs --use-distributed-optimizer (the offloaded state is each rank's shard of it)"
        )
    fractions = {
        "--optimizer-offload-fraction": args.optimizer_offload_fraction != 1.0,
        "--grad-offload-fraction": args.grad_offload_fraction != 0.0,
        "--param-offload-fraction": args.param_offload_fraction != 0.0,
    }
    given = [
        flag
        for flag, value in dict(
            fractions,
            **{
                "--offload-policy": args.offload_policy != "static",
                "--cpu-optimizer-threads": args.cpu_optimizer_threads is not None,
            },
        ).items()
        if value
    ]
    if given and not args.optimizer_cpu_offload:
        raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --optimizer-cpu-offload")
    chosen = [flag for flag, value in fractions.items() if value]
    if args.offload_policy == "auto" and chosen:
        raise ValueError(f"{', '.join(chosen)} applies to --offload-policy static only; auto decides itself")
    if args.grad_offload_fraction and strategy not in ("optim_grads", "optim_grads_params"):
        raise ValueError(
            f"--grad-offload-fraction needs sharded gradients (--use-megatron-fsdp "
            f"--data-parallel-sharding-strategy optim_grads or optim_grads_params), not {strategy}"
        )
    if args.param_offload_fraction and strategy != "optim_grads_params":
        raise ValueError(
            f"--param-offload-fraction needs sharded parameters (--use-megatron-fsdp "
            f"--data-parallel-sharding-strategy optim_grads_params), not {strategy}"
        )
    return OffloadConfig(
        enabled=args.optimizer_cpu_offload,
        fraction=args.optimizer_offload_fraction,
        policy=args.offload_policy,
        cpu_threads=args.cpu_optimizer_threads,
        grad_fraction=args.grad_offload_fraction,
        param_fraction=args.param_offload_fraction,
    )
