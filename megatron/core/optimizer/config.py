"""OptimizerConfig: AdamW, clipping and mixed precision settings (the learning-rate schedule is
`lr_schedule.LRSchedule`; `lr` here is only the value the optimizer starts with)."""

from __future__ import annotations

from dataclasses import dataclass, field

OFFLOAD_POLICIES = ("static", "auto")


@dataclass
class OffloadConfig:
    """The offload optimizer and host-resident chunks (see offload.py and
    distributed/placement.py). With the static policy, `fraction` of the shard's elements keep
    their optimizer state on host, `grad_fraction` their gradient shard too and `param_fraction`
    their parameter shard too (each part needs the one before it on host, so the fractions nest);
    auto decides all three. `cpu_threads` None: the default (cpu_adam.default_cpu_threads on
    CUDA, the process's threads where host = device)."""

    enabled: bool = False
    fraction: float = 1.0
    policy: str = "static"
    cpu_threads: int | None = None
    grad_fraction: float = 0.0
    param_fraction: float = 0.0

    def __post_init__(self):
        for flag, value in (
            ("--optimizer-offload-fraction", self.fraction),
            ("--grad-offload-fraction", self.grad_fraction),
            ("--param-offload-fraction", self.param_fraction),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{flag} must be in [0, 1], got {value}")
        if not self.param_fraction <= self.grad_fraction <= self.fraction:
            raise ValueError(
                f"need --param-offload-fraction ({self.param_fraction:g}) <= --grad-offload-fraction "
                f"({self.grad_fraction:g}) <= --optimizer-offload-fraction ({self.fraction:g}): a chunk's "
                f"parameters live on host only with its gradient, its gradient only with its optimizer state"
            )
        if self.policy not in OFFLOAD_POLICIES:
            raise ValueError(f"--offload-policy must be one of {', '.join(OFFLOAD_POLICIES)}, got {self.policy!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-optimizer-threads must be >= 1, got {self.cpu_threads}")


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; choose one")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.min_loss_scale <= 0 or self.initial_loss_scale < self.min_loss_scale:
            raise ValueError("need 0 < --min-loss-scale <= --initial-loss-scale")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError("--loss-scale-window and --hysteresis must be >= 1")
