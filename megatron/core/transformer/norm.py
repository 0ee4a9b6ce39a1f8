"""LayerNorm / RMSNorm modules; the math runs in the fused Triton kernel or the torch reference
(`--normalization-impl`, see kernels/normalization.py)."""
from __future__ import annotations

import torch

from kernels.normalization import layer_norm, rms_norm
from megatron.core.tensor_parallel.sharding import InitSpec, make_param


class Norm(torch.nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight). Under sequence parallelism its
    weights see only a sequence shard, so their gradients are summed across tp
    (`param.sequence_parallel`)."""

    def __init__(self, config, hidden_size: int, device=None):
        super().__init__()
        self.kind, self.eps, self.impl = config.normalization, config.norm_epsilon, config.normalization_impl
        attrs = {"sequence_parallel": config.sequence_parallel}
        self.weight = make_param((hidden_size,), InitSpec((hidden_size,), kind="ones"), config.params_dtype,
                                 device, **attrs)
        self.bias = None
        if self.kind == "LayerNorm":
            self.bias = make_param((hidden_size,), InitSpec((hidden_size,), kind="zeros"), config.params_dtype,
                                   device, **attrs)

    def forward(self, x):
        if self.kind == "RMSNorm":
            return rms_norm(x, self.weight, self.eps, impl=self.impl)
        return layer_norm(x, self.weight, self.bias, self.eps, impl=self.impl)
