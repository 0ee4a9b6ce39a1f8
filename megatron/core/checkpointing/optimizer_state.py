"""Canonical form of the optimizer's per-parameter state: what a checkpoint stores beside the model.

For every parameter `<name>` the Adam moments are fp32 tensors of the parameter's canonical
shape and order (see `pieces`): `optimizer.exp_avg.<name>` and `optimizer.exp_avg_sq.<name>`;
low-precision (bf16/fp16) weights add their fp32 master copy, `optimizer.master.<name>`. fp32
weights are their own master: the model tensor `<name>` is it.

A rank holds a contiguous range of each flattened local (tp-shard) parameter (the whole
parameter with the replicated optimizer; any range, partial rows included, with the
distributed one). The range is cut into row-aligned boxes (`flat_range_boxes`) and each box is
mapped to the global tensor like a parameter's shard (`box_pieces`), so state saved by one
layout (tp, pp, dp, cp, distributed optimizer on or off) loads into any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron.core.checkpointing.pieces import TensorPiece, box_pieces, flat_range_boxes

MOMENTS = ("exp_avg", "exp_avg_sq")


def state_name(key: str, name: str) -> str:
    """The checkpoint name of state `key` ('master', 'exp_avg', 'exp_avg_sq') of parameter `name`."""
    return f"optimizer.{key}.{name}"


def optimizer_state_pieces(
    state: dict, params: dict, sources: dict[str, Callable[[str], str]], *, tied_copies: bool
) -> list[TensorPiece]:
    """Canonical pieces of this rank's optimizer state.

    `state`: the optimizer's `state_dict_by_name()` (name -> [(start, numel, {key: fp32 view})]);
    `params`: name -> parameter (its InitSpec and local shape); `sources`: state key -> the checkpoint
    name of that state of a (canonical) parameter name; keys not in `sources` are left out.
    `tied_copies` as in `model_pieces`: the last stage's copy of a tied embedding takes the
    embedding's state on load and is never written.
    """
    pieces = []
    for name, ranges in state.items():
        if name == "step":
            continue
        param = params[name]
        spec = param.init_spec
        if spec.seed_name is not None and not tied_copies:
            continue
        canonical = spec.seed_name or name
        for start, numel, views in ranges:
            for flat, offsets, sizes in flat_range_boxes(tuple(param.shape), start, start + numel):
                begin = flat - start
                for key, source in sources.items():
                    data = views[key][begin : begin + math.prod(sizes)].view(sizes)
                    pieces.extend(box_pieces(source(canonical), spec, offsets, sizes, data, torch.float32))
    return pieces
