"""Auxiliary losses that reach the backward pass without changing the loss value (megatron-core's
MoEAuxLossAutoScaler), and the per-iteration sums Megatron logs as `load_balancing_loss` / `z_loss`.

An auxiliary loss is attached to an activation it was computed beside: the activation passes through
unchanged and, in backward, the loss receives the gradient `scale` -- the main loss's backward scale
(fp16 loss scale x cp / microbatches per iteration, set by the training step through `set_aux_loss_scale`),
so its gradient is added to the parameters exactly as if `scale x aux loss` were part of the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# how Megatron reduces each logged value: summed over tp x cp (each rank holds part of the token sum) and
# averaged over dp, or (z_loss) the rank's own value
SUMMED_OVER_TP_CP = ("load_balancing_loss", "seq_load_balancing_loss")
LOGGED = (*SUMMED_OVER_TP_CP, "z_loss")


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return activation

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss) * ctx.scale, None


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`activation` unchanged; backward adds d(aux_loss) x `scale` (read at backward time: a shared tensor)."""
    return _AttachAuxLoss.apply(activation, aux_loss, scale)


def routers(modules):
    """Every router in `modules` (anything with a tracked-loss dict)."""
    return [m for module in modules for m in module.modules() if hasattr(m, "tracked_losses")]


def set_aux_loss_scale(modules, scale: float) -> None:
    """The backward scale of every router's auxiliary losses: Megatron's loss scale x cp / microbatches."""
    for router in routers(modules):
        router.aux_loss_scale.fill_(scale)


def reduced_aux_losses(modules, mesh, num_microbatches: int, num_moe_layers: int) -> dict[str, torch.Tensor]:
    """Megatron's logged MoE losses of one iteration (device tensors, valid on the last rank), then cleared:
    per name the sum over this rank's MoE layers and microbatches, summed over pipeline stages, reduced as
    `SUMMED_OVER_TP_CP` says, and divided by microbatches and MoE layers. A collective for every rank."""
    found = routers(modules)
    out = {}
    for name in sorted(_names(modules)):
        total = sum((r.tracked_losses.pop(name, 0.0) for r in found), torch.zeros((), device=_device(modules)))
        total = total.float()
        if dist.get_world_size(mesh.pp_group) > 1:
            dist.all_reduce(total, group=mesh.pp_group)
        if name in SUMMED_OVER_TP_CP:
            if dist.get_world_size(mesh.tp_cp_group) > 1:
                dist.all_reduce(total, group=mesh.tp_cp_group)
            if mesh.dp_size > 1:
                dist.all_reduce(total, group=mesh.dp_group)
                total /= mesh.dp_size
        out[name] = total / (num_microbatches * num_moe_layers)
    return out


def _names(modules) -> set[str]:
    """The names this model logs, known on every rank from the config (a stage without MoE layers too)."""
    config = modules[0].config
    if config.num_moe_experts is None:
        return set()
    names = set()
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type == "aux_loss":
        names.add("load_balancing_loss")
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type == "seq_aux_loss":
        names.add("seq_load_balancing_loss")
    if config.moe_z_loss_coeff is not None:
        names.add("z_loss")
    return names


def _device(modules) -> torch.device:
    return next(p for m in modules for p in m.parameters()).device
