"""Global L2 norm of gradients across all model-parallel ranks, and clipping by it."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def global_grad_norm(params: list, mesh) -> float:
    """sqrt of the sum of squared gradients of the whole model.

    Each parameter with `counts_in_norm` contributes once. The sum runs over the
    world; every dp x cp replica holds the same (already averaged) gradients, so
    the world sum is divided by the number of replicas.
    """
    device = params[0].device if params else None
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    grads = [p.grad for p in params if p.counts_in_norm]
    if grads:
        norms = torch._foreach_norm(grads)
        squares += torch.stack(norms).double().pow(2).sum()
    dist.all_reduce(squares)
    replicas = mesh.dp_size * mesh.cp_size
    return math.sqrt(squares.item() / replicas)


def clip_grads(params: list, grad_norm: float, max_norm: float) -> None:
    """Scale all gradients by max_norm / norm when the norm exceeds max_norm."""
    coefficient = max_norm / (grad_norm + 1e-6)
    if coefficient < 1.0:
        torch._foreach_mul_([p.grad for p in params], coefficient)
