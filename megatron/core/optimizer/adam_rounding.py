"""ShardedAdamW's step computed on host tensors the way a given device's kernels round it.

A device shard steps with torch's single-tensor ops (adamw.ShardedAdamW: decay multiply, lerp,
mul + addcmul, sqrt, division by a Python scalar, add eps, addcdiv); an offloaded shard steps
on the CPU. For the two to give the same fp32 masters bit for bit, the CPU step must round as
the device's kernels do. Read from PyTorch's sources (aten/src/ATen/native/):

- CPU (`rounding="cpu"`): the same torch ops run here; nothing to emulate.
- CUDA (`rounding="cuda"`): three kernels round differently from their CPU twins:
  division by a CPU scalar multiplies by its fp32 reciprocal (cuda/BinaryDivTrueKernel.cu,
  `a * (1.0f / b)`); addcmul and addcdiv are one fused multiply-add, `fma(alpha, b * c, a)` and
  `fma(alpha, b / c, a)` (cuda/DeviceAddCmulCdiv.cuh; older releases wrote `a + alpha * (...)`,
  which nvcc contracts to the same fma under its default --fmad=true); lerp with a weight below
  0.5 is `self + w * (end - self)` (Lerp.h), contracted to `fma(w, end - self, self)`. Here each
  fma is `fma32`: exact (the product in float64, the sum rounded to odd, then once to fp32).
- torch's fused CPU AdamW (`rounding="fused"`, cpu/FusedAdamKernel.cpp, what cpu_adam.CpuAdamW
  runs by default, the fastest) matches neither: it divides `(-step_size * m) / denom` where
  the single-tensor path multiplies `-step_size * (m / denom)`, and its second moment is
  `v * beta2 + ((1 - beta2) * g) * g` where the single-tensor path rounds `v * beta2` first.

Only the CPU half of this is checked here (tests/unit/test_adam_rounding.py: "cpu" against
ShardedAdamW on CPU, fma32 against exact rationals); the CUDA half is what
tools/gpu_check.py's `adam_bits` section measures on a GPU.
"""

from __future__ import annotations

import math

import torch

ROUNDINGS = ("fused", "cpu", "cuda")
HALF_MASK, HALF = (1 << 29) - 1, 1 << 28  # the 29 float64 mantissa bits below fp32's, and their halfway pattern
BLOCK = 1 << 20  # elements per pass of the emulated CUDA step (bounds its float64 temporaries)


def fma32(a: torch.Tensor | float, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to fp32 (IEEE fused multiply-add) for fp32 operands (`a` may be a
    float that fp32 holds exactly). The float64 product of two fp32 values is exact and the float64
    sum carries 29 bits more than fp32, so rounding it to fp32 is the one correct rounding unless
    the sum landed exactly halfway between two fp32 values (normal range); there the sum's own
    rounding error (TwoSum, exact) says which way the exact value lies, and the sum moves one
    float64 step that way before the final rounding."""
    product = torch.as_tensor(a, dtype=torch.float64) * b.double()
    addend = c.double()
    total = product + addend
    result = total.float()
    tie = (total.view(torch.int64) & HALF_MASK) == HALF
    if bool(tie.any()):
        t, p, q = total[tie], product.expand_as(total)[tie], addend[tie]
        back = t - q
        error = (q - (t - back)) + (p - back)
        toward = torch.where(error > 0, torch.inf, -torch.inf).to(t)
        result[tie] = torch.where(error != 0, torch.nextafter(t, toward), t).float()
    return result


def fp32(value: float) -> float:
    """`value` rounded to fp32 (as a kernel's opmath float holds a Python scalar)."""
    return torch.tensor(value, dtype=torch.float32).item()


def step_as(
    rounding: str, main, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay, by_add=False
) -> None:
    """One AdamW step of fp32 host tensors, in place, as ShardedAdamW's ops give it on `rounding`'s
    device ("cpu" or "cuda"): `lr` is this run's learning rate, `weight_decay` 0 where it takes none.
    `by_add`: the shard has --decoupled-lr ranges, where ShardedAdamW adds `m / denom` with an alpha
    instead of addcdiv (on CPU one fma, unlike CPU's addcdiv; on CUDA both are one fma)."""
    beta1, beta2 = betas
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    if weight_decay:
        main.mul_(1 - lr * weight_decay)
    if rounding == "cpu":
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        if by_add:
            main.add_(exp_avg / denom, alpha=-step_size)
        else:
            main.addcdiv_(exp_avg, denom, value=-step_size)
        return
    if rounding != "cuda":
        raise ValueError(f"rounding must be 'cpu' or 'cuda' here, got {rounding!r}")
    weight, alpha, neg_step = fp32(1 - beta1), fp32(1 - beta2), fp32(-step_size)
    reciprocal = (torch.tensor(1.0) / torch.tensor(bias_correction2_sqrt, dtype=torch.float32)).item()
    for start in range(0, main.numel(), BLOCK):
        p, g = main[start : start + BLOCK], grad[start : start + BLOCK]
        m, v = exp_avg[start : start + BLOCK], exp_avg_sq[start : start + BLOCK]
        m.copy_(fma32(weight, g - m, m))
        v.mul_(beta2)
        v.copy_(fma32(alpha, g * g, v))
        denom = v.sqrt().mul_(reciprocal).add_(eps)
        p.copy_(fma32(neg_step, m / denom, p))
