"""Learning-rate schedule against hand-computed values; loss scaler rules; clipping."""
from __future__ import annotations

import math

import pytest
import torch

from megatron.core.optimizer.clip_grads import clip_grads
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.lr_schedule import learning_rate


def lr(i, style, warmup=2, decay=10):
    return learning_rate(i, lr=1.0, min_lr=0.1, style=style, warmup_iters=warmup, decay_iters=decay)


@pytest.mark.parametrize("iteration,expected", [(1, 0.5), (2, 1.0), (6, 0.55), (10, 0.1), (12, 0.1)])
def test_linear(iteration, expected):
    # after warm-up: 0.1 + 0.9 * (1 - (i - 2) / 8)
    assert lr(iteration, "linear") == pytest.approx(expected)


@pytest.mark.parametrize("iteration,expected", [(1, 0.5), (2, 1.0), (6, 0.55), (4, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2), (10, 0.1)])
def test_cosine(iteration, expected):
    assert lr(iteration, "cosine") == pytest.approx(expected)


def test_constant_after_warmup_and_no_warmup():
    assert [lr(i, "constant") for i in (1, 2, 3, 50)] == [0.5, 1.0, 1.0, 1.0]
    assert lr(1, "linear", warmup=0, decay=4) == pytest.approx(0.1 + 0.9 * 0.75)


def test_dynamic_scaler_hysteresis_backoff_and_growth():
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0  # first overflow is absorbed by hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0  # never below min_scale
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 512.0


def test_clip_grads_scales_to_max_norm():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0])
    clip_grads(params, 5.0, 1.0)
    total = torch.cat([p.grad for p in params]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)
    clip_grads(params, total, 2.0)  # below the threshold: unchanged
    assert torch.cat([p.grad for p in params]).norm().item() == pytest.approx(1.0, rel=1e-5)
