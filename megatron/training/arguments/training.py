"""Megatron's batch and training-length flags -> TrainingConfig. Nothing else reads these flags."""

from __future__ import annotations

import argparse

from megatron.training.batch_schedule import BatchSizeSchedule, parse_step_schedule
from megatron.training.config import TrainingConfig


def add_training_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES samples",
    )
    g.add_argument(
        "--step-batch-size-schedule",
        help="'THRESHOLD:BS ...': batch size BS from THRESHOLD tokens on (K/M/B/T suffixes)",
    )
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int, help="train this many samples (instead of --train-iters)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="torch.use_deterministic_algorithms(True): refuse nondeterministic kernels",
    )
    g.add_argument(
        "--device-memory-gb",
        type=float,
        help="device memory to check the memory estimate against (default: the CUDA device's)",
    )
    g.add_argument(
        "--host-memory-gb",
        type=float,
        help="host memory per rank for offloaded state, checked at start-up (default on CUDA: the "
        "machine's available memory / ranks on the node, LOCAL_WORLD_SIZE; on CPU: not checked)",
    )
    g.add_argument(
        "--skip-memory-check", action="store_true", help="start even when the memory estimate exceeds device memory"
    )
    return parser


def _batch_schedule(args, dp: int) -> BatchSizeSchedule:
    mbs = args.micro_batch_size
    if mbs < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {mbs}")
    if args.rampup_batch_size and args.step_batch_size_schedule:
        raise ValueError("give only one of --rampup-batch-size and --step-batch-size-schedule")
    steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length) if args.step_batch_size_schedule else ()
    gbs = args.global_batch_size
    if steps and gbs is not None and gbs != steps[-1][1]:
        raise ValueError(
            f"--global-batch-size ({gbs}) must equal the last batch size of "
            f"--step-batch-size-schedule ({steps[-1][1]}), or be left out"
        )
    gbs = steps[-1][1] if steps else gbs if gbs is not None else mbs * dp
    schedule = BatchSizeSchedule(
        gbs, rampup=tuple(args.rampup_batch_size) if args.rampup_batch_size else None, steps=steps
    )
    for size in schedule.sizes():
        if size < 1 or size % (mbs * dp):
            flag = "--global-batch-size" if schedule.constant else "every batch size of the schedule, here"
            raise ValueError(
                f"{flag} ({size}) must be a multiple of --micro-batch-size ({mbs}) x "
                f"data-parallel size ({dp}) = {mbs * dp}"
            )
    return schedule


def training_config_from_args(args, dp: int) -> TrainingConfig:
    """One ValueError line naming the flag for anything invalid."""
    schedule = _batch_schedule(args, dp)
    if (args.train_iters is None) == (args.train_samples is None):
        raise ValueError("give exactly one of --train-iters and --train-samples")
    train_iters = args.train_iters if args.train_iters is not None else schedule.iterations_for(args.train_samples)
    for flag, value in (
        ("--train-iters" if args.train_samples is None else "--train-samples (in iterations)", train_iters),
        ("--log-interval", args.log_interval),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--device-memory-gb", args.device_memory_gb), ("--host-memory-gb", args.host_memory_gb)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    gbs = schedule.global_batch_size
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=gbs,
        num_microbatches=gbs // (args.micro_batch_size * dp),
        train_iters=train_iters,
        seed=args.seed,
        log_interval=args.log_interval,
        tensorboard_dir=args.tensorboard_dir,
        device_memory_gb=args.device_memory_gb,
        host_memory_gb=args.host_memory_gb,
        skip_memory_check=args.skip_memory_check,
        batch_schedule=schedule,
        train_samples=args.train_samples,
        deterministic=args.deterministic_mode,
    )
