"""LayerNorm / RMSNorm modules; the math runs in the fused Triton kernel or the torch reference
(`--normalization-impl`; the path is kernels/dispatch.py `kernel_paths`)."""

from __future__ import annotations

import torch

from kernels.normalization import layer_norm, rms_norm
from megatron.core.tensor_parallel.initialization import InitSpec, make_param


class Norm(torch.nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight). Under sequence parallelism its
    weights see only a sequence shard, so their gradients are summed across tp
    (`param.sequence_parallel`); `sum_grads_over_tp` asks for the same where each tp rank
    normalises different heads with shared weights (--qk-layernorm). With
    --apply-layernorm-1p the weight starts at 0 and the norm scales by (1 + weight), so
    weight decay pulls the scale towards 1 rather than 0."""

    def __init__(self, config, hidden_size: int, device=None, sum_grads_over_tp: bool = False):
        super().__init__()
        self.config, self.kind, self.eps = config, config.normalization, config.norm_epsilon
        self.zero_centered = config.layernorm_zero_centered_gamma
        attrs = {"sequence_parallel": config.sequence_parallel or sum_grads_over_tp}
        scale_init = "zeros" if self.zero_centered else "ones"
        self.weight = make_param(
            (hidden_size,), InitSpec((hidden_size,), kind=scale_init), config.params_dtype, device, **attrs
        )
        self.bias = None
        if self.kind == "LayerNorm":
            self.bias = make_param(
                (hidden_size,), InitSpec((hidden_size,), kind="zeros"), config.params_dtype, device, **attrs
            )

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered else self.weight
        impl = self.config.kernel_paths(x.device.type, norm_width=x.shape[-1]).norm.impl
        if self.kind == "RMSNorm":
            return rms_norm(x, weight, self.eps, impl=impl)
        return layer_norm(x, weight, self.bias, self.eps, impl=impl)
