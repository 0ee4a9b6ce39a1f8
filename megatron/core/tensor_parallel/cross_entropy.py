"""Cross-entropy over logits split by vocabulary across tp ranks, never gathering them.

As in Megatron, the softmax spans every column, the vocabulary padding included (rows of the
output layer that are initialised and trained like the others), so the loss depends on the padded
vocabulary size, which Megatron makes a multiple of --make-vocab-size-divisible-by x tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # The three reductions here move s*b scalars each: not part of the per-layer volume.
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        logits_max = all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        exp_logits = (logits - logits_max.unsqueeze(-1)).exp_()

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - logits_max
        target_logit = all_reduce(target_logit.masked_fill(outside, 0.0), group)

        sum_exp = all_reduce(exp_logits.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Per-token loss (fp32, shape of `target`) from this rank's logit columns
    [vocab_start, vocab_start + logits.shape[-1]) of the padded vocabulary."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
