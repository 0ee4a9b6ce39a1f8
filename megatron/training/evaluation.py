"""Validation and test loss, printed as Megatron prints it.

Evaluation pass k (0-based) reads global batches [k E, (k + 1) E) of its split, E =
--eval-iters, so the data position is a pure function of the pass; the loss is the mean
over every unmasked token of those batches, in every layout the same.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def evaluate(trainer, split: str, evaluation_index: int) -> float:
    """Mean lm loss over --eval-iters global batches of `split` ('valid' or 'test')."""
    iters = trainer.run.evaluation.iters
    for chunk in trainer.chunks:
        chunk.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=trainer.device)
    try:
        for batch_index in range(evaluation_index * iters, (evaluation_index + 1) * iters):
            stats = trainer.forward_only.run(trainer.loaders[split].batch_fn(batch_index))
            totals += torch.stack([stats.loss_sum, stats.tokens, stats.slots])
    finally:
        for chunk in trainer.chunks:
            chunk.train()
    dist.all_reduce(totals)
    return totals[0].item() / totals[1].item() if totals[1].item() else 0.0


def evaluation_lines(where: str, loss: float) -> list[str]:
    """Megatron's three lines: a rule, `validation loss at <where> | lm loss value: ... | lm loss PPL: ... |`, a rule."""
    text = (f" validation loss at {where} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {math.exp(min(20.0, loss)):.6E} | ")
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]
