"""Megatron's offload-optimizer flags (and ours: the policy and the CPU step's threads) -> OffloadConfig."""
from __future__ import annotations

import argparse

from megatron.core.optimizer.config import OFFLOAD_POLICIES, OffloadConfig
from megatron.training.parallel_args import sharding_strategy_from_args


def add_offload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("offload optimizer")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep the distributed optimizer's fp32 master weights and Adam moments of some chunks in "
                        "(pinned) host memory and step them on the CPU, hidden behind the next forward")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="static policy: share of the optimizer state's elements on host, in [0, 1] (default 1)")
    g.add_argument("--offload-policy", choices=OFFLOAD_POLICIES, default="static",
                   help="static: --optimizer-offload-fraction; auto: measure the first iteration's peak device "
                        "memory besides model state, keep on the device what fits under --device-memory-gb (or "
                        "the device's capacity), the rest on host")
    g.add_argument("--cpu-optimizer-threads", type=int,
                   help="threads of the CPU AdamW step (default on CUDA: the cores available to the process / "
                        "ranks on the node; where host = device: the process's threads)")
    return parser


def offload_config_from_args(args) -> OffloadConfig:
    strategy = sharding_strategy_from_args(args)
    if args.optimizer_cpu_offload and strategy == "no_shard":
        raise ValueError("--optimizer-cpu-offload needs --use-distributed-optimizer (the offloaded state is each "
                         "rank's shard of it)")
    given = [flag for flag, value in (("--optimizer-offload-fraction", args.optimizer_offload_fraction != 1.0),
                                      ("--offload-policy", args.offload_policy != "static"),
                                      ("--cpu-optimizer-threads", args.cpu_optimizer_threads is not None)) if value]
    if given and not args.optimizer_cpu_offload:
        raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --optimizer-cpu-offload")
    if args.offload_policy == "auto" and args.optimizer_offload_fraction != 1.0:
        raise ValueError("--optimizer-offload-fraction applies to --offload-policy static only; auto decides itself")
    return OffloadConfig(enabled=args.optimizer_cpu_offload, fraction=args.optimizer_offload_fraction,
                         policy=args.offload_policy, cpu_threads=args.cpu_optimizer_threads)
