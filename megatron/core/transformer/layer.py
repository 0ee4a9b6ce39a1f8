"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)); on MoE layers the MLP is an MoE layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fp8.model import attach_fp8
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norm import Norm


def hidden_dropout(x, p: float, training: bool, rng_tracker, sequence_parallel: bool):
    """Dropout on the residual stream. Under sequence parallelism each tp rank holds a
    different sequence shard, so it draws from the tensor-parallel stream."""
    if p == 0.0 or not training:
        return x
    with rng_tracker.fork(tensor_parallel=sequence_parallel):
        return F.dropout(x, p, training=True)


class TransformerLayer(torch.nn.Module):
    def __init__(self, config, *, tp_group, rng_tracker, cp_group=None, layer_index=0, expert_groups=None, device=None):
        super().__init__()
        self.config = config
        self.rng_tracker = rng_tracker
        self.input_layernorm = Norm(config, config.hidden_size, device)
        self.self_attention = SelfAttention(
            config, tp_group=tp_group, rng_tracker=rng_tracker, cp_group=cp_group, device=device
        )
        self.pre_mlp_layernorm = Norm(config, config.hidden_size, device)
        if config.is_moe_layer(layer_index):
            self.mlp = MoELayer(config, tp_group=tp_group, groups=expert_groups, device=device)
        else:
            self.mlp = MLP(config, tp_group=tp_group, device=device)
        attach_fp8(self, config, layer_index, tp_group=tp_group, cp_group=cp_group, expert_groups=expert_groups)

    def _dropout(self, x):
        return hidden_dropout(
            x, self.config.hidden_dropout, self.training, self.rng_tracker, self.config.sequence_parallel
        )

    def forward(self, x, rotary_angles=None, attention_mask=None):
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rotary_angles, attention_mask))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))
