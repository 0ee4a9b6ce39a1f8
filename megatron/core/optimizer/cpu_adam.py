"""The CPU AdamW step of one offloaded shard: torch's fused CPU kernel over the shard's runs.

torch's `_fused_adamw_` (vectorised, parallel over OpenMP threads, one pass over the four
fp32 arrays: 28 bytes of traffic per element) is the default because it measured faster
than anything we wrote (`tools/bench/cpu_adam.py` keeps that honest). It takes one learning
rate and one weight decay per call, so a shard is cut once, at construction, into maximal
runs of elements that share (weight decay?, decoupled learning rate?) — padding steps with
neither, like `adamw.ShardedAdamW` — and each class of runs is one call.

`rounding` other than "fused" steps each run with `adam_rounding.step_as` instead: the
arithmetic of ShardedAdamW's ops as that device ("cpu", "cuda") rounds them, so that an
offloaded shard's masters equal those of the same shard stepped on the device, bit for bit
(slower: several passes over the shard, see tools/bench/cpu_adam.py).
"""

from __future__ import annotations

import os

import torch

from megatron.core.optimizer.adam_rounding import ROUNDINGS, step_as


def element_classes(numel: int, decay: list, decoupled: list) -> list[tuple[int, int, bool, bool]]:
    """Maximal runs (start, end, decays, decoupled) covering [0, numel)."""
    cuts = sorted({0, numel} | {x for r in list(decay) + list(decoupled) for x in r})
    runs: list[tuple[int, int, bool, bool]] = []
    for start, end in zip(cuts, cuts[1:]):
        key = (any(a <= start < b for a, b in decay), any(a <= start < b for a, b in decoupled))
        if runs and runs[-1][2:] == key and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, *key)
        elif end > start:
            runs.append((start, end, *key))
    return runs


class CpuAdamW:
    """AdamW for one shard whose four arrays live in host memory (`tensors`: main, grad, m, v)."""

    def __init__(
        self,
        main: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        decay: list,
        decoupled: list,
        rounding: str = "fused",
    ):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
        self.rounding = rounding
        self.groups: dict[tuple[bool, bool], list[list[torch.Tensor]]] = {}
        for start, end, decays, is_decoupled in element_classes(main.numel(), decay, decoupled):
            lists = self.groups.setdefault((decays, is_decoupled), [[], [], [], []])
            for out, tensor in zip(lists, (main, grad, exp_avg, exp_avg_sq)):
                out.append(tensor[start:end])

    @torch.no_grad()
    def step(
        self,
        step: int,
        lr: float,
        decoupled_lr: float | None,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        steps = torch.tensor(float(step))
        by_add = decoupled_lr is not None and any(key[1] for key in self.groups)  # ShardedAdamW's decoupled path
        for (decays, is_decoupled), (params, grads, exp_avgs, exp_avg_sqs) in self.groups.items():
            rate = decoupled_lr if is_decoupled and decoupled_lr is not None else lr
            if self.rounding != "fused":
                for run in zip(params, grads, exp_avgs, exp_avg_sqs):
                    step_as(
                        self.rounding, *run, step=step, lr=rate, betas=betas, eps=eps,
                        weight_decay=weight_decay if decays else 0.0, by_add=by_add,
                    )  # fmt: skip
                continue
            torch._fused_adamw_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                [steps] * len(params),
                lr=rate,
                beta1=betas[0],
                beta2=betas[1],
                weight_decay=weight_decay if decays else 0.0,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )


def default_cpu_threads() -> int:
    """The cores this process may run on, shared evenly by the ranks of this node (torchrun's
    LOCAL_WORLD_SIZE): each rank's CPU step then owns its cores instead of oversubscribing them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
