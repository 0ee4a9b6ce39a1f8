"""The shared expert of an MoE layer: a dense MLP every token passes through, optionally gated (Qwen2-MoE)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.initialization import InitSpec, make_param
from megatron.core.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    """megatron-core's SharedExpertMLP: an MLP of --moe-shared-expert-intermediate-size, tensor- and
    sequence-parallel like the dense MLP; with --moe-shared-expert-gate its output is scaled by sigmoid(x w)."""

    def __init__(self, config, *, tp_group, device=None):
        shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        super().__init__(shared, tp_group=tp_group, device=device)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            shape = (1, config.hidden_size)
            self.gate_weight = make_param(
                shape,
                InitSpec(shape, std=config.init_method_std),
                config.params_dtype,
                device,
                sequence_parallel=config.sequence_parallel,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out
