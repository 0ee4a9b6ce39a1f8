"""Megatron's learning-rate schedule, counted in samples.

Megatron's scheduler counts *steps in samples*: it starts at 0 and advances by the global
batch size after every successful update (an fp16 iteration skipped for inf/nan gradients
does not advance it). So the first update trains with the value at step 0 (`init_lr` when
there is a warm-up), and iteration-based flags are converted once: warm-up and decay
iterations x global batch size. Keeping one unit lets sample-based flags
(`--lr-warmup-samples`, `--lr-decay-samples`, `--lr-wsd-decay-samples`) and iteration-based
ones share a single formula, and a batch-size ramp-up moves the schedule by what was
actually consumed.

lr(n) for n samples consumed by successful updates, W warm-up, D decay steps:
- n <= W (W > 0):          init + (max - init) n / W
- constant:                max
- n > D:                   min
- inverse-square-root:     max(min, max sqrt(max(W, 1)) / sqrt(max(n, 1)))
- otherwise r = (n - W) / (D - W), lr = min + c (max - min) with
  linear c = 1 - r;  cosine c = (1 + cos(pi r)) / 2;
  WSD c = 1 until the last A = wsd-decay steps before D, then with q = (n - (D - A)) / A:
  linear 1 - q, cosine (1 + cos(pi q)) / 2, exponential 2 * 0.5^q - 1, minus_sqrt 1 - sqrt(q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    style: str
    warmup_steps: float
    decay_steps: float
    init_lr: float = 0.0
    wsd_decay_steps: float | None = None
    wsd_style: str = "exponential"

    def __post_init__(self):
        if self.style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {self.style!r}")
        if self.wsd_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}, got {self.wsd_style!r}"
            )
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.max_lr})")
        if not 0.0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"need 0 <= --lr-warmup-init ({self.init_lr}) <= --lr ({self.max_lr})")
        if self.warmup_steps < 0:
            raise ValueError(
                f"the warm-up must be >= 0 (--lr-warmup-iters/-samples/-fraction), got {self.warmup_steps} samples"
            )
        if self.decay_steps <= 0 or self.warmup_steps >= self.decay_steps:
            raise ValueError(
                f"the decay ({self.decay_steps} samples, --lr-decay-iters/-samples, default the "
                f"training length) must exceed the warm-up ({self.warmup_steps} samples)"
            )
        if self.style == "WSD" and not self.wsd_decay_steps:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")

    def __call__(self, steps: float) -> float:
        """The learning rate after `steps` samples consumed by successful updates."""
        if self.warmup_steps > 0 and steps <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * steps / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if steps > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(steps, 1)))
        ratio = (steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coefficient(steps)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd_coefficient(self, steps: float) -> float:
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if steps <= anneal_start:
            return 1.0
        q = (steps - anneal_start) / self.wsd_decay_steps
        return {
            "linear": 1.0 - q,
            "cosine": 0.5 * (math.cos(math.pi * q) + 1.0),
            "exponential": 2.0 * 0.5**q - 1.0,
            "minus_sqrt": 1.0 - math.sqrt(q),
        }[self.wsd_style]

    def with_peak(self, max_lr: float, min_lr: float) -> LRSchedule:
        """The same timing with another peak and floor (Megatron's --decoupled-lr / --decoupled-min-lr
        for the embedding and output layer; warm-up starts from the same init_lr)."""
        return LRSchedule(
            max_lr=max_lr,
            min_lr=min_lr,
            style=self.style,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            init_lr=self.init_lr,
            wsd_decay_steps=self.wsd_decay_steps,
            wsd_style=self.wsd_style,
        )
