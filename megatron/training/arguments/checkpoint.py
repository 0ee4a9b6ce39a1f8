"""Megatron's checkpoint and exit flags -> CheckpointConfig. Nothing else reads these flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    async_save: bool = False
    ckpt_format: str = "canonical"  # ours; "torch_dist": Megatron-LM's (see checkpoint/torch_dist.py)
    exit_signal_handler: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", help="directory for checkpoints (iter_NNNNNNN/ + latest_checkpointed_iteration.txt)")
    g.add_argument("--load", help="directory to resume from (its latest checkpoint); an empty directory starts fresh")
    g.add_argument("--save-interval", type=int, help="save every N iterations (and always after the last one)")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load random-number generator states")
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load the model only and start from iteration 0 (no optimizer, RNG or iteration)",
    )
    g.add_argument(
        "--ckpt-format",
        choices=["canonical", "torch_dist", "torch"],
        default="canonical",
        help="format of --save: canonical (ours: layout-independent, with file digests, RNG states and "
        "the data position) or torch_dist (Megatron-LM's, for Megatron-LM to load); --load reads "
        "either",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="copy the state to host memory and write it in the background; the tracker moves once "
        "every rank has written",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM: finish the iteration, save (with --save) and exit 0",
    )
    g.add_argument("--exit-interval", type=int, help="exit (after saving, with --save) at an iteration divisible by N")
    g.add_argument(
        "--exit-duration-in-mins", type=float, help="exit (after saving, with --save) once training has run this long"
    )
    return parser


def checkpoint_notes(config: CheckpointConfig) -> list[str]:
    """Start-up notes on checkpoint flags that are accepted but do nothing in this run."""
    if config.save_interval is not None and not config.save:  # accepted, as Megatron-LM does (smoke tests)
        return [f"> note: --save-interval {config.save_interval} without --save: no checkpoint will be saved"]
    return []


def checkpoint_config_from_args(args) -> CheckpointConfig:
    """Validate the checkpoint flags; every problem is one ValueError line naming the flag."""
    if args.ckpt_format == "torch":
        raise ValueError(
            "--ckpt-format torch (per-rank files bound to one parallel layout) is not supported; "
            "use --ckpt-format canonical or torch_dist (sharded, load into any layout)"
        )
    for flag, value in (
        ("--save-interval", args.save_interval),
        ("--exit-interval", args.exit_interval),
        ("--exit-duration-in-mins", args.exit_duration_in_mins),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.async_save and not args.save:
        raise ValueError("--async-save needs --save (the directory to save into)")
    if args.async_save and args.ckpt_format == "torch_dist":
        raise ValueError("--async-save writes --ckpt-format canonical only; drop one of them")
    return CheckpointConfig(
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng,
        finetune=args.finetune,
        async_save=args.async_save,
        ckpt_format=args.ckpt_format,
        exit_signal_handler=args.exit_signal_handler,
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
    )
