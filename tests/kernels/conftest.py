"""Kernel-test fixtures: outputs poisoned with NaN (unwritten elements fail), a fresh seed per test."""

import pytest
import torch

from kernels import triton_support


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    monkeypatch.setattr(
        triton_support,
        "empty",
        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device),
    )


@pytest.fixture
def seed():
    return torch.seed()  # a fresh seed, reported on failure
