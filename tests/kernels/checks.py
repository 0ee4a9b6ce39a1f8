"""Tolerances and the closeness check shared by the kernel tests."""

from __future__ import annotations

import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(name, actual, expected, tol, seed):
    """Max abs error relative to the largest reference value; NaN never passes."""
    err = ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e} (seed {seed})"
