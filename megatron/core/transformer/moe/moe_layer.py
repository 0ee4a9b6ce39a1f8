"""The MoE layer that replaces the dense MLP on MoE layers: route, dispatch, run the local experts, combine,
and add the shared expert (megatron-core's MoELayer)."""

from __future__ import annotations

import torch

from megatron.core.parallel_state import ExpertGroups
from megatron.core.transformer.moe.experts import GroupedExperts, SequentialExperts
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher


class MoELayer(torch.nn.Module):
    def __init__(self, config, *, tp_group, groups: ExpertGroups | None = None, device=None):
        super().__init__()
        groups = groups or ExpertGroups()
        self.config = config
        ep_size, ep_rank = groups.ep_size_rank
        per_rank = config.num_moe_experts // ep_size
        local_ids = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        etp_size, etp_rank = groups.etp_size_rank
        self.router = TopKRouter(config, tp_cp_group=groups.tp_cp, device=device)
        experts = GroupedExperts if config.moe_grouped_gemm else SequentialExperts
        self.experts = experts(config, local_ids, etp_size=etp_size, etp_rank=etp_rank, device=device)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, tp_group=tp_group, device=device)
        if config.moe_token_dispatcher_type == "allgather":
            self.dispatcher = AllGatherDispatcher(local_ids, config, groups.tp_ep, sync_free=config.moe_grouped_gemm)
        else:
            self.dispatcher = AllToAllDispatcher(local_ids, config, groups.ep, groups.etp, groups.tp_ep)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] (a sequence shard under sequence parallelism) -> the same shape."""
        shared = self.shared_experts(hidden) if self.shared_experts is not None else None
        probs, routing_map = self.router(hidden)
        rows, tokens_per_expert, row_probs, handle = self.dispatcher.dispatch(hidden, probs, routing_map)
        out = self.dispatcher.combine(self.experts(rows, tokens_per_expert, row_probs), handle, probs.dtype)
        return out if shared is None else out + shared
