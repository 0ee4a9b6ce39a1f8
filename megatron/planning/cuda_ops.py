"""What the CUDA versions of torch's device-dependent ops save, for a trace on a CPU-only machine.

The estimate of a CUDA run traces our modules with fake CPU tensors (torch built without CUDA
cannot even make fake CUDA tensors). Our own kernels then take their CUDA path: the traced
config names the paths `kernels.dispatch.kernel_paths` chooses on CUDA (trace.py); the few
torch ops whose CUDA kernels save other tensors than their CPU ones are swapped here, for the
duration of the trace, for the CUDA kernel's autograd signature (what it saves, in which dtype
and shape), following `KernelChoice` (kernels.py):

- `F.dropout`: CUDA's fused dropout saves a bool mask (CPU: a noise tensor of the input dtype);
  torch's own `native_dropout` is that op;
- `F.rms_norm`: CUDA runs `_fused_rms_norm`, which saves x, the fp32 rstd [rows] and the
  weight (CPU: the composite, which also keeps the normalised x);
- `F.scaled_dot_product_attention`: "flash" keeps q, k, v, the output and the fp32 log-sum-exp,
  as the CPU flash kernel does (run without dropout: the CUDA kernel regenerates its mask
  from a seed); "efficient" the same with the log-sum-exp padded to a multiple of 32;
  "math" is torch's composite computed in the input dtype with a bool dropout mask: q and k
  scaled, the probabilities, the mask, the dropped probabilities and v (a copy under GQA).
These are NOT validated on a GPU yet (no GPU here), as the CUDA allowances are not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _FusedRMSNorm(torch.autograd.Function):
    """Shape-only `_fused_rms_norm`: saves x, rstd [rows] (fp32) and the weight."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


class _EfficientAttention(torch.autograd.Function):
    """Shape-only memory-efficient SDPA: saves q, k, v, its output and the fp32 log-sum-exp
    [b, h, s] padded to a multiple of 32 (its seed and offset are host scalars)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-2] + (math.ceil(q.shape[-2] / 32) * 32,), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's composite SDPA as the CUDA build runs it: in the input dtype, bool dropout mask."""
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    scores = (q * factor) @ (k.transpose(-2, -1) * factor)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None:  # added as a bias (saves nothing), as torch converts a boolean mask
        scores = scores + torch.zeros(attn_mask.shape, dtype=scores.dtype).masked_fill(~attn_mask, float("-inf"))
    probs = torch.softmax(scores, -1)
    if dropout_p > 0.0:
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return probs @ v


class CudaOps(TorchFunctionMode):
    """Within: dropout, RMSNorm and SDPA save what their CUDA kernels save (module docstring).
    `attention`: the SDPA kernel CUDA picks for this model ("flash", "efficient" or "math")."""

    def __init__(self, attention: str):
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.rms_norm:
            return self._rms_norm(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, True)[0] if training and p > 0.0 else x

    @staticmethod
    def _rms_norm(x, normalized_shape, weight=None, eps=None):
        return _FusedRMSNorm.apply(x, weight, eps)

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self.attention == "math":
            return _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if self.attention == "efficient":
            return _EfficientAttention.apply(q, k, v)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
