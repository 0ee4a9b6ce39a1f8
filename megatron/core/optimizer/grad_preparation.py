"""The optimizer's first part: gradient preparation on this rank's flat shards.

Unscale and inf/nan check (fp16), the global L2 norm of the whole model's gradients, and
clipping by it. Every rank works on the gradients it will step (its shards) and one
collective over the world combines them, so the replicated and the distributed optimizer
share this code: they differ only in how many ranks hold each element (`replicas`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def unscale_and_check(grads: list, scale: float) -> bool:
    """Divide the gradients by the loss scale; True when any rank saw inf/nan.
    One fused pass and one synchronisation, whatever the number of shards."""
    device = grads[0].device if grads else None
    found_inf = torch.zeros(1, device=device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 1.0 / scale, device=device))
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item())


def global_grad_norm(counted: list, replicas: int) -> float:
    """sqrt of the sum of squared gradients of the whole model.

    `counted`: this rank's gradient pieces that count (each parameter counted by exactly one
    rank of its tp group and pipeline copies; see `counts_in_grad_norm`). The sum runs over
    the world; when `replicas` ranks (dp x cp, replicated optimizer) hold the same pieces, the
    world sum is divided by their number.
    """
    device = counted[0].device if counted else None
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    if counted:
        squares += torch.stack(torch._foreach_norm(counted)).double().pow(2).sum()
    dist.all_reduce(squares)
    return math.sqrt(squares.item() / replicas)


def clip_grads(grads: list, grad_norm: float, max_norm: float) -> None:
    """Scale all gradients by max_norm / norm when the norm exceeds max_norm."""
    coefficient = max_norm / (grad_norm + 1e-6)
    if coefficient < 1.0:
        torch._foreach_mul_(grads, coefficient)
