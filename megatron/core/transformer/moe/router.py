"""The top-k router of an MoE layer (megatron-core's TopKRouter): gating weights, routing, capacity, the
auxiliary losses attached to the backward pass, and the aux-loss-free expert bias with its update."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.initialization import InitSpec, make_param
from megatron.core.transformer.moe import routing
from megatron.core.transformer.moe.aux_losses import attach_aux_loss, routers

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _replaying() -> bool:
    """Inside backward: activation recomputation rerunning the forward. Logged losses and expert-bias counts
    are taken once per microbatch, in the forward (recomputation keeps that forward's autograd graph)."""
    return torch._C._current_autograd_node() is not None


class TopKRouter(torch.nn.Module):
    """logits = x W^T ([tokens, experts]) -> (probs, routing_map).

    `tp_cp_group`: the ranks whose tokens together make this rank's sequences (sequence-parallel tp shards,
    cp chunks); the load-balancing loss counts routes over them, as Megatron does.
    """

    def __init__(self, config, *, tp_cp_group=None, device=None):
        super().__init__()
        self.config = config
        self.tp_cp_group = tp_cp_group
        shape = (config.num_moe_experts, config.hidden_size)
        self.weight = make_param(
            shape,
            InitSpec(shape, std=config.init_method_std),
            config.params_dtype,
            device,
            sequence_parallel=config.sequence_parallel,
        )
        self.tracked_losses: dict[str, torch.Tensor] = {}  # logged sums of this iteration (aux_losses.py)
        self.register_buffer("aux_loss_scale", torch.ones((), device=device), persistent=False)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, device=device))
            self.expert_bias.init_spec = InitSpec((config.num_moe_experts,), kind="zeros")  # saved in checkpoints
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(config.num_moe_experts, device=device), persistent=False
            )
        else:
            self.expert_bias = self.local_tokens_per_expert = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [s, b, h] -> probs [s*b, experts] (zero where not routed) and the boolean routing map."""
        c = self.config
        dtype = ROUTER_DTYPES[c.moe_router_dtype] or x.dtype
        seq_length, batch = x.shape[:2]
        logits = F.linear(x.to(dtype), self.weight.to(dtype)).view(-1, c.num_moe_experts)
        training = self.training and torch.is_grad_enabled()
        if training and c.moe_z_loss_coeff is not None:
            logits = self._z_loss(logits)
        probs, routing_map = routing.topk_routing(
            logits,
            c.moe_router_topk,
            score_function=c.moe_router_score_function,
            pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = routing.drop_over_capacity(
                probs,
                routing_map,
                c.moe_router_topk,
                c.moe_expert_capacity_factor,
                c.moe_token_drop_policy,
                c.moe_pad_expert_input_to_capacity,
            )
        if training and c.moe_aux_loss_coeff > 0 and c.moe_router_load_balancing_type != "none":
            probs = self._load_balancing_loss(probs, logits, seq_length, batch)
        if training and self.local_tokens_per_expert is not None and not _replaying():
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _track(self, name: str, value: torch.Tensor) -> None:
        if not _replaying():
            self.tracked_losses[name] = self.tracked_losses.get(name, 0.0) + value.detach()

    def _z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff / _size(self.tp_cp_group)
        loss = routing.z_loss(logits, coeff)
        self._track("z_loss", loss / coeff)
        return attach_aux_loss(logits, loss, self.aux_loss_scale)

    def _load_balancing_loss(self, probs, logits, seq_length: int, batch: int) -> torch.Tensor:
        """Megatron's aux_loss over this microbatch's tokens, or seq_aux_loss per sequence averaged over the batch
        (the batch folded into the expert dimension)."""
        c = self.config
        routing_map, scores = routing.aux_loss_scores(logits, c.moe_router_topk, c.moe_router_score_function)
        per_sequence = c.moe_router_load_balancing_type == "seq_aux_loss"
        if per_sequence:
            routing_map, scores = routing_map.reshape(seq_length, -1), scores.reshape(seq_length, -1)
        tokens_per_expert = routing_map.sum(dim=0).to(scores.dtype)
        if _size(self.tp_cp_group) > 1:
            dist.all_reduce(tokens_per_expert, group=self.tp_cp_group)
        total_tokens = routing_map.shape[0] * _size(self.tp_cp_group)
        loss = routing.switch_load_balancing_loss(
            scores, tokens_per_expert, total_tokens, c.moe_router_topk, c.num_moe_experts, c.moe_aux_loss_coeff
        )
        if per_sequence:
            loss = loss / batch
        self._track("seq_load_balancing_loss" if per_sequence else "load_balancing_loss", loss / c.moe_aux_loss_coeff)
        return attach_aux_loss(probs, loss, self.aux_loss_scale)


@torch.no_grad()
def update_expert_biases(modules, group, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), as Megatron does once per iteration: each bias moves by `rate`
    towards balance, sign(mean count - count), the counts of this iteration summed over `group` (every rank
    that routes tokens: tp x dp x cp); then the counts restart."""
    found = [r for r in routers(modules) if r.expert_bias is not None]
    if not found:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in found])
    if _size(group) > 1:
        dist.all_reduce(counts, group=group)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for router, step in zip(found, torch.sign(offset) * rate):
        router.expert_bias += step
        router.local_tokens_per_expert.zero_()
