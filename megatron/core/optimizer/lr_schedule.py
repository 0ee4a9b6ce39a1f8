"""Learning rate per iteration: linear warm-up, then constant, linear or cosine decay to min_lr.

Iteration i (1-based) trains with lr(i):
- i <= warmup:      lr * i / warmup
- constant:         lr
- i >= decay_iters: min_lr
- otherwise, with r = (i - warmup) / (decay_iters - warmup):
  linear: min_lr + (lr - min_lr) * (1 - r);  cosine: min_lr + (lr - min_lr) * (1 + cos(pi r)) / 2
"""
from __future__ import annotations

import math


def learning_rate(iteration: int, *, lr: float, min_lr: float, style: str, warmup_iters: int,
                  decay_iters: int) -> float:
    if warmup_iters > 0 and iteration <= warmup_iters:
        return lr * iteration / warmup_iters
    if style == "constant":
        return lr
    if iteration >= decay_iters:
        return min_lr
    ratio = (iteration - warmup_iters) / (decay_iters - warmup_iters)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown lr decay style {style!r}")
    return min_lr + coeff * (lr - min_lr)
