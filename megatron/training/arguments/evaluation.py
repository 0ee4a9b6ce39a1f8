"""Megatron's evaluation flags -> EvalConfig. Nothing else reads these flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalConfig:
    """Validation every `interval` iterations (and after the last one) on `iters` global batches."""

    interval: int = 1000
    iters: int = 100
    skip_train: bool = False

    def evaluations(self, train_iters: int) -> int:
        """How many validation passes a run of `train_iters` iterations makes (Megatron's count:
        one per interval plus one at the end), which sizes the validation split."""
        return train_iters // self.interval + 1 if self.iters else 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=1000, help="validate every N iterations")
    g.add_argument("--eval-iters", type=int, default=100, help="global batches per validation (0: none)")
    g.add_argument("--skip-train", action="store_true", help="only evaluate (e.g. a loaded checkpoint)")
    return parser


def eval_config_from_args(args) -> EvalConfig:
    if args.eval_interval < 1:
        raise ValueError(f"--eval-interval must be >= 1, got {args.eval_interval}")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    return EvalConfig(interval=args.eval_interval, iters=args.eval_iters, skip_train=args.skip_train)
