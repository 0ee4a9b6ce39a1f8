"""Routing as pure functions of the router's logits, after megatron-core's moe_utils: top-k selection by score
function (with group-limited selection and aux-loss-free expert bias), capacity-limited token dropping, and the
auxiliary losses (Switch load balancing, per sequence or per batch, and ST-MoE's z-loss).

Shapes: logits, probs and routing maps are [tokens, experts]; a routing map is boolean. Selections whose values
are not used take detached scores: an autograd node would save its indices only for them to be freed at once.
"""

from __future__ import annotations

import math

import torch


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Keep the `group_topk` expert groups whose top topk/group_topk scores sum highest, then the top-k experts
    among them (DeepSeek's device- or node-limited routing). Returns (values, indices) of the top-k."""
    tokens, experts = scores.shape
    group_scores = scores.detach().view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


def _select(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str,
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map): the weights of each token's top-k experts (zero elsewhere) and where they are.

    softmax: over the selected logits, or over all logits before selection (`pre_softmax`); sigmoid: selected
    by sigmoid + `expert_bias` (the bias steers selection only), weights renormalised over the top-k when k > 1.
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, indices = _select(scores, topk, num_groups, group_topk)
        else:
            selected, indices = _select(logits, topk, num_groups, group_topk)
            probs = torch.softmax(selected, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, indices = _select((scores + expert_bias).detach(), topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=indices).type_as(logits)
        else:
            scores, indices = _select(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    return routing_probs, routing_map


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ceil(tokens / experts x factor), `num_tokens` counting each of a token's k routes."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_over_capacity(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float, policy: str, pad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most its capacity of tokens: those of highest weight (`policy` probs) or the first
    in order (position). `pad`: the map becomes exactly `capacity` tokens per expert (weight 0 for the padding)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranked = probs if policy == "probs" else routing_map.int()
        _, indices = torch.topk(ranked.detach(), k=capacity, dim=0, sorted=False)
        keep = torch.zeros_like(probs).scatter(0, indices, 1).bool()
    final_map = keep if pad else routing_map & keep
    return probs * final_map, final_map


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map, normalised scores) that the load-balancing losses see: plain top-k of softmax or of
    sigmoid scores normalised to sum 1, without groups, bias or capacity."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, indices = torch.topk(scores.detach(), k=topk, dim=1)
    return torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool(), scores


def switch_load_balancing_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int, num_experts: int, coeff: float
) -> torch.Tensor:
    """coeff x E x sum_i f_i P_i (Switch Transformer): f_i the share of routes to expert i, P_i its mean score,
    both over `total_tokens` tokens (this rank's scores are a part of that sum when tokens span ranks). The
    per-sequence loss passes sequences x experts columns, E staying the number of experts."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens)
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff x mean(logsumexp(logits)^2) (ST-MoE): keeps the router's logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff
