"""The output layer and the vocab-parallel cross-entropy in one pass over token chunks (--cross-entropy-loss-fusion).

Unfused, the output layer writes a microbatch's logits [s, b, V/tp] and the cross-entropy keeps their
fp32 softmax for backward: 4 V/tp bytes per token (2 GiB per 4096 tokens at Llama-3's vocabulary).
Fused, the tokens go through in chunks and each chunk's gradients are computed in the forward, while
its logits exist (as Liger-Kernel's fused linear cross-entropy does): per chunk one GEMM gives the
logits, kernels/cross_entropy.py reduces them to the max, the sum of exp and the target logit, the
vocab-parallel reductions over tp give the loss and the log-sum-exp, the logits are turned in place
into d loss / d logits, and two GEMMs give the chunk's input gradient and its share of the weight
gradient. Three GEMMs of the head's size, as unfused, and no chunk's logits outlive it.

Gradients in the forward need the loss's weights in the forward: they are the gradients of
sum_i w_i loss_i, w the `loss_mask` (ones when None). The caller's loss must be that sum times any
scalar c (the executor's sum over unmasked tokens, its 1/tokens and loss scale): backward receives
d loss_i = c w_i, checks it (on CUDA without a host sync: a failed check stops the device), and
multiplies the stored gradients by c. Nothing is added into `main_grad` before backward, so a forward
run twice (recomputation) cannot add twice, and the executor's zeroing of the gradient buffers at the
first backward of a step finds nothing of this step there yet.

The softmax spans the padded vocabulary split over tp as in `vocab_parallel_cross_entropy`: each
chunk's maxima (all-reduce, max) and rescaled sums with the target logits (one all-reduce of
[2, chunk]) give its tokens' losses on every rank. Under sequence parallelism the input is a sequence
shard, gathered here once, and the input gradient is reduce-scattered back in the forward (stored as a
shard, the size of the input); without it the caller's region all-reduces it in backward.

The weight gradient is summed over the chunks in the dtype of the weight's fp32 `main_grad` with
gradient accumulation fusion (in the weight's dtype without) and goes where the unfused layers put it:
into `main_grad` when the weight is used once per backward (autograd then gets none, as from
tensor_parallel/layers.py `_Linear`), else (a tied embedding in one stage) to autograd in the weight's dtype. Saved
for backward: the input gradient (the input's size), the weight gradient and w.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.cross_entropy import logit_gradient, logit_statistics
from megatron.core.tensor_parallel.cross_entropy import all_reduce
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_parallel_region, reduce_scatter_sequence
from megatron.core.tensor_parallel.weight_grads import accumulate_in_main_grad_dtype, sequence_input

GEMM_ROWS = 128  # chunks of at least this many tokens are a multiple of it (whole GEMM tiles)
LOGITS_PER_INPUT = 8  # a chunk's logits may hold this many times the elements of the [tokens, h] input
SCALE_RTOL = 1e-4  # how far d loss_i may stray from c w_i (rounding of the caller's scale)


def chunk_tokens(tokens: int, hidden: int, local_vocab: int) -> int:
    """Tokens per chunk: as many as keep one chunk's logits within LOGITS_PER_INPUT times the
    [tokens, hidden] input, at least 1, a multiple of GEMM_ROWS from GEMM_ROWS up. The chunk is the
    inner dimension of the weight-gradient GEMM, whose [V/tp, h] output is read and written once per
    chunk (fp32 with gradient accumulation fusion: chunk/4 FLOPs per byte), so it must be large.
    Llama-3-8B at seq 8192, tp 1: 2048 tokens, 525 MB of bf16 logits per chunk, 4 chunks."""
    rows = max(1, min(tokens, LOGITS_PER_INPUT * tokens * hidden // local_vocab))
    return rows - rows % GEMM_ROWS if rows >= GEMM_ROWS else rows


def _spans(total: int, size: int):
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def _chunk_loss(logits, target, vocab_start, tp_group, impl):
    """(log-sum-exp over the whole vocabulary, loss) of each token of a chunk, fp32, the same on every tp rank."""
    local_max, sum_exp, target_logit = logit_statistics(logits, target, vocab_start, impl)
    global_max = all_reduce(local_max.clone(), tp_group, dist.ReduceOp.MAX)
    sums = torch.stack((sum_exp * (local_max - global_max).exp_(), target_logit))  # rescaled to the global max
    sum_exp, target_logit = all_reduce(sums, tp_group)
    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - (target_logit - global_max)  # as vocab_parallel_cross_entropy rounds it
    return log_sum_exp.add_(global_max), loss


def _add_product(out, a, b):
    """out += a @ b, summed in out's dtype (fp32 out, bf16/fp16 operands: never rounded to theirs)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        accumulate_in_main_grad_dtype(out, a, b)


def _loss_scale(grad_loss, weights):
    """The scalar c of d loss_i = c w_i (0-dim fp32 on the device), checked without reading it on the host."""
    grad_loss = grad_loss.reshape(-1).float()
    scale = (grad_loss * weights).sum() / (weights * weights).sum().clamp_min(torch.finfo(torch.float32).tiny)
    ok = ((grad_loss - scale * weights).abs() <= SCALE_RTOL * scale.abs()).all()
    message = (
        "fused output layer + cross-entropy (--cross-entropy-loss-fusion): the gradient of the per-token "
        "losses must be one scalar times the loss_mask passed to the model's forward"
    )
    if grad_loss.device.type == "cuda":
        torch._assert_async(ok, message)
    elif not ok:
        raise RuntimeError(message)
    return scale


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, weights, tp_group, sp_group, vocab_start, param, grad_dtype, impl, chunk):
        """`weights` [tokens] fp32 (w); `grad_dtype`: dtype of the stored weight gradient, None: no gradients."""
        hidden = sequence_input(x, sp_group).flatten(0, -2)  # [tokens, h], sequence-major as target
        flat_target = target.reshape(-1)
        loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=x.device)
        grads = grad_dtype is not None
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros(weight.shape, dtype=grad_dtype, device=weight.device) if grads else None
        for start, end in _spans(hidden.shape[0], chunk):
            rows, chunk_target = hidden[start:end], flat_target[start:end]
            logits = F.linear(rows, weight)
            log_sum_exp, loss[start:end] = _chunk_loss(logits, chunk_target, vocab_start, tp_group, impl)
            if grads:
                grad_logits = logit_gradient(logits, chunk_target, vocab_start, log_sum_exp, weights[start:end], impl)
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
                _add_product(grad_weight, grad_logits.t(), rows)
            del logits
        if grads:
            grad_x = grad_hidden.view(-1, *x.shape[1:])  # [s, b, h], the whole sequence
            if sp_group is not None:
                grad_x = reduce_scatter_sequence(grad_x, sp_group)
            ctx.save_for_backward(grad_x, grad_weight, weights)
            ctx.param, ctx.weight_dtype = param, weight.dtype
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight, weights = ctx.saved_tensors
        scale = _loss_scale(grad_loss, weights)
        if ctx.param is not None:
            ctx.param.main_grad.addcmul_(grad_weight, scale)
            queue = getattr(ctx.param, "weight_grad_queue", None)  # None: a main_grad outside gradient buffers
            if queue is not None:
                queue.added(ctx.param)
            grad_weight = None
        elif grad_weight.dtype == ctx.weight_dtype:
            grad_weight = grad_weight.mul_(scale)
        else:
            grad_weight = (grad_weight * scale).to(ctx.weight_dtype)
        return grad_x * scale, grad_weight, None, None, None, None, None, None, None, None, None


def fused_output_cross_entropy(
    x,
    weight,
    target,
    *,
    tp_group,
    sequence_parallel=False,
    impl="auto",
    loss_mask=None,
    param=None,
    fuse=False,
    chunk=None,
):
    """Per-token loss [s, b] (fp32) of the output layer `weight` [V/tp, h] (this rank's rows of the
    padded vocabulary) on `x` [s, b, h] ([s/tp, b, h] under sequence parallelism) against `target`
    [s, b] (global ids); `tp_group` None: one rank holds the whole vocabulary. `loss_mask` [s, b]: the
    weights w of the loss that will be backpropagated, sum_i w_i loss_i times a scalar (module
    docstring; None: all ones). `param`: add the weight gradient into `param.main_grad` (else it goes to
    autograd); `fuse`: gradient accumulation fusion, the weight gradient summed over the chunks in the
    dtype of `weight.main_grad` (else in the weight's); `chunk`: tokens per chunk (default `chunk_tokens`)."""
    sp_group = tp_group if sequence_parallel else None
    if sp_group is None:
        x = copy_to_tensor_parallel_region(x, tp_group)
    if chunk is None:
        chunk = chunk_tokens(target.numel(), x.shape[-1], weight.shape[0])
    vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]
    grad_dtype = None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        grad_dtype = weight.main_grad.dtype if fuse else weight.dtype
    if loss_mask is None:
        weights = torch.ones(target.numel(), dtype=torch.float32, device=x.device)
    else:
        weights = loss_mask.reshape(-1).to(torch.float32, copy=True)
    if param is not None:  # its gradient goes into main_grad: autograd gets no node or buffer hook to run for it
        weight = weight.detach()
    return _FusedOutputCrossEntropy.apply(
        x, weight, target, weights, tp_group, sp_group, vocab_start, param, grad_dtype, impl, chunk
    )


class OutputLayer(ColumnParallelLinear):
    """The GPT model's output layer: a column-parallel linear layer over the padded vocabulary which,
    given `target`, returns the per-token cross-entropy ([s, b] fp32) through the fused path instead
    of the logits (`loss_mask` [s, b]: the weights of the loss backpropagated, fused_output_cross_entropy).
    `impl`: the path of kernels/cross_entropy.py (kernels/dispatch.py decides it); `weight_used_once`:
    False for an embedding tied within one stage (its gradient then goes through autograd). Called as
    a module, so that the hooks of sharded buckets see the weight."""

    def forward(self, x, weight=None, target=None, impl="auto", weight_used_once=True, loss_mask=None):
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
            loss_mask=loss_mask,
            param=weight if owned else None,
            fuse=self.gradient_accumulation_fusion and main_grad is not None,
        )
