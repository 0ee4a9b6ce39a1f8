"""Canonical, layout-independent form of a model's parameters: what a checkpoint stores.

A checkpoint holds every tensor once, under its fully qualified name (pipeline
stages keep global layer indices, so names are the same in every layout), at its
global shape. A rank contributes `TensorPiece`s: boxes (offsets, sizes) of those
global tensors that it holds. The canonical form of each kind of parameter:

- vocabulary tensors (`embedding.word_embeddings.weight`, `output_layer.weight`):
  [vocab_size, hidden], the padding rows (>= vocab_size) dropped; they are not
  stored and keep their initial value (zero) on load.
- `...self_attention.linear_qkv.weight/bias`: rows per query group,
  [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...],
  `head_dim` rows per head. A tp rank holds whole groups, a contiguous block of
  rows, so one piece per rank.
- `...mlp.linear_fc1.weight/bias` with SwiGLU: [2 ffn, hidden] = [gate; up]. A tp
  rank holds matching slices of both halves: two pieces.
- row-parallel weights (`linear_proj`, `linear_fc2`): [out, in], a tp rank holds
  a block of columns.
- tied embeddings: stored once as `embedding.word_embeddings.weight`; the last
  stage's copy of the output layer (its InitSpec names the embedding as
  `seed_name`) is not written, and is filled from the embedding on load.
Everything else (norms, biases of row-parallel layers, position embeddings) is
whole on every rank that holds it; replicas are written once (DCP deduplicates
pieces with equal name and offsets).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megatron.core.tensor_parallel.sharding import held_ranges


@dataclass(frozen=True)
class TensorPiece:
    """A box of the global tensor `name`: `offsets` and `sizes` in `global_shape`.

    `tensor()` returns the local data: read when saving, written in place when
    loading (a view of a parameter), or produced on demand (a converter reading
    one tensor at a time).
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    tensor: Callable[[], torch.Tensor]

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> "TensorPiece":
        """All of `tensor` (one process, or a replicated tensor)."""
        shape = tuple(tensor.shape)
        return cls(name, shape, (0,) * len(shape), shape, tensor.dtype, lambda: tensor)


def _clip(ranges: list[tuple[int, int]], limit: int) -> list[tuple[int, int, int]]:
    """(global start, global stop, local start) of each range cut at `limit`; empty ones dropped."""
    clipped, local = [], 0
    for start, stop in ranges:
        if min(stop, limit) > start:
            clipped.append((start, min(stop, limit), local))
        local += stop - start
    return clipped


def parameter_pieces(name: str, param: torch.Tensor) -> list[TensorPiece]:
    """The pieces of the canonical tensor that this rank's shard `param` holds (see module doc).

    The name is the parameter's own, or the `seed_name` of a tied copy (the tensor it equals).
    """
    spec = param.init_spec
    shape = list(spec.full_shape)
    ranges = [[(0, size)] for size in shape]
    if spec.shard is not None:
        ranges[spec.shard.dim] = held_ranges(spec.shard, shape[spec.shard.dim])
    if spec.valid_rows is not None:
        shape[0] = spec.valid_rows  # vocabulary padding is not part of the canonical tensor
    data = param.detach()
    pieces = []
    for boxes in itertools.product(*(_clip(r, size) for r, size in zip(ranges, shape))):
        offsets = tuple(start for start, _, _ in boxes)
        sizes = tuple(stop - start for start, stop, _ in boxes)
        view = data[tuple(slice(local, local + size) for (_, _, local), size in zip(boxes, sizes))]
        pieces.append(TensorPiece(spec.seed_name or name, tuple(shape), offsets, sizes, param.dtype,
                                  lambda view=view: view))
    return pieces


def model_pieces(named_parameters: Iterable[tuple[str, torch.Tensor]], *, tied_copies: bool) -> list[TensorPiece]:
    """Canonical pieces of a rank's parameters (all its model chunks' `named_parameters()`).

    `tied_copies`: include the last stage's copy of a tied embedding (to fill it on load);
    never written on save, where the embedding itself is stored.
    """
    pieces = []
    for name, param in named_parameters:
        if param.init_spec.seed_name is not None and not tied_copies:
            continue
        pieces.extend(parameter_pieces(name, param))
    return pieces
