"""Rotary position embeddings (RoPE) as in Megatron and Hugging Face Llama.

Options (Megatron's flags): only the first `rotary_dim` channels of each head rotate
(--rotary-percent; the rest pass unchanged); channels pair as halves (d_i with d_{i+D/2},
the default) or as neighbours (d_{2i} with d_{2i+1}, --rotary-interleaved); frequencies may
be rescaled the Llama-3.1 way (--rope-scaling). The rotation itself, fused or not, is kernels/rope.py.
"""

from __future__ import annotations

import math

import torch

# Llama-3.1's constants for frequency scaling (Megatron uses the same, only the factor is a flag)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama-3.1 scaling: wavelengths shorter than context/high_freq_factor stay, longer than
    context/low_freq_factor are divided by `factor`, and those between blend linearly in
    context/wavelength."""
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelength = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelength - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > low_wavelength, inv_freq / factor, blended)
    return torch.where(wavelength < high_wavelength, inv_freq, out)


def rotary_frequencies(
    seq_length: int,
    rotary_dim: int,
    base: float,
    device=None,
    *,
    interleaved: bool = False,
    scaling_factor: float | None = None,
) -> torch.Tensor:
    """Angles [s, 1, 1, rotary_dim] for positions 0..s-1 (fp32); `scaling_factor`: Llama-3.1 scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    if scaling_factor is not None:
        inv_freq = llama3_scaled(inv_freq, scaling_factor)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat([angles, angles], dim=-1)
    return angles[:, None, None, :]
