"""LayerNorm / RMSNorm modules; the math is dispatched to a fused kernel or torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.sharding import InitSpec, make_param


def normalize(x, weight, bias, eps: float, kind: str, impl: str):
    """Normalise over the last dimension with the chosen implementation."""
    if kind == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


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
        return normalize(x, self.weight, self.bias, self.eps, self.kind, self.impl)
