"""The reductions of a vocab-parallel cross-entropy over one chunk of logits, in Triton, with torch references.

The fused LM head + cross-entropy (megatron/core/tensor_parallel/fused_cross_entropy.py) computes
the logits of a few tokens at a time with one GEMM and hands each chunk [tokens, local vocab] here:

* `logit_statistics`: per token, the maximum of this rank's logits, the sum of exp(logit - max)
  and the target's logit (0 where the target is another rank's column), all fp32. The Triton
  kernel reads the chunk once in its own dtype (one program per token, an online log-sum-exp over
  vocabulary blocks); the reference makes an fp32 copy.
* `logit_gradient`: d loss / d logits = (softmax - one-hot(target)) * grad_loss, softmax from the
  log-sum-exp of the token's whole (all ranks') row, in the logits' dtype. Both paths may write it
  over the chunk: the Triton kernel always does (one program per token and vocabulary block), the
  reference does where it can (an fp32 chunk; else it rounds its fp32 copy back into the chunk).

`target` holds global vocabulary ids; `vocab_start` is this rank's first column.
"""

import torch

from . import triton_support
from .triton_support import jit, tl

BLOCK_V = 1024  # vocabulary columns per step; not yet tuned on a GPU


# ----------------------------------------------------------------------------- Triton kernels
@jit
def _statistics_kernel(LOGITS, TARGET, MAX, SUM_EXP, TARGET_LOGIT, n_cols, stride, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    target = tl.load(TARGET + row) - vocab_start
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
    row_max = tl.max(x, 0)
    sum_exp = tl.sum(tl.exp(x - row_max), 0)
    target_logit = tl.sum(tl.where(mask & (cols == target), x, 0.0), 0)
    for start in range(BLOCK, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        row_max = new_max
        target_logit += tl.sum(tl.where(mask & (cols == target), x, 0.0), 0)
    tl.store(MAX + row, row_max)
    tl.store(SUM_EXP + row, sum_exp)
    tl.store(TARGET_LOGIT + row, target_logit)


@jit
def _gradient_kernel(LOGITS, TARGET, LSE, GRAD_LOSS, n_cols, stride, vocab_start, BLOCK: tl.constexpr):
    """Overwrites LOGITS with (exp(logit - lse) - one-hot) * grad_loss, rounded to its dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = LOGITS + row * stride + cols
    x = tl.load(offs, mask=mask, other=0.0).to(tl.float32)
    target = tl.load(TARGET + row) - vocab_start
    softmax = tl.exp(x - tl.load(LSE + row))
    grad = (softmax - tl.where(cols == target, 1.0, 0.0)) * tl.load(GRAD_LOSS + row)
    tl.store(offs, grad.to(LOGITS.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- torch references
def _local_target(target, vocab_start, n_cols):
    """(target as a column of this chunk, clamped into range; whether it is one of this rank's)."""
    local = target - vocab_start
    inside = (local >= 0) & (local < n_cols)
    return local.clamp(0, n_cols - 1), inside


def logit_statistics_torch(logits, target, vocab_start):
    """(max, sum of exp(logit - max), target logit or 0), each [tokens] fp32, from an fp32 copy."""
    work = logits.float()
    row_max = work.max(dim=-1).values
    local, inside = _local_target(target, vocab_start, work.shape[-1])
    target_logit = work.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    shifted = work.sub_(row_max.unsqueeze(-1)) if work is not logits else work - row_max.unsqueeze(-1)
    return row_max, shifted.exp_().sum(dim=-1), target_logit


def logit_gradient_torch(logits, target, vocab_start, lse, grad_loss):
    """(softmax - one-hot) * grad_loss in the logits' dtype, written over `logits`."""
    work = logits.float()
    local, inside = _local_target(target, vocab_start, work.shape[-1])
    work.sub_(lse.unsqueeze(-1)).exp_()
    work.scatter_add_(-1, local.unsqueeze(-1), -inside.to(work.dtype).unsqueeze(-1))
    work.mul_(grad_loss.unsqueeze(-1))
    return work if work is logits else logits.copy_(work)


# ----------------------------------------------------------------------------- host side
def unsupported_reason(dtype):
    """Why the Triton kernels cannot take logits of `dtype`, or None if they can (any vocabulary size)."""
    if dtype not in triton_support.TRITON_DTYPES:
        return f"cross-entropy Triton kernels support fp16, bf16 and fp32 logits, got {dtype}"
    return None


def _check(logits, target):
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [tokens, vocab] and target [tokens], got {tuple(logits.shape)} and {tuple(target.shape)}"
        )


def _block(n_cols):
    return min(BLOCK_V, max(16, 1 << (n_cols - 1).bit_length()))


def _statistics(logits, target, vocab_start):
    """The Triton path of `logit_statistics` (rows of unit stride)."""
    tokens, n_cols = logits.shape
    out = [triton_support.empty((tokens,), torch.float32, logits.device) for _ in range(3)]
    if not triton_support.shape_only(logits) and tokens:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _statistics_kernel[(tokens,)](
            logits, target.contiguous(), *out, n_cols, logits.stride(0), vocab_start, BLOCK=_block(n_cols)
        )
    return tuple(out)


def _gradient(logits, target, vocab_start, lse, grad_loss):
    """The Triton path of `logit_gradient`: writes over `logits` (contiguous)."""
    tokens, n_cols = logits.shape
    if not triton_support.shape_only(logits) and tokens:
        block = _block(n_cols)
        _gradient_kernel[(tokens, triton_support.triton.cdiv(n_cols, block))](
            logits,
            target.contiguous(),
            lse.contiguous(),
            grad_loss.float().contiguous(),
            n_cols,
            logits.stride(0),
            vocab_start,
            BLOCK=block,
        )
    return logits


def logit_statistics(logits, target, vocab_start, impl="auto"):
    """(max, sum of exp(logit - max), target logit or 0) of each row of this rank's logits [tokens, vocab]."""
    _check(logits, target)
    if triton_support.use_triton(impl, logits, unsupported_reason(logits.dtype)):
        return _statistics(logits, target, vocab_start)
    return logit_statistics_torch(logits, target, vocab_start)


def logit_gradient(logits, target, vocab_start, lse, grad_loss, impl="auto"):
    """(softmax - one-hot(target)) * grad_loss [tokens, vocab] in the logits' dtype, written over `logits`
    (contiguous); `lse` [tokens] fp32 is the log-sum-exp of each token's whole row, over every rank."""
    _check(logits, target)
    if not logits.is_contiguous():
        raise ValueError("logit_gradient writes over its logits: they must be contiguous")
    if triton_support.use_triton(impl, logits, unsupported_reason(logits.dtype)):
        return _gradient(logits, target, vocab_start, lse, grad_loss)
    return logit_gradient_torch(logits, target, vocab_start, lse, grad_loss)
