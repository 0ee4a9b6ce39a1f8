"""Delayed scaling's once-per-iteration update: reduce the amaxes an iteration recorded, push them into
each layer's amax history, and derive the scales the next iteration casts with.

Transformer Engine's DelayedScaling updates after every microbatch's forward; here the update runs once
per iteration, over every microbatch of the global batch, so that the scales do not depend on how the
batch is split into microbatches and data-parallel ranks ("one model, any layout"; torchao's delayed
scaling also syncs once per step). The amax of one logical tensor is reduced over the ranks holding its
pieces: a weight over tp (expert weights: expert-tp); inputs and output gradients over tp x cp and dp
(experts: expert-tp and expert-dp), or over tp x cp only with --tp-only-amax-red (Megatron's
amax-reduction group), in which case data-parallel replicas keep scales of their own data.
Until its first update a layer casts with current scales (as tensorwise does), not with a fixed first
scale: Transformer Engine's initial scale of 1 flushes small gradients, by an amount that depends on
how the loss is split over microbatches and ranks. history[0] is the newest amax; scale =
fp8_max / amax / 2^margin with amax the history's max (`max`) or its newest entry (`most_recent`),
the previous scale kept where that amax is 0 or not finite.
"""

from __future__ import annotations

import torch

from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.recipe import GRAD, INPUT, WEIGHT, fp8_max
from megatron.core.fp8.scaling import all_reduce_max


def delayed_gemms(modules) -> list[Fp8Gemms]:
    """Every delayed-scaling FP8 layer of `modules` (this rank's model chunks), in module order."""
    found = []
    for module in modules:
        for sub in module.modules():
            gemms = getattr(sub, "fp8", None)
            if isinstance(gemms, Fp8Gemms) and gemms.recipe.delayed:
                found.append(gemms)
    return found


def _reduce(rows: list[torch.Tensor], groups) -> None:
    """Max-reduce the [3] pending amaxes `rows` in place: the weight column over groups[0], the input and
    gradient columns over the rest (one flat collective per group)."""
    if not rows:
        return
    flat = torch.stack(rows)
    weights = all_reduce_max(flat[:, WEIGHT].contiguous(), groups[0])
    activations = all_reduce_max(flat[:, [INPUT, GRAD]].contiguous(), *groups[1:])
    for row, weight, activation in zip(rows, weights, activations):
        row[WEIGHT] = weight
        row[INPUT], row[GRAD] = activation[0], activation[1]


def update_delayed_scaling(modules, mesh) -> None:
    """Fold this iteration's amaxes into every delayed-scaling layer's history and scales (a collective
    over the groups named in the module doc; every rank of a stage calls it with the same layers)."""
    layers = delayed_gemms(modules)
    if not layers:
        return
    recipe = layers[0].recipe
    dp = () if recipe.tp_only_amax_red else (mesh.dp_group,)
    edp = () if recipe.tp_only_amax_red else (mesh.edp_group,)
    dense = [g.owner.fp8_amax_pending for g in layers if not g.expert]
    experts = [g.owner.fp8_amax_pending for g in layers if g.expert]
    _reduce(dense, (mesh.tp_group, mesh.tp_cp_group, *dp))
    _reduce(experts, (mesh.etp_group, mesh.etp_group, *edp))
    dtypes = [recipe.dtype(t) for t in (INPUT, WEIGHT, GRAD)]
    limits = torch.tensor([fp8_max(d) for d in dtypes])
    with torch.no_grad():
        for gemms in layers:
            gemms.has_history = True
            owner = gemms.owner
            history = owner.fp8_amax_history
            history.copy_(torch.roll(history, 1, dims=0))
            history[0] = owner.fp8_amax_pending
            owner.fp8_amax_pending.zero_()
            newest = history.amax(dim=0) if recipe.amax_compute_algo == "max" else history[0]
            scale = limits.to(newest.device) / newest / 2.0**recipe.margin
            usable = (newest > 0) & torch.isfinite(newest)
            owner.fp8_scale.copy_(torch.where(usable, scale, owner.fp8_scale))


def resume_delayed_scaling(modules) -> None:
    """After a checkpoint's amax histories and scales were loaded: cast with them (not current scales)."""
    for gemms in delayed_gemms(modules):
        gemms.has_history = True
