"""The routed experts of one rank: one MLP per local expert, run one after the other on its tokens.

Megatron's SequentialMLP, named by global expert index (`local_experts.<e>`, the same names in every expert-parallel
layout, so initial values and checkpoints do not depend on the layout). `--moe-grouped-gemm` runs this same loop
(no grouped GEMM kernel is built here; the start-up log says so). Each expert's weights may be split over the
expert-tensor-parallel ranks (fc1 by rows, fc2 by columns) with no collective here: the token dispatcher has
gathered the inputs and reduces the partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.swiglu import swiglu
from megatron.core.tensor_parallel.initialization import InitSpec, ShardSpec, make_param


class _ExpertLinear(torch.nn.Module):
    def __init__(self, full_shape: tuple, shard: ShardSpec, std: float, config, device):
        super().__init__()
        shape = list(full_shape)
        shape[shard.dim] //= shard.num_shards
        self.weight = make_param(
            tuple(shape), InitSpec(full_shape, std=std, shard=shard), config.params_dtype, device, is_expert=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A module call (not a bare matmul), so the sharding strategies' hooks gather the weight around it."""
        return F.linear(x, self.weight)


class ExpertMLP(torch.nn.Module):
    """fc1 -> activation (SwiGLU or GELU) -> scaled by the routing weight -> fc2, as megatron-core's expert MLP
    applies `per_token_scale` between the activation and fc2."""

    def __init__(self, config, *, etp_size: int, etp_rank: int, device=None):
        super().__init__()
        self.config = config
        self.swiglu = config.swiglu
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        stacked = 2 if config.swiglu else 1
        self.linear_fc1 = _ExpertLinear(
            (stacked * f, h), ShardSpec(0, etp_size, etp_rank, stacked), config.init_method_std, config, device
        )
        self.linear_fc2 = _ExpertLinear(
            (h, f), ShardSpec(1, etp_size, etp_rank), config.output_layer_init_std, config, device
        )

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(tokens)
        if self.swiglu:
            h = swiglu(h, impl=self.config.kernel_paths(h.device.type).swiglu.impl)
        else:
            h = F.gelu(h)
        h = (h * probs.unsqueeze(-1)).to(tokens.dtype)
        return self.linear_fc2(h)


class SequentialExperts(torch.nn.Module):
    """The experts `local_ids` (global indices) of this expert-parallel rank."""

    def __init__(self, config, local_ids: range, *, etp_size: int = 1, etp_rank: int = 0, device=None):
        super().__init__()
        self.local_ids = local_ids
        self.local_experts = torch.nn.ModuleDict(
            {str(e): ExpertMLP(config, etp_size=etp_size, etp_rank=etp_rank, device=device) for e in local_ids}
        )

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor) -> torch.Tensor:
        """tokens [n, h] grouped by local expert in order, `tokens_per_expert[i]` rows each; probs [n]."""
        pieces = zip(self.local_experts.values(), tokens.split(tokens_per_expert), probs.split(tokens_per_expert))
        return torch.cat([expert(x, p) for expert, x, p in pieces], dim=0)
