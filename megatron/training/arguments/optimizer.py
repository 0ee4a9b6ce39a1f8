"""Megatron's optimizer, learning-rate and precision flags -> OptimizerConfig and LRSchedule.

Iteration-based and sample-based flags follow Megatron's rules: iteration-based training
(--train-iters) takes --lr-warmup-iters / --lr-decay-iters / --lr-wsd-decay-iters, converted
to samples with the global batch size; sample-based training (--train-samples) takes the
-samples flags. --lr-warmup-fraction is a share of the decay length in either case.
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES, LRSchedule

DEFAULT_LR = 1e-4  # Megatron has no default learning rate; ours is noted at start-up when --lr is left out


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    o = parser.add_argument_group("learning rate")
    o.add_argument("--lr", type=float, help=f"peak learning rate (Megatron has no default; ours: {DEFAULT_LR}, noted)")
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear")
    o.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential")
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-warmup-samples", type=int, default=0)
    o.add_argument("--lr-warmup-fraction", type=float, help="warm-up as a share of the decay length")
    o.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of the warm-up")
    o.add_argument("--lr-decay-iters", type=int)
    o.add_argument("--lr-decay-samples", type=int)
    o.add_argument("--lr-wsd-decay-iters", type=int, help="WSD: iterations of the final decay")
    o.add_argument("--lr-wsd-decay-samples", type=int, help="WSD: samples of the final decay")
    o.add_argument("--decoupled-lr", type=float, help="peak learning rate of the embedding and output layer")
    o.add_argument("--decoupled-min-lr", type=float, help="their minimum (default --min-lr)")
    o = parser.add_argument_group("optimizer and precision")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.999)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--bf16", action="store_true")
    o.add_argument("--fp16", action="store_true")
    o.add_argument("--loss-scale", type=float)
    o.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    o.add_argument("--min-loss-scale", type=float, default=1.0)
    o.add_argument("--loss-scale-window", type=int, default=1000)
    o.add_argument("--hysteresis", type=int, default=2)
    return parser


def _refuse_mixed_units(args) -> None:
    """Megatron's rule: the schedule flags use the training length's unit."""
    sample_based = args.train_samples is not None
    wrong = (
        [
            ("--lr-decay-iters", args.lr_decay_iters),
            ("--lr-warmup-iters", args.lr_warmup_iters or None),
            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters),
        ]
        if sample_based
        else [
            ("--lr-decay-samples", args.lr_decay_samples),
            ("--lr-warmup-samples", args.lr_warmup_samples or None),
            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples),
        ]
    )
    given = [flag for flag, value in wrong if value is not None]
    if given:
        unit, other = ("--train-samples", "-samples") if sample_based else ("--train-iters", "-iters")
        raise ValueError(f"{', '.join(given)} cannot be used with {unit}; use the {other} form")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        raise ValueError("give only one of --lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples")


def lr_schedule_from_args(args, training) -> LRSchedule:
    """The schedule in samples (see megatron.core.optimizer.lr_schedule)."""
    _refuse_mixed_units(args)
    gbs = training.global_batch_size
    if args.train_samples is not None:
        decay = args.lr_decay_samples or args.train_samples
        warmup, wsd = args.lr_warmup_samples, args.lr_wsd_decay_samples
    else:
        decay = (args.lr_decay_iters or training.train_iters) * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        warmup = args.lr_warmup_fraction * decay
    return LRSchedule(
        max_lr=DEFAULT_LR if args.lr is None else args.lr,
        min_lr=args.min_lr,
        style=args.lr_decay_style,
        warmup_steps=warmup,
        decay_steps=decay,
        init_lr=args.lr_warmup_init,
        wsd_decay_steps=wsd,
        wsd_style=args.lr_wsd_decay_style,
    )


def decoupled_schedule_from_args(args, schedule: LRSchedule) -> LRSchedule | None:
    """The embedding's and output layer's schedule with --decoupled-lr, else None."""
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            raise ValueError("--decoupled-min-lr needs --decoupled-lr")
        return None
    min_lr = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    if not 0.0 <= min_lr <= args.decoupled_lr:
        raise ValueError(f"need 0 <= --decoupled-min-lr ({min_lr}) <= --decoupled-lr ({args.decoupled_lr})")
    return schedule.with_peak(args.decoupled_lr, min_lr)


def optimizer_config_from_args(args) -> OptimizerConfig:
    return OptimizerConfig(
        lr=DEFAULT_LR if args.lr is None else args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        fp16=args.fp16,
        bf16=args.bf16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
