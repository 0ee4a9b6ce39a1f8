"""Validation and test loss, printed as Megatron prints it, and when the training loop runs them.

Evaluation pass k (0-based) reads global batches [k E, (k + 1) E) of its split, E =
--eval-iters, so the data position is a pure function of the pass; the loss is the mean
over every unmasked token of those batches, in every layout the same.
"""

from __future__ import annotations

import math

import torch

from megatron.core.pipeline_parallel.executor import global_token_mean


def evaluate(trainer, split: str, evaluation_index: int) -> float:
    """Mean lm loss over --eval-iters global batches of `split` ('valid' or 'test')."""
    iters = trainer.run.evaluation.iters
    for chunk in trainer.chunks:
        chunk.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=trainer.device)
    try:
        for batch_index in range(evaluation_index * iters, (evaluation_index + 1) * iters):
            stats = trainer.forward_only.run(trainer.loaders[split].batch_fn(batch_index))
            totals += stats.token_sums()
    finally:
        for chunk in trainer.chunks:
            chunk.train()
    return global_token_mean(totals)[0]


def evaluation_lines(where: str, loss: float) -> list[str]:
    """Megatron's three lines: a rule, `validation loss at <where> | lm loss value: ... | lm loss PPL: ... |`,
    a rule."""
    text = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]


class Validation:
    """Validation passes of the training loop: every --eval-interval iterations, then after the
    last one on the validation split and once on the test split, as Megatron does."""

    def __init__(self, trainer, emit, log):
        self.trainer, self.emit, self.log = trainer, emit, log
        self.passes = 0

    def _report(self, where: str, split: str, index: int, iteration: int) -> None:
        loss = evaluate(self.trainer, split, index)
        for line in evaluation_lines(where, loss):
            self.emit(line)
        self.log.validation(iteration, loss)

    def run(self, iteration: int) -> None:
        if self.trainer.run.evaluation.iters and "valid" in self.trainer.loaders:
            self._report(f"iteration {iteration}", "valid", self.passes, iteration)
            self.passes += 1

    def at_end(self, iteration: int) -> None:
        if not self.trainer.run.evaluation.iters:
            return
        if "valid" in self.trainer.loaders:
            self._report(f"iteration {iteration} on validation set", "valid", self.passes, iteration)
        if "test" in self.trainer.loaders:
            self._report(f"iteration {iteration} on test set", "test", 0, iteration)
