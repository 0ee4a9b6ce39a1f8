"""Delayed scaling's once-per-iteration update: reduce the amaxes an iteration recorded, push them into
each layer's amax history, and derive the scales the next iteration casts with.

Transformer Engine's DelayedScaling updates after every microbatch's forward; here the update runs once
per iteration, over every microbatch of the global batch, so that the scales do not depend on how the
batch is split into microbatches and data-parallel ranks ("one model, any layout"; torchao's delayed
scaling also syncs once per step). The amax of one logical tensor is reduced over the ranks holding its
pieces: a weight over tp (expert weights: expert-tp); inputs and output gradients over tp x cp and dp
(experts: expert-tp and expert-dp), or over tp x cp only with --tp-only-amax-red (Megatron's
amax-reduction group), in which case data-parallel replicas keep scales of their own data.
Until its first update a layer runs its GEMMs in the model's precision and only records amaxes (one
calibrating iteration), not FP8 with a fixed first scale: Transformer Engine's initial scale of 1 flushes
small gradients by an amount that depends on how the loss is split over microbatches and ranks, and
current scales would depend on which tokens an expert's GEMM groups under expert parallelism.
history[0] is the newest amax; scale = fp8_max / amax / 2^margin with amax the history's max (`max`) or
its newest entry (`most_recent`), the previous scale kept where that amax is 0 or not finite.
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


def gradient_factor(mesh) -> int:
    """How much larger this layout's backward gradients are than one process's: each microbatch's backward
    starts from its loss times 1 / (microbatches per rank x token positions per cp rank) (the executor), so
    by dp x cp; the gradients are averaged over dp x cp only after the backward."""
    return mesh.dp_size * mesh.cp_size


def _derive_scales(gemms: Fp8Gemms, factor: int) -> None:
    """Scales from the amax history (history in one process's units: the gradient's times `factor` here)."""
    recipe, owner = gemms.recipe, gemms.owner
    history = owner.fp8_amax_history
    newest = history.amax(dim=0) if recipe.amax_compute_algo == "max" else history[0]
    limits = torch.tensor([fp8_max(recipe.dtype(t)) for t in (INPUT, WEIGHT, GRAD)], device=newest.device)
    layout = torch.tensor([1.0, 1.0, float(factor)], device=newest.device)
    scale = limits / (newest * layout) / 2.0**recipe.margin
    usable = (newest > 0) & torch.isfinite(newest)
    owner.fp8_scale.copy_(torch.where(usable, scale, owner.fp8_scale))
    owner.fp8_scale_inv.copy_(owner.fp8_scale.reciprocal())  # the GEMMs' scale_inv, once per update
    gemms.has_history = True


def update_delayed_scaling(modules, mesh) -> None:
    """Fold this iteration's amaxes into every delayed-scaling layer's history and scales (a collective
    over the groups named in the module doc; every rank of a stage calls it with the same layers). The
    history holds gradient amaxes in one process's units (`gradient_factor`), so a checkpoint's history
    means the same in every layout."""
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
    factor = gradient_factor(mesh)
    with torch.no_grad():
        for gemms in layers:
            owner = gemms.owner
            history = owner.fp8_amax_history
            history.copy_(torch.roll(history, 1, dims=0))
            history[0] = owner.fp8_amax_pending
            history[0, GRAD] /= factor
            owner.fp8_amax_pending.zero_()
            _derive_scales(gemms, factor)


def resume_delayed_scaling(modules, mesh) -> None:
    """After a checkpoint's amax histories and scales were loaded: the scales for this layout, from the
    histories (the same values in the layout that saved them), and cast with them from now on."""
    with torch.no_grad():
        for gemms in delayed_gemms(modules):
            _derive_scales(gemms, gradient_factor(mesh))
