"""Feed-forward block: GELU MLP or SwiGLU (kernels/swiglu.py, the fc1 bias added inside), split across tp ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.swiglu import swiglu
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(torch.nn.Module):
    """fc1 (column-parallel) -> activation -> fc2 (row-parallel).

    With SwiGLU, fc1 stacks [gate; up] rows; both halves are split the same way so
    every rank holds matching gate and up columns of the intermediate activation.
    """

    def __init__(self, config, *, tp_group, device=None):
        super().__init__()
        self.config = config
        self.swiglu = config.swiglu
        common = dict(
            tp_group=tp_group,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            dtype=config.params_dtype,
            device=device,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        )
        stacked = 2 if config.swiglu else 1
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            stacked * config.ffn_hidden_size,
            init_std=config.init_method_std,
            stacked=stacked,
            **common,
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, init_std=config.output_layer_init_std, **common
        )

    def forward(self, x):
        if self.swiglu:
            impl = self.config.kernel_paths(x.device.type).swiglu.impl
            h = swiglu(self.linear_fc1(x, add_bias=False), self.linear_fc1.bias, impl=impl)
        else:
            h = F.gelu(self.linear_fc1(x))
        return self.linear_fc2(h)
