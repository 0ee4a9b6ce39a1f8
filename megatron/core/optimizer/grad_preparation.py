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

from megatron.core.distributed.host_memory import by_device


def unscale_and_check(grads: list, scale: float, device: torch.device) -> bool:
    """Divide the gradients by the loss scale; True when any rank saw inf/nan.
    One fused pass per device and one synchronisation, whatever the number of shards."""
    found_inf = torch.zeros(1, device=device)
    for where, group in by_device(grads).items():
        found = torch.zeros(1, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.full((1,), 1.0 / scale, device=where))
        found_inf = torch.maximum(found_inf, found.to(device))
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item())


def global_grad_norm(counted: dict[int, list], device: torch.device) -> float:
    """sqrt of the sum of squared gradients of the whole model.

    `counted`: this rank's gradient pieces that count (each parameter counted by exactly one
    rank of its tp group and pipeline copies; see `counts_in_grad_norm`), keyed by how many ranks
    hold and count the same pieces (dp x cp with the replicated optimizer, the expert-data-parallel
    replicas for expert weights, 1 for sharded ones). Each key's sum over the world is divided by it.
    """
    keys = sorted(counted)
    squares = torch.zeros(len(keys), dtype=torch.float64, device=device)
    for i, key in enumerate(keys):
        for group in by_device(counted[key]).values():
            squares[i] += torch.stack(torch._foreach_norm(group)).double().pow(2).sum().to(device)
    dist.all_reduce(squares)
    return math.sqrt(sum(value / key for value, key in zip(squares.tolist(), keys)))


def clip_grads(grads: list, grad_norm: float, max_norm: float) -> None:
    """Scale all gradients by max_norm / norm when the norm exceeds max_norm."""
    coefficient = max_norm / (grad_norm + 1e-6)
    if coefficient < 1.0:
        for group in by_device(grads).values():
            torch._foreach_mul_(group, coefficient)
