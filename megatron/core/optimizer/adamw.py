"""The optimizer's state and step: AdamW over a list of flat fp32 shards.

Each shard gets its own exp_avg / exp_avg_sq, allocated where the shard's master weights
live, and is stepped on its own, so the placement of each shard's state (device or pinned
host, stepped by a CPU AdamW) can change per shard without touching the other two parts of
the optimizer. The arithmetic is torch.optim.AdamW's single-tensor path, element for element
(decoupled weight decay first, applied only to the shard ranges whose parameters take it).
With `decoupled_lr` set, the embedding and output layer ranges step with that learning rate
(Megatron's --decoupled-lr). Offloaded shards (`shard.offloaded`) get their moments from
`host_memory` and are stepped by `offload` (offload.OffloadedSteps), started first so that the
CPU works while the device steps the rest.
"""

from __future__ import annotations

import math

import torch


class ShardedAdamW:
    def __init__(
        self, shards: list, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, host_memory=None
    ):
        self.shards = shards
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.decoupled_lr = None  # learning rate of each shard's `decoupled` ranges (embedding, output layer)
        self.step_count = 0
        self.offload = None  # offload.OffloadedSteps when some shards are offloaded
        self.host_memory = host_memory  # distributed.host_memory.HostMemory: the host slab

        def zeros(shard):
            return host_memory.zeros(shard.main.numel()) if shard.offloaded else torch.zeros_like(shard.main)

        self.exp_avg = [zeros(s) for s in shards]
        self.exp_avg_sq = [zeros(s) for s in shards]

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors that exist only for the optimizer: master copies (not the fp32 weights
        themselves) and the moments."""
        masters = [s.main for s in self.shards if not s.aliased]
        return masters + self.exp_avg + self.exp_avg_sq

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        beta1, beta2 = self.betas
        step_size = self.lr / (1 - beta1**self.step_count)
        decoupled_step_size = (self.decoupled_lr or 0.0) / (1 - beta1**self.step_count)
        bias_correction2_sqrt = math.sqrt(1 - beta2**self.step_count)
        if self.offload is not None:
            self.offload.start()
        for shard, exp_avg, exp_avg_sq in zip(self.shards, self.exp_avg, self.exp_avg_sq):
            if shard.offloaded:
                continue
            decoupled = shard.decoupled if self.decoupled_lr is not None else []
            decayed = shard.views(shard.main, [r for r in shard.decay if r not in decoupled])
            if decayed and self.weight_decay:
                torch._foreach_mul_(decayed, 1 - self.lr * self.weight_decay)
            if self.weight_decay:
                for start, end in (r for r in decoupled if r in shard.decay):
                    shard.main[start:end].mul_(1 - self.decoupled_lr * self.weight_decay)
            exp_avg.lerp_(shard.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(shard.grad, shard.grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            if not decoupled:
                shard.main.addcdiv_(exp_avg, denom, value=-step_size)
                continue
            update = exp_avg / denom
            for start, end in decoupled:  # these ranges step with their own learning rate
                shard.main[start:end].add_(update[start:end], alpha=-decoupled_step_size)
                update[start:end].zero_()
            shard.main.add_(update, alpha=-step_size)
