"""The output layer and the vocab-parallel cross-entropy in one pass over token chunks (--cross-entropy-loss-fusion).

Unfused, the output layer writes a microbatch's logits [s, b, V/tp] and the cross-entropy keeps their
fp32 softmax for backward: 4 V/tp bytes per token (2 GiB per 4096 tokens at Llama-3's vocabulary).
Fused, the tokens go through in chunks: each chunk's logits are one GEMM, reduced at once
(kernels/cross_entropy.py: max, sum of exp, target logit) and dropped; backward recomputes them chunk
by chunk and turns each into its share of the input and weight gradients. What stays for backward
is the layer's input and two numbers per token (the log-sum-exp in fp32 and the target id).

The softmax spans the padded vocabulary split over tp as in `vocab_parallel_cross_entropy`:
each rank combines its chunks' maxima and sums locally, then one all-reduce (max) and one of the
[2, tokens] rescaled sums and target logits give every token's loss. Under sequence parallelism the
input is a sequence shard, gathered here before the GEMMs (and again in backward: only the shard is
kept) and its gradient reduce-scattered back; without it the caller's region all-reduces it.

The weight gradient goes where the unfused layers put it: added chunk by chunk into the weight's
fp32 `main_grad` (one addmm each with gradient accumulation fusion) when the weight has one and is
used once per backward (tensor_parallel/layers.py `_Linear`'s placeholder protocol), else summed
over the chunks in the weight's dtype and returned to autograd (a tied embedding in one stage).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.cross_entropy import logit_gradient, logit_statistics
from megatron.core.tensor_parallel.cross_entropy import all_reduce
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_parallel_region, reduce_scatter_sequence
from megatron.core.tensor_parallel.weight_grads import WeightGrad, sequence_input

GEMM_ROWS = 128  # chunks of at least this many tokens are a multiple of it (whole GEMM tiles)


def chunk_tokens(tokens: int, hidden: int, local_vocab: int) -> int:
    """Tokens per chunk: as many as keep one chunk's logits no larger than the [tokens, hidden] input
    (so the head's working memory is of the size of its input), at least 1, a multiple of GEMM_ROWS
    from GEMM_ROWS up. Llama-3-8B at seq 8192, tp 1: 256 tokens, 66 MB of bf16 logits per chunk."""
    rows = max(1, min(tokens, tokens * hidden // local_vocab))
    return rows - rows % GEMM_ROWS if rows >= GEMM_ROWS else rows


def _spans(total: int, size: int):
    return [(start, min(start + size, total)) for start in range(0, total, size)]


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, tp_group, sp_group, vocab_start, param, fuse, impl, chunk):
        hidden = sequence_input(x, sp_group).flatten(0, -2)  # [tokens, h], sequence-major as target
        flat_target = target.reshape(-1)
        stats = torch.empty((3, hidden.shape[0]), dtype=torch.float32, device=x.device)  # max, sum exp, target
        for start, end in _spans(hidden.shape[0], chunk):
            logits = F.linear(hidden[start:end], weight)
            for row, value in zip(stats, logit_statistics(logits, flat_target[start:end], vocab_start, impl)):
                row[start:end] = value
            del logits
        local_max, sums = stats[0], stats[1:]
        global_max = all_reduce(local_max.clone(), tp_group, dist.ReduceOp.MAX)
        sums[0].mul_((local_max - global_max).exp_())  # each rank's sum of exp(logit - its max), rescaled
        sum_exp, target_logit = all_reduce(sums, tp_group)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - (target_logit - global_max)  # as vocab_parallel_cross_entropy rounds it
        ctx.save_for_backward(x, weight, flat_target, log_sum_exp.add_(global_max))  # the log-sum-exp
        ctx.sp_group, ctx.vocab_start, ctx.param, ctx.fuse, ctx.impl, ctx.chunk = (
            sp_group,
            vocab_start,
            param,
            fuse,
            impl,
            chunk,
        )
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target, lse = ctx.saved_tensors
        hidden = sequence_input(x, ctx.sp_group).flatten(0, -2)
        grad_loss = grad_loss.reshape(-1)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        for start, end in _spans(hidden.shape[0], ctx.chunk):
            rows = hidden[start:end]
            logits = F.linear(rows, weight)
            grad_logits = logit_gradient(
                logits, target[start:end], ctx.vocab_start, lse[start:end], grad_loss[start:end], ctx.impl
            )
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if ctx.param is not None:
                WeightGrad(ctx.param, grad_logits, rows, None, ctx.fuse).accumulate()
            elif grad_weight is None:
                grad_weight = grad_logits.t().mm(rows)
            else:
                grad_weight.addmm_(grad_logits.t(), rows)
            del logits, grad_logits
        if ctx.param is not None:
            ctx.param.grad_added_to_main_grad = True
            grad_weight = torch.empty_like(weight)  # the placeholder that runs the buffer's hook
        grad_x = grad_hidden.view(-1, *x.shape[1:])  # [s, b, h], the whole sequence
        if ctx.sp_group is not None:
            grad_x = reduce_scatter_sequence(grad_x, ctx.sp_group)
        return grad_x, grad_weight, None, None, None, None, None, None, None, None


def fused_output_cross_entropy(
    x, weight, target, *, tp_group, sequence_parallel=False, impl="auto", param=None, fuse=False, chunk=None
):
    """Per-token loss [s, b] (fp32) of the output layer `weight` [V/tp, h] (this rank's rows of the
    padded vocabulary) on `x` [s, b, h] ([s/tp, b, h] under sequence parallelism) against `target`
    [s, b] (global ids); `tp_group` None: one rank holds the whole vocabulary. `param`/`fuse`: add the
    weight gradient into `param.main_grad` (module docstring); `chunk`: tokens per chunk (default `chunk_tokens`)."""
    sp_group = tp_group if sequence_parallel else None
    if sp_group is None:
        x = copy_to_tensor_parallel_region(x, tp_group)
    if chunk is None:
        chunk = chunk_tokens(target.numel(), x.shape[-1], weight.shape[0])
    vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]
    return _FusedOutputCrossEntropy.apply(x, weight, target, tp_group, sp_group, vocab_start, param, fuse, impl, chunk)


class OutputLayer(ColumnParallelLinear):
    """The GPT model's output layer: a column-parallel linear layer over the padded vocabulary which,
    given `target`, returns the per-token cross-entropy ([s, b] fp32) through the fused path instead
    of the logits. `impl`: the path of kernels/cross_entropy.py (kernels/dispatch.py decides it);
    `weight_used_once`: False for an embedding tied within one stage (its gradient then goes
    through autograd). Called as a module, so that the hooks of sharded buckets see the weight."""

    def forward(self, x, weight=None, target=None, impl="auto", weight_used_once=True):
        if target is None:
            return super().forward(x, weight)
        weight = self.weight if weight is None else weight
        main_grad = getattr(weight, "main_grad", None)
        owned = weight_used_once and main_grad is not None and weight.requires_grad and torch.is_grad_enabled()
        return fused_output_cross_entropy(
            x,
            weight,
            target,
            tp_group=self.tp_group,
            sequence_parallel=self.sequence_parallel,
            impl=impl,
            param=weight if owned else None,
            fuse=owned and self.gradient_accumulation_fusion and main_grad.dtype == weight.dtype,
        )
