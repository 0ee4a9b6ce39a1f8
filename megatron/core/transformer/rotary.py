"""Rotary position embeddings (RoPE), rotate-half convention as in Megatron and Hugging Face Llama."""
from __future__ import annotations

import torch


def rotary_frequencies(seq_length: int, head_dim: int, base: float, device=None) -> torch.Tensor:
    """Angles [s, 1, 1, d] for positions 0..s-1 (fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    positions = torch.arange(seq_length, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, h, d] by angles [s, 1, 1, d]; computed in fp32, returned in x's dtype."""
    xf = x.float()
    out = xf * angles.cos() + _rotate_half(xf) * angles.sin()
    return out.to(x.dtype)
