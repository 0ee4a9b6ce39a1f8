"""The routed experts of one rank, two ways that compute the same thing from the same initial values.

- `SequentialExperts` (the reference, and the default): megatron-core's SequentialMLP, one MLP per local expert run
  one after the other, named by global expert index (`local_experts.<e>`, the same names in every expert-parallel
  layout, so initial values and checkpoints do not depend on the layout).
- `GroupedExperts` (`--moe-grouped-gemm`): megatron-core's GroupedMLP, each linear one [local experts, out, in]
  weight run by one grouped GEMM over all local experts (grouped_gemm.py). Its weights are initialised and stored
  as the loop's per-expert tensors (InitSpec.experts), so either kind loads the other's checkpoints.

Each expert's weights may be split over the expert-tensor-parallel ranks (fc1 by rows, fc2 by columns) with no
collective here: the token dispatcher has gathered the inputs and reduces the partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.swiglu import swiglu
from megatron.core.tensor_parallel.initialization import InitSpec, ShardSpec, make_param
from megatron.core.tensor_parallel.layers import linear
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.grouped_gemm import fallback_reason, grouped_linear, looped_linear, offsets_of


def _shapes(config, etp_size: int, etp_rank: int) -> dict:
    """Full per-expert shape and shard of fc1 ([gate; up] rows with SwiGLU) and fc2, and their init std."""
    h, f = config.hidden_size, config.moe_ffn_hidden_size
    stacked = 2 if config.swiglu else 1
    return {
        "linear_fc1": ((stacked * f, h), ShardSpec(0, etp_size, etp_rank, stacked), config.init_method_std),
        "linear_fc2": ((h, f), ShardSpec(1, etp_size, etp_rank), config.output_layer_init_std),
    }


def _local_shape(full_shape: tuple, shard: ShardSpec) -> list[int]:
    shape = list(full_shape)
    shape[shard.dim] //= shard.num_shards
    return shape


def _activate(h: torch.Tensor, config, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SwiGLU (on its kernel's path, kernels/dispatch.py) or GELU of fc1's output, scaled by each row's routing
    weight (megatron-core's `per_token_scale` between the activation and fc2)."""
    if config.swiglu:
        h = swiglu(h, impl=config.kernel_paths(h.device.type).swiglu.impl)
    else:
        h = F.gelu(h)
    return (h * probs.unsqueeze(-1)).to(dtype)


class ExpertLinear(torch.nn.Module):
    def __init__(self, full_shape: tuple, shard: ShardSpec, std: float, config, device):
        super().__init__()
        self.fp8 = None  # FP8 GEMMs (megatron/core/fp8/model.py)
        spec = InitSpec(full_shape, std=std, shard=shard)
        self.weight = make_param(
            tuple(_local_shape(full_shape, shard)), spec, config.params_dtype, device, is_expert=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A module call (not a bare matmul), so the sharding strategies' hooks gather the weight around it.
        In FP8 the weight gradient goes through autograd (not straight into main_grad)."""
        if self.fp8 is None:
            return F.linear(x, self.weight)
        return linear(x, self.weight, None, owned=False, fp8=self.fp8)


class ExpertMLP(torch.nn.Module):
    """fc1 -> activation (SwiGLU or GELU) -> scaled by the routing weight -> fc2, as megatron-core's expert MLP
    applies `per_token_scale` between the activation and fc2."""

    def __init__(self, config, *, etp_size: int, etp_rank: int, device=None):
        super().__init__()
        self.config = config
        shapes = _shapes(config, etp_size, etp_rank)
        self.linear_fc1 = ExpertLinear(*shapes["linear_fc1"], config, device)
        self.linear_fc2 = ExpertLinear(*shapes["linear_fc2"], config, device)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        h = _activate(self.linear_fc1(tokens), self.config, probs, tokens.dtype)
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


def _row_lengths(config, etp: int) -> dict[str, int]:
    """The row lengths of the grouped GEMMs' operands, by the flags that set them."""
    return {
        "--hidden-size": config.hidden_size,
        f"--moe-ffn-hidden-size / expert-tensor-parallel size ({etp})": config.moe_ffn_hidden_size // etp,
    }


def grouped_fallback_reason(config, etp: int, device_type: str) -> str | None:
    """Why this config's grouped experts, split over `etp` expert-tensor-parallel ranks, run one GEMM per expert
    over their grouped weights on `device_type` (None: the grouped GEMM takes them)."""
    return fallback_reason(config.params_dtype, _row_lengths(config, etp), device_type)


class _GroupedWeight(torch.nn.Module):
    """One linear of all local experts: `weight` [local experts, out, in]; a module call (not a bare matmul), so
    the sharding strategies' hooks gather the weight around it."""

    def __init__(self, full_shape: tuple, shard: ShardSpec, std: float, experts: tuple, config, device):
        super().__init__()
        spec = InitSpec(full_shape, std=std, shard=shard, experts=experts)
        shape = (len(experts), *_local_shape(full_shape, shard))
        self.weight = make_param(shape, spec, config.params_dtype, device, is_expert=True)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | None, counts, mask_tail: bool) -> torch.Tensor:
        if offsets is not None:
            return grouped_linear(x, self.weight, offsets, mask_tail, None if mask_tail else counts)
        return looped_linear(x, self.weight, counts)


class GroupedExperts(torch.nn.Module):
    """The experts `local_ids` (global indices) of this expert-parallel rank as grouped weights
    (`linear_fc1.weight`, `linear_fc2.weight`), run by the grouped GEMM or, where it cannot take the shapes
    (`grouped_fallback_reason`), by one GEMM per expert over the same weights."""

    def __init__(self, config, local_ids: range, *, etp_size: int = 1, etp_rank: int = 0, device=None):
        super().__init__()
        self.local_ids, self.config = local_ids, config
        self.row_lengths = _row_lengths(config, etp_size)
        experts, shapes = tuple(local_ids), _shapes(config, etp_size, etp_rank)
        self.linear_fc1 = _GroupedWeight(*shapes["linear_fc1"], experts, config, device)
        self.linear_fc2 = _GroupedWeight(*shapes["linear_fc2"], experts, config, device)

    def runs_grouped(self, tokens: torch.Tensor) -> bool:
        """Whether the grouped GEMM takes these tokens on their device."""
        return fallback_reason(tokens.dtype, self.row_lengths, tokens.device.type) is None

    def forward(self, tokens: torch.Tensor, tokens_per_expert, probs: torch.Tensor) -> torch.Tensor:
        """tokens [n, h] grouped by local expert in order, `tokens_per_expert[i]` rows each (a host list, or a
        device tensor, when rows past the routed ones may follow: their outputs are zero); probs [n]."""
        on_device = isinstance(tokens_per_expert, torch.Tensor)
        grouped = self.runs_grouped(tokens)
        offsets = offsets_of(tokens_per_expert, tokens.device) if grouped else None
        counts = tokens_per_expert
        if on_device and not grouped:  # the loop takes host counts: a sync, counted
            counts = token_dispatcher.host_counts(tokens_per_expert.view(1, -1))[0]
        h = self.linear_fc1(tokens, offsets, counts, on_device)
        return self.linear_fc2(_activate(h, self.config, probs, tokens.dtype), offsets, counts, on_device)
