"""Megatron-LM's `torch_dist` tensor names and shapes <-> our canonical pieces.

Megatron-LM (megatron-core's `dist_checkpointing`, torch_dist backend) stores the same
canonical tensors as we do (QKV rows per query group, SwiGLU fc1 = [gate; up], one tensor
whatever the tp) with four differences, all mapped here piece by piece:
- layers are stacked: `decoder.layers.<i>.<rest>` of ours is the index `i` of the leading
  dimension of `decoder.layers.<rest>`, whose shape is (num_layers, *ours); with dense and MoE
  layers mixed (--moe-layer-freq) each layer is its own `decoder.layers.<i>.<rest>`;
- the routed experts of a layer are one tensor: our `mlp.experts.local_experts.<e>.<rest>`
  (global expert index e, whatever the expert-parallel layout) is the index `e` of the expert
  dimension of `mlp.experts.experts.<rest>` (after the layer dimension where stacked), as
  megatron-core's SequentialMLP shards it over expert-parallel ranks by global offset; the
  router (`mlp.router.weight`, `mlp.router.expert_bias`) and shared experts keep our names;
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
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.*)")
EXPERTS = "mlp.experts.experts."  # Megatron's name of the routed experts' tensors, expert index leading
NORM_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
STATE_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "fp32_param"}
OPTIMIZER = re.compile(r"optimizer\.(\w+)\.(.*)")


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """How Megatron-LM stores a model's layers: `stacked` along a leading layer dimension (a block of
    layers of one kind), or one tensor per layer (`decoder.layers.<i>.`: megatron-core's
    non-homogeneous layers, dense and MoE ones mixed by --moe-layer-freq); the routed experts of a
    layer are one tensor with a leading expert dimension of `num_experts`."""

    num_layers: int
    num_experts: int | None = None
    stacked: bool = True
    chained: bool = False  # expert parallelism: optimizer state of dense tensors `chained_0.`, experts' `chained_1.`


def megatron_layout(config, chained: bool = False) -> MegatronLayout:
    """The layout of a model with TransformerConfig `config`, as megatron-core's TransformerBlock
    decides it (an int --moe-layer-freq above 1 or a list: one tensor per layer); `chained`: saved with
    expert parallelism, where megatron-core's ChainedOptimizer (one optimizer for the dense parameters, one
    for the expert-parallel ones) prefixes each one's state with its index."""
    freq = config.moe_layer_freq
    mixed = isinstance(freq, list) or freq > 1
    return MegatronLayout(config.num_layers, config.num_moe_experts, not mixed, chained)


def _split_state(name: str) -> tuple[str, str]:
    """(Megatron's prefix for the state, the model tensor's name) of one of our names."""
    match = OPTIMIZER.match(name)
    if match and match.group(1) in STATE_NAMES:
        return f"optimizer.state.{STATE_NAMES[match.group(1)]}.", match.group(2)
    return "", name


def _rename(rest: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        if rest.startswith(old):
            return new + rest[len(old) :]
    return rest


def megatron_place(name: str, layout: MegatronLayout) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Megatron-LM's name of our canonical tensor `name`, and the leading (indices, sizes) our tensor
    has in it: (layer, expert) of (num_layers, num_experts) where stacked and an expert's."""
    prefix, model_name = _split_state(name)
    if prefix and layout.chained:
        prefix = f"chained_{1 if EXPERT.search(model_name) else 0}.{prefix}"
    match = LAYER.fullmatch(model_name)
    if match is None:
        return prefix + model_name, (), ()
    layer, rest = int(match.group(1)), _rename(match.group(2), NORM_NAMES)
    head, index, sizes = (
        ("decoder.layers.", (layer,), (layout.num_layers,)) if layout.stacked else (f"decoder.layers.{layer}.", (), ())
    )
    if expert := EXPERT.fullmatch(rest):
        rest = EXPERTS + expert.group(2)
        index, sizes = index + (int(expert.group(1)),), sizes + (layout.num_experts,)
    return prefix + head + rest, index, sizes


def our_tensors(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Our canonical (name, shape) of each tensor held by the Megatron-LM model tensor `name` of `shape`
    (one per layer for stacked ones, one per expert for the experts')."""
    if not name.startswith("decoder.layers."):
        return [(name, shape)]
    rest = name[len("decoder.layers.") :]
    first, _, after = rest.partition(".")
    layers = [(int(first), after, shape)] if first.isdigit() else [(i, rest, shape[1:]) for i in range(shape[0])]
    ours = {theirs: mine for mine, theirs in NORM_NAMES.items()}
    out = []
    for layer, rest, layer_shape in layers:
        rest, head = _rename(rest, ours), f"decoder.layers.{layer}."
        if rest.startswith(EXPERTS):
            tail = rest[len(EXPERTS) :]
            out += [(f"{head}mlp.experts.local_experts.{e}.{tail}", layer_shape[1:]) for e in range(layer_shape[0])]
        else:
            out.append((head + rest, layer_shape))
    return out


def to_megatron(piece: TensorPiece, layout: MegatronLayout) -> TensorPiece:
    """The same data as a piece of Megatron-LM's tensor."""
    name, index, sizes = megatron_place(piece.name, layout)
    if not index:
        return dataclasses.replace(piece, name=name)
    return TensorPiece(
        name,
        sizes + piece.global_shape,
        index + piece.offsets,
        (1,) * len(index) + piece.sizes,
        piece.dtype,
        lambda: piece.tensor()[(None,) * len(index)],
    )


# the linear layers whose `_extra_state` (fp8 metadata in Transformer Engine layers, None in local ones) a
# Megatron GPTModel asks for on load (the experts' one per expert), beside each layer's core attention
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
CORE_ATTENTION = "self_attention.core_attention"


def _extra_state_key(module: str, layout: MegatronLayout) -> str:
    """`<Megatron's module name>._extra_state/shard_<index>_<sizes>` of our module `module` (a layer's)."""
    name, index, sizes = megatron_place(module + ".weight", layout)
    index, sizes = index or (0,), sizes or (1,)
    return f"{name.removesuffix('.weight')}._extra_state/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, sizes))}"


def extra_state_objects(pieces: list[TensorPiece], layout: MegatronLayout) -> dict[str, list]:
    """Empty `_extra_state` objects of the layers' modules among `pieces` (our names) under Megatron's
    keys: the list of a rank's values, [None], which both layer kinds accept."""
    modules = set()
    for piece in pieces:
        match = LAYER.fullmatch(_split_state(piece.name)[1])
        if match:
            module = match.group(0).rsplit(".", 1)[0]
            modules.add(f"decoder.layers.{match.group(1)}.{CORE_ATTENTION}")
            if module.rsplit(".", 1)[-1] in LINEARS:
                modules.add(module)
    return {_extra_state_key(module, layout): [None] for module in sorted(modules)}
