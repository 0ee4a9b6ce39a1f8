"""Megatron-LM's `torch_dist` tensor names and shapes <-> our canonical pieces.

Megatron-LM (megatron-core's `dist_checkpointing`, torch_dist backend) stores the same
canonical tensors as we do (QKV rows per query group, SwiGLU fc1 = [gate; up], one tensor
whatever the tp) with three differences, all mapped here piece by piece:
- layers are stacked: `decoder.layers.<i>.<rest>` of ours is the index `i` of the leading
  dimension of `decoder.layers.<rest>`, whose shape is (num_layers, *ours);
- layer norms are named after the linear layer they precede
  (`input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`,
  `pre_mlp_layernorm.*` -> `mlp.linear_fc1.layer_norm_*`);
- optimizer state is `optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model name>`.
A tied embedding is stored once (no `output_layer.weight`), as ours. Vocabulary tensors keep
their padding rows on both sides (a layout padding to another size: `vocabulary.py`).
"""

from __future__ import annotations

import dataclasses
import re

from megatron.core.checkpointing.pieces import TensorPiece

LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
NORM_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
STATE_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "fp32_param"}
OPTIMIZER = re.compile(r"optimizer\.(\w+)\.(.*)")


def _split_state(name: str) -> tuple[str, str]:
    """(Megatron's prefix for the state, the model tensor's name) of one of our names."""
    match = OPTIMIZER.match(name)
    if match and match.group(1) in STATE_NAMES:
        return f"optimizer.state.{STATE_NAMES[match.group(1)]}.", match.group(2)
    return "", name


def megatron_name(name: str) -> tuple[str, int | None]:
    """Megatron-LM's name of our canonical tensor `name`, and its layer index (None: not a layer's)."""
    prefix, model_name = _split_state(name)
    match = LAYER.fullmatch(model_name)
    if match is None:
        return prefix + model_name, None
    rest = match.group(2)
    for ours, theirs in NORM_NAMES.items():
        if rest.startswith(ours):
            rest = theirs + rest[len(ours) :]
    return f"{prefix}decoder.layers.{rest}", int(match.group(1))


def our_tensors(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Our canonical (name, shape) of each tensor held by the Megatron-LM model tensor `name` of `shape`
    (one per layer for stacked ones)."""
    if not name.startswith("decoder.layers."):
        return [(name, shape)]
    rest = name[len("decoder.layers.") :]
    for ours, theirs in NORM_NAMES.items():
        if rest.startswith(theirs):
            rest = ours + rest[len(theirs) :]
    return [(f"decoder.layers.{i}.{rest}", shape[1:]) for i in range(shape[0])]


def to_megatron(piece: TensorPiece, num_layers: int) -> TensorPiece:
    """The same data as a piece of Megatron-LM's tensor."""
    name, layer = megatron_name(piece.name)
    if layer is None:
        return dataclasses.replace(piece, name=name)
    return TensorPiece(
        name,
        (num_layers,) + piece.global_shape,
        (layer,) + piece.offsets,
        (1,) + piece.sizes,
        piece.dtype,
        lambda: piece.tensor().unsqueeze(0),
    )


# modules whose `_extra_state` (fp8 metadata in Transformer Engine layers, None in local ones) a
# Megatron GPTModel asks for on load, one object per layer
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.core_attention",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def extra_state_objects(pieces: list[TensorPiece], num_layers: int) -> dict[str, list]:
    """Empty `_extra_state` objects of the layers among `pieces` (our names), under Megatron's keys
    `<module>._extra_state/shard_<layer>_<layers>`: the list of a rank's values, [None], which both
    layer kinds accept."""
    layers = {int(match.group(1)) for p in pieces if (match := LAYER.fullmatch(_split_state(p.name)[1]))}
    return {
        f"decoder.layers.{module}._extra_state/shard_{layer}_{num_layers}": [None]
        for layer in sorted(layers)
        for module in EXTRA_STATE_MODULES
    }
