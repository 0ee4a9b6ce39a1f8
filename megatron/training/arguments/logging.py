"""Megatron's logging and profiling flags -> LoggingConfig. Nothing else reads these flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple = field(default=(0,))


def add_logging_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--log-params-norm", action="store_true", help="add the parameters' global norm to the log line")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="add the number of zero gradients")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="iteration time to TensorBoard/W&B")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="memory figures to TensorBoard/W&B")
    g.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="validation perplexity to TensorBoard/W&B (when validation runs)",
    )
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", help="log the scalars to Weights & Biases (needs the wandb package)")
    g.add_argument("--wandb-exp-name", help="W&B run name")
    g.add_argument("--wandb-save-dir", help="W&B files directory (default <tensorboard-dir>/wandb or ./wandb)")
    g.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler trace of iterations [--profile-step-start, --profile-step-end)",
    )
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="global ranks that profile")
    return parser


def logging_config_from_args(args) -> LoggingConfig:
    if args.log_interval < 1:
        raise ValueError(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(
            f"need 0 <= --profile-step-start ({args.profile_step_start}) < --profile-step-end ({args.profile_step_end})"
        )
    if (args.wandb_exp_name or args.wandb_save_dir) and not args.wandb_project:
        raise ValueError("--wandb-exp-name / --wandb-save-dir need --wandb-project")
    names = [f.name for f in LoggingConfig.__dataclass_fields__.values()]
    values = {name: getattr(args, name) for name in names}
    return LoggingConfig(**{**values, "profile_ranks": tuple(args.profile_ranks)})
